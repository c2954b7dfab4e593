"""The static-shape decode step: one function from fixed buffers to the next tokens, captured on CUDA.

:class:`DecodeStep` runs ``k`` decode steps (``k = 1``, or a burst of ``decode_steps_per_sync``) for
rows ``0..B-1`` of the KV cache and reads their tokens and log-probs back once. Its inputs live in
buffers allocated once per cache (``tokens``, ``lengths``, the seeded streams' keys, each (S,) for S
running rows at most, and the rows' block tables (S, W)), and one step is :meth:`DecodeStep._forward`:
the model's decode, the draws and the
token choice (greedy, temperature, top-k, top-p; seeded rows' counter-based uniforms), the chosen
tokens' log-probs, and the buffers advanced for the next step. Nothing in it reads the device or
branches on a device value, and every shape is fixed by ``(bucket, span)``, so:

- on CUDA (``capture``) the batch is padded to a bucket (:func:`decode_buckets`; verl's
  ``rollout.cudagraph_capture_sizes`` when given) and each step is a replay of a ``torch.cuda.CUDAGraph``
  captured once per (bucket, span, sampling settings). The engine's generator is registered with the
  graph, so unseeded draws advance on every replay. Padding rows (token 0 at position 0, their table
  all block 0: the pool's scratch block, never given to a sequence) never touch a real row's
  result: every op is row-wise (one row's logits do not depend on another's). Attention there gathers
  a span of each row's table (:mod:`.attention`), rounded up to :data:`SPAN_BLOCK` positions;
- on the CPU nothing is captured and the batch is not padded (``pad=False``): the same function runs
  eagerly at the running batch's size, its attention reading each row's valid keys in place (the
  paged kernel, :mod:`.paged_kernel`). This is what
  ``enforce_eager=false`` means on the CPU: compiling the step with inductor did not beat the eager
  step with oneDNN's packed weights (docs/benchmarks.md), so the CPU runs eagerly either way.

Graphs hold the addresses of the cache, the weights and the buffers: when any of them is re-created
(``free_cache_engine`` re-allocates the block pool per rollout, a weight release re-allocates the weights)
the graphs are dropped and captured again on first use, and ``stats["graph_capture_s"]`` counts the
time. In-place weight updates keep the addresses, so the next replay reads the new weights.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from hybridflow.workers.rollout.engine.attention import pick_backend
from hybridflow.workers.rollout.engine.sampling import SamplingParams, choose_tokens, seeded_uniforms

SPAN_BLOCK = 256  # a captured span-attention step reads a multiple of this many positions


def decode_buckets(max_num_seqs: int, capture_sizes=None) -> list[int]:
    """Batch sizes a captured step is padded to: ``capture_sizes`` (verl's
    ``rollout.cudagraph_capture_sizes``) when given, else vLLM's list
    ``[1, 2, 4] + range(8, 256, 8) + range(256, 513, 16)`` up to ``max_num_seqs`` (and
    ``max_num_seqs`` itself when it is below 512). A batch above the last bucket runs uncaptured."""
    if capture_sizes:
        sizes = sorted({int(size) for size in capture_sizes})
        if sizes[0] < 1:
            raise ValueError(f"cudagraph_capture_sizes={list(capture_sizes)}: sizes must be >= 1")
        return sizes
    default = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    sizes = [size for size in default if size <= max_num_seqs]
    if max_num_seqs < 512 and max_num_seqs not in sizes:
        sizes.append(int(max_num_seqs))
    return sizes


@dataclass
class StepRows:
    """What the host hands a decode burst for its B running rows (host lists, uploaded once)."""

    tokens: list[int]  # (B,) the token each row feeds (its last chosen)
    lengths: list[int]  # (B,) tokens already in each row's blocks
    tables: list[list[int]]  # (B, <= W) each row's block table (its blocks cover the burst's positions)
    seeds: list[tuple[int, int, int]] | None  # (B,) (seed, sample, position) per row; None: no seeded row
    seeded: list[bool] | None  # (B,) which rows draw from their seeded stream
    # (B,) rotary position - cache position per row (image prompts' rope_delta); None: all 0
    rope_offsets: list[int] | None = None


class _Buffers:
    """The step's fixed inputs and outputs for ``slots`` rows and bursts of up to ``steps``."""

    def __init__(self, slots: int, steps: int, width: int, device: torch.device) -> None:
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.tokens, self.lengths = zeros(slots), zeros(slots)  # (S,)
        self.tables = zeros(slots, width)  # (S, W) block ids; padding rows: block 0
        self.keys = zeros(3, slots)  # (3, S): seed, sample index, stream position
        self.seeded = zeros(slots, dtype=torch.bool)  # (S,)
        self.rope_offsets = zeros(slots)  # (S,) added to lengths for the rotary positions
        self.log_probs = zeros(slots, dtype=torch.float32)  # (S,) the last step's
        self.out_tokens = zeros(steps, slots)  # (K, S): a burst's tokens, read back once
        self.out_log_probs = zeros(steps, slots, dtype=torch.float32)


class DecodeStep:
    """The engine's static decode step over ``model`` and ``cache`` (see the module docstring).
    ``generator``: the engine's (unseeded draws); ``capture``: CUDA graphs; ``pad``: pad the batch to
    a bucket (default: when capturing); ``max_steps``: the longest burst; ``stats``: the dict its
    counters go to (the engine's)."""

    def __init__(
        self,
        model,
        cache,
        generator: torch.Generator,
        buckets: list[int],
        max_rows: int,
        max_len: int,
        capture: bool = False,
        pad: bool | None = None,
        max_steps: int = 1,
        stats: dict | None = None,
    ) -> None:
        if capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA engine")
        if capture and model.shard.parallel:
            raise NotImplementedError(
                "captured decode with tensor-parallel generation is not implemented (the collectives "
                "would need capturing per rank): set rollout.enforce_eager=true"
            )
        self.model, self.cache, self.generator = model, cache, generator
        self.max_rows, self.max_len = int(max_rows), int(max_len)
        self.width = -(-self.max_len // cache.block_size)  # blocks of the longest sequence
        self.buckets = list(buckets)
        self.capture = bool(capture)
        self.pad = self.capture if pad is None else bool(pad)
        self.max_steps = int(max_steps)
        self.attention = pick_backend(model.device, model.dtype)
        self._buffers: _Buffers | None = None
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._signature: tuple | None = None
        self._offsets = False  # whether the rows of this burst read RoPE at lengths + rope_offsets
        self._pool = None
        self.capture_error: str | None = None  # why capturing stopped (then the step runs uncaptured)
        self.stats = stats if stats is not None else {}
        # uncaptured_steps: steps that could not replay a graph while capturing (batch above the buckets)
        for name in ("graph_captures", "graph_replays", "uncaptured_steps", "padded_rows"):
            self.stats[name] = 0
        self.stats["graph_capture_s"] = 0.0

    # ------------------------------------------------------------------ the host's view
    def bucket(self, batch: int) -> int:
        """Rows the step runs for ``batch`` running rows: the smallest bucket that holds them (at most
        ``max_rows``) when padding, else ``batch``."""
        if not self.pad:
            return batch
        for size in self.buckets:
            if size >= batch:
                return min(size, self.max_rows)
        return batch

    def run(
        self, rows: StepRows, params: SamplingParams, steps: int
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``steps`` decode steps of the rows (all sharing ``params``) → tokens and log-probs, each
        (steps, B) host lists: the burst's one read back."""
        batch = len(rows.tokens)
        buffers = self._prepare(rows)
        size = self.bucket(batch)
        self.stats["padded_rows"] += (size - batch) * steps
        seeded = rows.seeds is not None and not params.greedy
        for i in range(steps):
            span = self._span(max(rows.lengths) + i + 1)
            key = (size, span, params.choice_key()[:4], seeded, self._offsets)
            graph = self._graph_or_none(key, params) if self._capturable(size) else None
            if graph is not None:
                graph.replay()
                self.stats["graph_replays"] += 1
            else:
                self._forward(size, span, params, seeded)
                self.stats["uncaptured_steps"] += int(self.capture)
            buffers.out_tokens[i, :size].copy_(buffers.tokens[:size])
            buffers.out_log_probs[i, :size].copy_(buffers.log_probs[:size])
        host = torch.stack(
            (buffers.out_tokens[:steps, :batch].double(), buffers.out_log_probs[:steps, :batch].double())
        ).tolist()
        return [[int(t) for t in row] for row in host[0]], host[1]

    def reset(self) -> None:
        """Drop the graphs and buffers (their addresses are about to go: cache or weights released)."""
        self._graphs.clear()
        self._buffers, self._signature = None, None

    # ------------------------------------------------------------------ the device's side
    def _forward(self, size: int, span: int | None, params: SamplingParams, seeded: bool) -> None:
        """One decode step of rows ``0..size-1`` from the buffers, into the buffers: the chosen tokens
        and their log-probs, lengths and stream positions advanced. Static shapes, no host read."""
        b = self._buffers
        tokens, lengths = b.tokens[:size], b.lengths[:size]
        rope = lengths + b.rope_offsets[:size] if self._offsets else None
        logits = self.model.decode(
            tokens,
            lengths,
            self.cache,
            b.tables[:size],
            span=span,
            attention=self.attention,
            rope_positions=rope,
        )
        uniforms = None
        if seeded:  # seeded rows from their streams, the others from the engine's generator
            drawn = 1.0 - torch.rand(size, generator=self.generator, device=tokens.device).double()
            keys = b.keys[:, :size]
            uniforms = torch.where(b.seeded[:size], seeded_uniforms(keys[0], keys[1], keys[2]), drawn)
        chosen, log_probs = choose_tokens(logits, params, self.generator, uniforms)
        tokens.copy_(chosen)
        b.log_probs[:size].copy_(log_probs)
        lengths.add_(1)
        if seeded:  # the streams' positions (read only by seeded steps; uploaded with every burst)
            b.keys[2, :size].add_(1)

    def _prepare(self, rows: StepRows) -> _Buffers:
        """The buffers (re-made when the cache or the weights moved), with the rows uploaded."""
        signature = self._addresses()
        if signature != self._signature:
            self.reset()
            self._signature = signature
            self._buffers = _Buffers(self.max_rows, self.max_steps, self.width, self.model.device)
        b, batch = self._buffers, len(rows.tokens)
        b.tokens[:batch].copy_(torch.tensor(rows.tokens), non_blocking=True)
        b.lengths[:batch].copy_(torch.tensor(rows.lengths), non_blocking=True)
        used = max(len(table) for table in rows.tables)
        tables = torch.tensor([table + [0] * (used - len(table)) for table in rows.tables], dtype=torch.long)
        b.tables[:batch, :used].copy_(tables, non_blocking=True)
        self._offsets = rows.rope_offsets is not None
        if self._offsets:
            b.rope_offsets[:batch].copy_(torch.tensor(rows.rope_offsets), non_blocking=True)
            b.rope_offsets[batch:].zero_()
        if rows.seeds is not None:
            b.keys[:, :batch].copy_(torch.tensor(rows.seeds, dtype=torch.long).T, non_blocking=True)
            b.seeded[:batch].copy_(torch.tensor(rows.seeded), non_blocking=True)
        if self.pad:  # padding rows: token 0 at position 0 of block 0, no seeded stream
            for tensor in (b.tokens, b.lengths, b.seeded, b.tables):
                tensor[batch:].zero_()
        return b

    def _span(self, needed: int) -> int | None:
        """Positions the attention reads: None with the paged kernel (each row its valid keys); else
        ``needed`` (the burst's last step's), rounded up to :data:`SPAN_BLOCK` when captured."""
        if self.attention == "kernel":
            return None
        if not self.capture:
            return needed
        return min(self.width * self.cache.block_size, -(-needed // SPAN_BLOCK) * SPAN_BLOCK)

    def _capturable(self, size: int) -> bool:
        """Whether a step of ``size`` rows replays a graph (a batch above the last bucket: not)."""
        return self.capture and size <= self.buckets[-1]

    def _addresses(self) -> tuple:
        """Where the cache and the weights live now (a graph replays reads and writes there)."""
        model, cache = self.model, self.cache
        return (
            cache.num_blocks,
            cache.layers[0][0].data_ptr(),
            cache.layers[-1][1].data_ptr(),
            model.embed.data_ptr(),
            model.layers[-1].o_proj.data_ptr(),
            model.lm_head.data_ptr(),
        )

    def _graph_or_none(self, key: tuple, params: SamplingParams):
        """:meth:`_graph`, or None when capturing fails (said once, kept in ``capture_error``): the next
        steps run uncaptured."""
        try:
            return self._graph(key, params)
        except Exception as error:  # noqa: BLE001 - a capture failure degrades, it does not stop a rollout
            self.capture_error = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"CUDA graph capture failed ({self.capture_error}); decoding uncaptured", stacklevel=2
            )
            self._graphs.clear()
            self.capture = False
            return None

    def _graph(self, key: tuple, params: SamplingParams):
        """The graph of ``key`` (bucket, span, sampling settings, seeded), captured on first use."""
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        start = time.perf_counter()
        size, span, _, seeded, _ = key
        b = self._buffers
        inputs = (b.tokens, b.lengths, b.keys, b.log_probs, b.tables)
        saved = [t.clone() for t in inputs]
        rng = self.generator.get_state()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up (sizes workspaces)
                self._forward(size, span, params, seeded)  # one step: a second could pass the room
            torch.cuda.current_stream().wait_stream(stream)
            self.generator.set_state(rng)  # before registering: capture records offsets from here
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            if not params.greedy:  # its draws advance on every replay
                graph.register_generator_state(self.generator)
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(size, span, params, seeded)
            torch.cuda.synchronize()
        finally:  # the warm-up's K/V writes are those the real step makes again; the rest is undone
            for tensor, value in zip(inputs, saved, strict=True):
                tensor.copy_(value)
            self.generator.set_state(rng)
        self._graphs[key] = graph
        self.stats["graph_captures"] += 1
        self.stats["graph_capture_s"] += time.perf_counter() - start
        return graph
