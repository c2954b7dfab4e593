"""The embedded generation engine: a continuous-batching scheduler over :class:`EngineModel`.

Each :meth:`LLMEngine.step` admits waiting requests onto free KV blocks (:mod:`.block_scheduler`: the
paged cache of :mod:`.kv_cache`; a prompt's cached prefix is shared and only the tokens past it are
prefilled; the ``n`` samples of a request share one prefill and its full blocks), then decodes one
token for every running sequence, taking blocks as sequences grow and preempting the newest when the
pool runs out (recomputed later, with the same output). Sequences leave the batch the step they
finish, and new requests join at the next step, so a long sequence never holds up the rest. A weight
change flushes the prefix cache (:attr:`EngineModel.weights_version`), so keys and values computed with
old weights are never reused.

With ``decode_steps_per_sync`` = k > 1 one step decodes up to k tokens per sequence on the device and
reads them back once (a GPU idles while the host reads); stops and lengths are then applied on the host
exactly as step by step, dropping at most k - 1 tokens drawn past a stop. Decoding is the static step of
:mod:`.decode_step` (fixed buffers, sampling inside; CUDA graphs per batch bucket unless
``enforce_eager``) wherever the sequences share their sampling settings with no logits processor, stop
checker, top-log-prob or streamed request; else the eager step (``eager_reasons``). A burst also needs no
request waiting for a slot and stops at every sequence's remaining tokens and cache room. Greedy and
seeded samples are token for token those of k = 1. Two ways in:

- :meth:`LLMEngine.generate_batch` — a list of prompts in, their completions out (the rollout's path);
- ``await engine.generate(prompt_ids, params)`` — one request; many concurrent calls (multi-turn
  conversations) share the running batch (:mod:`.async_api`).

**One request fails alone.** A request is checked when it is added (token ids within the vocabulary,
a seed within int64, room in the context and the cache: ``ValueError``). A request whose prefill
raises inside the engine is retried alone and, failing again, ends with ``finish_reason="error"`` and
``GenerationResult.error`` (``generate`` raises :class:`EngineRequestError`); a logits processor or
stop checker that raises fails its own request. The batch's other requests go on.
"""

from __future__ import annotations

import hashlib
import itertools
import threading

import torch

from hybridflow.workers.rollout.engine.accept import TokenAcceptance
from hybridflow.workers.rollout.engine.async_api import AsyncEngineAPI
from hybridflow.workers.rollout.engine.block_pool import BlockPool
from hybridflow.workers.rollout.engine.block_scheduler import BlockScheduler, PrefillItem
from hybridflow.workers.rollout.engine.decode_step import DecodeStep, StepRows, decode_buckets
from hybridflow.workers.rollout.engine.kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from hybridflow.workers.rollout.engine.model import EngineModel
from hybridflow.workers.rollout.engine.requests import (
    Completion,
    EngineRequest,
    GenerationResult,
    RunningSequence,
    finished_completion,
    raise_failed,
    stream_keys,
)
from hybridflow.workers.rollout.engine.routing import captured_ids, new_record, prefix_caching_while_recording
from hybridflow.workers.rollout.engine.sampling import SamplingParams
from hybridflow.workers.rollout.engine.vision import image_inputs_past_prefix


class LLMEngine(AsyncEngineAPI, TokenAcceptance):
    """``max_num_seqs`` sequences run at once at most, each at most ``max_model_len`` positions, on a
    pool of ``num_blocks`` KV blocks of ``block_size`` positions (default: as many as
    ``max_num_seqs`` sequences of ``max_model_len`` fill); a prefill processes at most
    ``max_num_batched_tokens`` padded new tokens (at least one request). ``enable_prefix_caching``:
    full blocks are keyed and shared across requests (off: only the samples of a request share).
    ``record_routing``: every completion carries its tokens' expert ids (an MoE model, router replay
    R3, :mod:`.routing`); turns prefix caching off and decodes with the eager step."""

    def __init__(
        self,
        model: EngineModel,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: list[int],
        max_num_batched_tokens: int = 8192,
        seed: int = 0,
        allocate_cache: bool = True,
        decode_steps_per_sync: int = 1,
        enforce_eager: bool = False,
        cudagraph_capture_sizes: list[int] | None = None,
        pad_batches: bool | None = None,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        enable_prefix_caching: bool = True,
        record_routing: bool = False,
    ) -> None:
        self.record_routing = bool(record_routing)
        enable_prefix_caching = prefix_caching_while_recording(
            model.spec, record_routing, enable_prefix_caching
        )
        if max_model_len > model.max_positions:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the engine's {model.max_positions} positions"
            )
        self.model = model
        self.max_model_len = int(max_model_len)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        if int(decode_steps_per_sync) < 1:
            raise ValueError(f"decode_steps_per_sync={decode_steps_per_sync} must be at least 1")
        self.decode_steps_per_sync = int(decode_steps_per_sync)
        self.max_num_seqs = int(max_num_seqs)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        if num_blocks is None:
            num_blocks = self.max_num_seqs * -(-self.max_model_len // int(block_size))
        # one more than the scheduler's blocks: block 0 is scratch (.block_pool)
        self.cache = PagedKVCache(
            model.spec, int(num_blocks) + 1, block_size, model.dtype, model.device, allocate=allocate_cache
        )
        self.scheduler = BlockScheduler(
            BlockPool(self.cache.num_blocks - 1, block_size, self.enable_prefix_caching),
            self.max_num_seqs,
            self.max_num_batched_tokens,
        )
        self._weights_seen = model.weights_version
        self.generator = torch.Generator(device=model.device).manual_seed(int(seed))
        # static_steps: decode steps of the static step (decode_step.py); eager_steps: of the eager
        # fallback, which eager_reasons counts by reason
        self.stats = {"static_steps": 0, "eager_steps": 0}
        self.eager_reasons: dict[str, int] = {}
        self.decoder = DecodeStep(
            model,
            self.cache,
            self.generator,
            decode_buckets(max_num_seqs, cudagraph_capture_sizes),
            max_rows=self.max_num_seqs,
            max_len=self.max_model_len,
            # an MoE layer reads its experts' token counts to the host (.moe): not capturable
            capture=not enforce_eager and model.device.type == "cuda" and model.spec.moe is None,
            pad=pad_batches,
            max_steps=self.decode_steps_per_sync,
            stats=self.stats,
        )
        self._running: list[RunningSequence] = []  # in admission order (preempted from the end)
        self._ids = itertools.count()
        self._loop_task = None
        # step_in_thread: the async API steps in ``_executor``'s thread (requests join through the lock,
        # aborts asked while a step runs wait in ``_pending_aborts``, results go back to the loop)
        self.step_in_thread = False
        self._executor = None
        self._lock = self.scheduler.lock
        self._pending_aborts: list[str] = []
        self._event_loop = None
        self._stepping_in_thread = False
        self._step_thread: threading.Thread | None = None
        # host_reads: decode results read back to the host (one per step, or one per burst)
        self.stats.update(
            prefill_tokens=0,
            decode_steps=0,
            generated_tokens=0,
            host_reads=0,
            aborted_requests=0,
            failed_requests=0,
            prefix_cache_flushes=0,
            preemptions=0,
        )

    # ------------------------------------------------------------------ public API
    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        request_id: str | None = None,
        images: dict | None = None,
    ) -> EngineRequest:
        """Queue a prompt for ``n`` samples; returns the request (its ``completions`` fill as they end).
        ``images``: a vision-language model's ``{"pixel_values", "image_grid_thw"}`` for the prompt's
        ``<|image_pad|>`` tokens (verl's ``multi_modal_inputs``; None or {} for a text prompt)."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt: the engine needs at least one prompt token")
        vocab = self.model.full_spec.vocab_size
        outside = [t for t in prompt_ids if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"token id {outside[0]} is outside the model's vocabulary [0, {vocab})")
        images = self._check_images(prompt_ids, images, request_id)
        if params.seed is not None and not -(2**63) <= params.seed < 2**63:
            raise ValueError(f"seed {params.seed} does not fit in a signed 64-bit integer")
        max_len = self.max_model_len
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                f"max_model_len={max_len}"
            )
        if n > self.max_num_seqs:
            raise ValueError(f"n={n} samples exceed max_num_seqs={self.max_num_seqs}")
        pool = self.scheduler.pool
        needed = self.scheduler.admission_blocks(len(prompt_ids), n)
        if needed > pool.num_blocks:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens with n={n} samples needs {needed} KV blocks to start; "
                f"the pool has {pool.num_blocks} of {pool.block_size} positions"
            )
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        request = EngineRequest(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt_ids,
            params=params,
            n=int(n),
            stop_ids=stop_ids,
            max_new_tokens=min(params.max_new_tokens, max_len - len(prompt_ids)),
            completions=[None] * int(n),
            images=images,
            image_digest=image_digest(images),
        )
        with self._lock:
            self.scheduler.waiting.append(request)
        return request

    def _check_images(self, prompt_ids: list[int], images: dict | None, request_id) -> dict | None:
        """``images`` checked against the prompt's image tokens (``VisionTower.checked_images``)."""
        vision = self.model.vision
        name = f"request {request_id}: " if request_id else ""
        if images and vision is None:
            raise ValueError(f"{name}images given to a model without a vision tower")
        return None if vision is None else vision.checked_images(prompt_ids, images, name)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.preempted or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet admitted, and preempted sequences waiting to be recomputed."""
        return len(self.scheduler.waiting) + len(self.scheduler.preempted)

    @property
    def pool(self) -> BlockPool:
        """The KV block pool's bookkeeping (usage, prefix-cache counters)."""
        return self.scheduler.pool

    def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1
    ) -> list[GenerationResult]:
        """Generate ``n`` completions for each prompt; results in input order."""
        requests = [self.add_request(p, params, n) for p in prompts]
        while not all(r.done for r in requests):
            self.step()
        raise_failed(requests)
        return [r.result() for r in requests]

    def release(self) -> None:
        """Free the KV cache (between rollouts); the weights stay. The prefix cache goes with it."""
        if self.has_unfinished():
            raise RuntimeError("cannot release the KV cache while requests are running")
        self.decoder.reset()  # its graphs hold the cache's addresses
        self.cache.release()

    def resume(self, rows: int | None = None, length: int | None = None) -> None:
        """Re-create the KV cache freed by :meth:`release`: blocks for ``rows`` sequences of ``length``
        positions when the caller knows that is all it will run (the samples of its requests, their
        longest prompt plus ``max_new_tokens``), else the whole pool."""
        if self.cache.allocated:
            return
        blocks = None
        if rows:
            blocks = int(rows) * -(-int(length or self.max_model_len) // self.cache.block_size) + 1
        self.cache.allocate(blocks)
        old = self.scheduler.pool
        self.scheduler.pool = BlockPool(
            self.cache.num_blocks - 1, self.cache.block_size, self.enable_prefix_caching
        )
        for name in ("prefix_queries", "prefix_hits", "evictions"):  # counters run over the engine's life
            self.scheduler.pool.stats[name] = old.stats[name]

    def abort(self, request_id: str) -> GenerationResult | None:
        """End ``request_id`` now: each unfinished sample keeps the tokens (and log-probs) generated so
        far, with ``finish_reason="abort"``; its blocks are freed. None when no such request runs.
        Asked while a step runs in the engine's thread, the abort happens before the next step (None)."""
        if self._stepping_in_thread and threading.current_thread() is not self._step_thread:
            self._pending_aborts.append(request_id)
            return None
        waiting, preempted = self.scheduler.waiting, self.scheduler.preempted
        with self._lock:
            request = next((r for r in waiting if r.request_id == request_id), None)
            if request is not None:
                waiting.remove(request)
        for seq in [s for s in preempted if s.request.request_id == request_id]:
            preempted.remove(seq)
            request = seq.request
            request.completions[seq.index] = finished_completion(seq, "abort")
        for seq in self._running:
            if seq.request.request_id == request_id and seq.pending != -2:
                request = seq.request
                request.completions[seq.index] = finished_completion(seq, "abort")
                seq.pending = -2  # retired: _compact frees its slot
        if request is None:
            return None
        self.stats["aborted_requests"] += 1
        self._compact()
        request.completions = [c or Completion([], [], "abort") for c in request.completions]
        result = request.result()
        self._deliver(request, result)
        return result

    def step(self) -> list[GenerationResult]:
        """Admit and prefill waiting requests, then decode one token per running sequence.
        Returns the results of the requests that finished in this step."""
        if not self.cache.allocated:
            raise RuntimeError("the KV cache is released; call resume() before generating")
        while self._pending_aborts:
            self.abort(self._pending_aborts.pop())
        if self.model.weights_version != self._weights_seen:
            self._flush_prefix_cache()
        finished: list[EngineRequest] = []
        admitted = self.scheduler.admit(len(self._running))
        if admitted:
            self._prefill(admitted, finished)
            self._compact()
        if self._running:
            self._decode(finished)
            self._compact()
        results = [request.result() for request in finished]
        for request, result in zip(finished, results, strict=True):
            self._deliver(request, result)
        return results

    def _flush_prefix_cache(self) -> None:
        """The weights changed: no block computed with the old ones is found again, and the sequences
        still holding such blocks never key them."""
        self._weights_seen = self.model.weights_version
        self.pool.flush()
        for seq in [*self._running, *self.scheduler.preempted]:
            seq.cacheable = False
        self.stats["prefix_cache_flushes"] += 1

    def _prefill(self, items: list[PrefillItem], finished: list[EngineRequest]) -> None:
        """Prefill ``items`` together; if that raises, each alone, in order, so that a request whose
        prefill fails fails by itself (:meth:`_fail`) and the others start; except one that reads its
        prefix from a failed item's blocks (:attr:`PrefillItem.lenders`): those were never written."""
        try:
            self._prefill_together(items, finished)
        except Exception as error:
            if len(items) == 1:
                self._fail_item(items[0], error, finished)
                return
            failed: set[int] = set()
            for index, item in enumerate(items):
                try:
                    if item.lenders & failed:
                        raise RuntimeError("the prefill of the prompt it shares its first blocks with failed")
                    self._prefill_together([item], finished)
                except Exception as alone:
                    failed.add(index)
                    self._fail_item(item, alone, finished)

    def _fail_item(self, item: PrefillItem, error: BaseException, finished: list[EngineRequest]) -> None:
        """An item whose prefill raised: its blocks go back and its request fails."""
        for table in item.tables:
            self.pool.drop(table)
        if item.resumed is not None:
            item.resumed.blocks = []
            self._running.append(item.resumed)  # retired below with the request's other samples
        self._fail(item.request or item.resumed.request, error, finished)
        self._compact()

    def _fail(self, request: EngineRequest, error: BaseException, finished: list[EngineRequest]) -> None:
        """End ``request`` with ``error``: its running samples retire (their blocks free at the next
        compaction) with the tokens they have, ``finish_reason="error"``."""
        if request.error is not None:
            return
        request.error = error
        self.stats["failed_requests"] += 1
        for seq in [s for s in self.scheduler.preempted if s.request is request]:
            self.scheduler.preempted.remove(seq)
            self._running.append(seq)  # no blocks: retired below like the running samples
        for seq in self._running:
            if seq.request is request and seq.pending != -2:
                seq.pending = -2
        request.completions = [
            Completion(c.token_ids, c.log_probs, "error") if c else Completion([], [], "error")
            for c in request.completions
        ]
        for seq in self._running:
            if seq.request is request:
                request.completions[seq.index] = Completion(seq.token_ids, seq.log_probs, "error")
        finished.append(request)

    def _prefill_together(self, items: list[PrefillItem], finished: list[EngineRequest]) -> None:
        """One prefill of every item's tokens past its cached prefix (written through its first
        sample's table), then the samples' partial blocks copied, their full blocks keyed, and the new
        requests' first tokens chosen (a recomputed sequence keeps its pending token)."""
        device = self.model.device
        new = [item.tokens[item.start :] for item in items]
        lengths = [len(tokens) for tokens in new]
        tokens = torch.zeros(len(items), max(lengths), dtype=torch.long)
        for row, row_tokens in enumerate(new):
            tokens[row, : lengths[row]] = torch.tensor(row_tokens)
        tokens, lengths_t = tokens.to(device), torch.tensor(lengths, device=device)
        table = self._table([item.tables[0] for item in items])
        starts = [item.start for item in items]
        inputs, deltas = {}, [0] * len(items)
        if any(self._images(item) for item in items):  # image features in the embeddings, M-RoPE (.vision)
            full = [item.tokens for item in items]
            images = [self._images(item) for item in items]
            inputs, deltas = image_inputs_past_prefix(self.model, full, images, starts, max(lengths))
        record = [] if self.record_routing else None
        logits = self.model.prefill(tokens, lengths_t, self.cache, table, starts, record=record, **inputs)
        routed = captured_ids(record, self.model.spec.moe)  # (P, T, L, k) on the host, or None
        self.cache.copy_blocks(*self._partial_copies(items))
        self.stats["prefill_tokens"] += sum(lengths)
        new_seqs, source = [], []
        for row, item in enumerate(items):
            if item.resumed is not None:
                seq = item.resumed
                seq.blocks, seq.length, seq.keys = item.tables[0], len(item.tokens), []
                if routed is not None:  # recomputed from item.start: its record there is replaced
                    seq.routing.write(item.start, routed[row, : lengths[row]])
                self._running.append(seq)
                self.scheduler.register_full(seq)
                continue
            for index, blocks in enumerate(item.tables):
                seq = RunningSequence(item.request, index, length=len(item.tokens), blocks=blocks)
                seq.rope_delta = int(deltas[row])
                if routed is not None:  # the samples share the prompt's one prefill, and its routing
                    seq.routing = new_record(self.model.spec.moe)
                    seq.routing.write(item.start, routed[row, : lengths[row]])
                new_seqs.append(seq)
                source.append(row)
                self.scheduler.register_full(seq)
        self._running.extend(new_seqs)
        if new_seqs:
            self._accept(new_seqs, logits[torch.tensor(source, device=device)], finished)

    def _table(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables (B, W) on the engine's device, padded with the scratch block 0."""
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        return torch.tensor(padded, dtype=torch.long, device=self.model.device)

    @staticmethod
    def _partial_copies(items: list[PrefillItem]) -> tuple[list[int], list[int]]:
        pairs = [pair for item in items for pair in item.partial_copies]
        return [source for source, _ in pairs], [target for _, target in pairs]

    @staticmethod
    def _images(item: PrefillItem) -> dict | None:
        return (item.request or item.resumed.request).images

    def _decode(self, finished: list[EngineRequest]) -> None:
        """Decode the running batch: the static step (:mod:`.decode_step`), one step or a burst, when
        every row shares its sampling settings and needs nothing per token beyond its token and
        log-prob; else the eager step, counted by reason in ``eager_reasons``. First every sequence
        gets the blocks its next positions need (preempting the newest when the pool runs out)."""
        reason = self._eager_reason()
        steps = self._burst_steps() if reason is None else 1
        if self.scheduler.grow(self._running, steps):
            self.stats["preemptions"] = self.scheduler.preemptions
            if not self._running:
                return
            reason = self._eager_reason()
            steps = min(steps, self._burst_steps()) if reason is None else 1
        if reason is None:
            self._decode_static(steps, finished)
            return
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        self.stats["eager_steps"] += 1
        running = self._running
        device = self.model.device
        tokens = torch.tensor([s.pending for s in running], device=device)
        lengths = torch.tensor([s.length for s in running], device=device)
        record = [] if self.record_routing else None
        rope = None
        if any(s.rope_delta for s in running):  # image prompts' rows: rotary position = length + delta
            rope = lengths + torch.tensor([s.rope_delta for s in running], device=device)
        logits = self.model.decode(
            tokens,
            lengths,
            self.cache,
            self._table([s.blocks for s in running]),
            span=max(s.length for s in running) + 1,
            attention=self.decoder.attention,
            rope_positions=rope,
            record=record,
        )
        routed = captured_ids(record, self.model.spec.moe)  # (B, L, k): each row's fed token
        for row, seq in enumerate(running):
            if routed is not None:
                seq.routing.write(seq.length, routed[row : row + 1])
            seq.length += 1
            self.scheduler.register_full(seq)
        self.stats["decode_steps"] += 1
        self._accept(running, logits, finished)

    def _eager_reason(self) -> str | None:
        """Why the running batch cannot take the static step (None: it can)."""
        if self.record_routing:  # the static step's fixed buffers do not carry expert ids (.routing)
            return "record_routing"
        key = self._running[0].request.params.choice_key()
        for seq in self._running:
            params = seq.request.params
            if params.logits_processor:
                return "logits_processor"
            if params.logprobs > 0:
                return "logprobs"
            if seq.request.listener is not None:
                return "streaming"
            if params.stop_checker:
                return "stop_checker"
            if params.choice_key() != key:
                return "mixed_params"
        return None

    def _burst_steps(self) -> int:
        """How many decode steps the static step runs on the device before reading back (1: one)."""
        running = self._running
        if self.decode_steps_per_sync == 1:
            return 1
        if self.scheduler.can_join(len(running)):
            return 1  # a request can join now: admit it at the next step
        room = min(
            min(s.request.max_new_tokens - len(s.token_ids), self.max_model_len - s.length) for s in running
        )
        return max(1, min(self.decode_steps_per_sync, room))

    def _decode_static(self, steps: int, finished: list[EngineRequest]) -> None:
        """``steps`` decode steps of every running sequence with one read back, then the step-by-step
        acceptance on the host (see the module docstring)."""
        running = self._running
        params = running[0].request.params
        seeded = [seq.request.params.seed is not None for seq in running]
        rows = StepRows(
            tokens=[s.pending for s in running],
            lengths=[s.length for s in running],
            tables=[s.blocks for s in running],
            seeds=stream_keys(running) if any(seeded) else None,
            seeded=seeded,
            rope_offsets=[s.rope_delta for s in running] if any(s.rope_delta for s in running) else None,
        )
        host_tokens, host_log_probs = self.decoder.run(rows, params, steps)
        self.stats["host_reads"] += 1
        self.stats["decode_steps"] += steps
        self.stats["static_steps"] += steps
        for i in range(steps):
            alive = [(row, seq) for row, seq in enumerate(running) if seq.pending != -2]
            if not alive:
                break
            for _, seq in alive:
                seq.length += 1
                self.scheduler.register_full(seq)
            self.stats["generated_tokens"] += len(alive)
            self._take(
                [seq for _, seq in alive],
                [host_tokens[i][row] for row, _ in alive],
                [host_log_probs[i][row] for row, _ in alive],
                {},
                finished,
            )

    def _compact(self) -> None:
        """Drop retired sequences from the batch; their blocks go back to the pool."""
        alive = []
        for seq in self._running:
            if seq.pending == -2:
                self.scheduler.release(seq)
            else:
                alive.append(seq)
        self._running = alive

    def _drop_everything(self) -> list[EngineRequest]:
        """Every request still queued or running, removed (a failure no single request explains)."""
        with self._lock:
            pending = list(self.scheduler.waiting)
            self.scheduler.waiting.clear()
        pending += [seq.request for seq in [*self.scheduler.preempted, *self._running]]
        for seq in self._running:
            self.scheduler.release(seq)
        self.scheduler.preempted.clear()
        self._running = []
        return list({id(r): r for r in pending}.values())


def image_digest(images: dict | None) -> bytes:
    """A digest of a prompt's images (pixel values and grid): the prefix keys of an image prompt cover
    the images' contents, not just their placeholder tokens. ``b""`` for a text prompt."""
    if not images:
        return b""
    digest = hashlib.blake2b(digest_size=16)
    for name in ("pixel_values", "image_grid_thw"):
        tensor = images.get(name)
        if tensor is not None:
            tensor = tensor.detach().contiguous().cpu()
            digest.update(str((name, tuple(tensor.shape), tensor.dtype)).encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.digest()
