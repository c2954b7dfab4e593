"""The embedded generation engine: a continuous-batching scheduler over :class:`EngineModel`.

Each :meth:`LLMEngine.step` admits waiting requests into free cache slots (the ``n`` samples of a
request share one prompt prefill), then decodes one token for every running sequence. Sequences
leave the batch the step they finish, and new requests join at the next step, so a long sequence
never holds up the rest.

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
  conversations) share the running batch. With ``step_in_thread`` (the OpenAI server) each step runs in
  the engine's own thread, so the event loop keeps answering while a long prefill runs.

**One request fails alone.** A request is checked when it is added (token ids within the vocabulary,
a seed within int64, room in the context and the cache: ``ValueError``). A request whose prefill
raises inside the engine is retried alone and, failing again, ends with ``finish_reason="error"`` and
``GenerationResult.error`` (``generate`` raises :class:`EngineRequestError`); a logits processor or
stop checker that raises fails its own request. The batch's other requests go on.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from hybridflow.workers.rollout.engine.decode_step import DecodeStep, StepRows, decode_buckets
from hybridflow.workers.rollout.engine.kv_cache import KVCache
from hybridflow.workers.rollout.engine.model import EngineModel
from hybridflow.workers.rollout.engine.requests import (
    Completion,
    EngineRequest,
    EngineRequestError,
    GenerationResult,
    RunningSequence,
    finished_completion,
    raise_failed,
    settle,
    stream_keys,
    top_alternatives,
)
from hybridflow.workers.rollout.engine.sampling import SamplingParams, choose_tokens, seeded_uniforms
from hybridflow.workers.rollout.engine.vision import image_prefill_inputs


class LLMEngine:
    """``max_num_seqs`` sequences run at once at most (the KV cache has that many slots, each
    ``max_model_len`` tokens long); a prefill processes at most ``max_num_batched_tokens`` padded
    prompt tokens (at least one request)."""

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
    ) -> None:
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
        self.cache = KVCache(
            model.spec, max_num_seqs, max_model_len, model.dtype, model.device, allocate=allocate_cache
        )
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
            capture=not enforce_eager and model.device.type == "cuda",
            pad=pad_batches,
            max_steps=self.decode_steps_per_sync,
            stats=self.stats,
        )
        self._waiting: list[EngineRequest] = []
        self._running: list[RunningSequence] = []
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
        # step_in_thread: the async API steps in ``_executor``'s thread (requests join through the lock,
        # aborts asked while a step runs wait in ``_pending_aborts``, results go back to the loop)
        self.step_in_thread = False
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending_aborts: list[str] = []
        self._event_loop: asyncio.AbstractEventLoop | None = None
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
        max_len = self.cache.max_len  # max_model_len, or less where resume() sized the cache down
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                f"max_model_len={max_len}"
            )
        if n > self.cache.num_slots:
            raise ValueError(f"n={n} samples exceed the {self.cache.num_slots} KV-cache slots (max_num_seqs)")
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
        )
        with self._lock:
            self._waiting.append(request)
        return request

    def _check_images(self, prompt_ids: list[int], images: dict | None, request_id) -> dict | None:
        """``images`` checked against the prompt's image tokens (``VisionTower.checked_images``)."""
        vision = self.model.vision
        name = f"request {request_id}: " if request_id else ""
        if images and vision is None:
            raise ValueError(f"{name}images given to a model without a vision tower")
        return None if vision is None else vision.checked_images(prompt_ids, images, name)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests added and not yet admitted into cache slots."""
        return len(self._waiting)

    def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1
    ) -> list[GenerationResult]:
        """Generate ``n`` completions for each prompt; results in input order."""
        requests = [self.add_request(p, params, n) for p in prompts]
        while not all(r.done for r in requests):
            self.step()
        raise_failed(requests)
        return [r.result() for r in requests]

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int = 1,
        request_id: str | None = None,
        images: dict | None = None,
    ) -> GenerationResult:
        """Generate for one prompt, sharing the running batch with every other pending call
        (``images``: as :meth:`add_request`'s; a later turn of a conversation passes its first turn's)."""
        request = self.add_request(prompt_ids, params, n, request_id, images=images)
        request.future = asyncio.get_running_loop().create_future()
        self._ensure_loop()
        try:
            return await request.future
        except asyncio.CancelledError:  # the caller gave up (a client disconnected): free its slots
            self.abort(request.request_id)
            raise

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ):
        """Like :meth:`generate`, as an async iterator: ``(sample, token id, log-prob)`` for each token
        as it is chosen, then the :class:`GenerationResult`."""
        request = self.add_request(prompt_ids, params, n, request_id)
        request.listener = asyncio.Queue()
        self._ensure_loop()
        ended = False
        try:
            while True:
                event = await request.listener.get()
                if isinstance(event, BaseException):
                    ended = True
                    raise event
                if isinstance(event, GenerationResult):
                    ended = True
                    if event.error is not None:
                        raise EngineRequestError(event.error)
                    yield event
                    return
                yield event
        finally:
            if not ended:  # the consumer stopped reading (a client disconnected): free its slots
                self.abort(request.request_id)

    async def score(self, sequences: list[list[int]], starts: list[int], k: int, temperature: float = 1.0):
        """Top-``k`` log-probs at ``starts[i]:`` of each sequence, generating nothing (:mod:`.scoring`)."""
        from hybridflow.workers.rollout.engine.scoring import score_in_engine

        return await score_in_engine(self, sequences, starts, k, temperature)

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop_task is None or self._loop_task.done():
            self._event_loop = loop
            self._loop_task = loop.create_task(self._run_loop())

    def release(self) -> None:
        """Free the KV cache (between rollouts); the weights stay."""
        if self.has_unfinished():
            raise RuntimeError("cannot release the KV cache while requests are running")
        self.decoder.reset()  # its graphs hold the cache's addresses
        self.cache.release()

    def resume(self, rows: int | None = None, length: int | None = None) -> None:
        """Re-create the KV cache freed by :meth:`release`: ``rows`` slots of ``length`` positions when
        the caller knows that is all it will run (the samples of its requests, their longest prompt
        plus ``max_new_tokens``), else ``max_num_seqs`` x ``max_model_len``."""
        self.cache.allocate(rows, length)

    # ------------------------------------------------------------------ scheduling
    def abort(self, request_id: str) -> GenerationResult | None:
        """End ``request_id`` now: each unfinished sample keeps the tokens (and log-probs) generated so
        far, with ``finish_reason="abort"``; its cache slots are freed. None when no such request runs.
        Asked while a step runs in the engine's thread, the abort happens before the next step (None)."""
        if self._stepping_in_thread and threading.current_thread() is not self._step_thread:
            self._pending_aborts.append(request_id)
            return None
        with self._lock:
            request = next((r for r in self._waiting if r.request_id == request_id), None)
            if request is not None:
                self._waiting.remove(request)
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
        finished: list[EngineRequest] = []
        admitted = self._admit()
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

    def _admit(self) -> list[EngineRequest]:
        free = self.cache.num_slots - len(self._running)
        admitted, widest = [], 0
        with self._lock:
            while self._waiting and self._waiting[0].n <= free:
                request = self._waiting[0]
                width = max(widest, len(request.prompt_ids))
                if admitted and (len(admitted) + 1) * width > self.max_num_batched_tokens:
                    break
                self._waiting.pop(0)
                admitted.append(request)
                free -= request.n
                widest = width
        return admitted

    def _prefill(self, requests: list[EngineRequest], finished: list[EngineRequest]) -> None:
        """Prefill ``requests`` together; if that raises, each alone, so that a request whose prefill
        fails fails by itself (:meth:`_fail`) and the others start."""
        try:
            self._prefill_together(requests, finished)
        except Exception as error:
            if len(requests) == 1:
                self._fail(requests[0], error, finished)
                return
            for request in requests:
                try:
                    self._prefill_together([request], finished)
                except Exception as alone:
                    self._fail(request, alone, finished)

    def _fail(self, request: EngineRequest, error: BaseException, finished: list[EngineRequest]) -> None:
        """End ``request`` with ``error``: its running samples retire (their slots free at the next
        compaction) with the tokens they have, ``finish_reason="error"``."""
        if request.error is not None:
            return
        request.error = error
        self.stats["failed_requests"] += 1
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

    def _prefill_together(self, requests: list[EngineRequest], finished: list[EngineRequest]) -> None:
        device = self.model.device
        lengths = [len(r.prompt_ids) for r in requests]
        tokens = torch.zeros(len(requests), max(lengths), dtype=torch.long)
        for row, request in enumerate(requests):
            tokens[row, : lengths[row]] = torch.tensor(request.prompt_ids)
        new_seqs, source = [], []
        for row, request in enumerate(requests):
            for index in range(request.n):
                new_seqs.append(
                    RunningSequence(
                        request, index, slot=len(self._running) + len(new_seqs), length=lengths[row]
                    )
                )
                source.append(row)
        slots = torch.tensor([s.slot for s in new_seqs], device=device)
        tokens, lengths_t = tokens.to(device), torch.tensor(lengths, device=device)
        inputs = {}
        if any(r.images for r in requests):  # image features in the embeddings, M-RoPE (.vision)
            embeds, rope, deltas = image_prefill_inputs(
                self.model, tokens, lengths_t, [r.images for r in requests]
            )
            inputs = {"embeds": embeds, "rope": rope}
            for seq, row in zip(new_seqs, source, strict=True):
                seq.rope_delta = int(deltas[row])
        logits = self.model.prefill(
            tokens, lengths_t, self.cache, slots, torch.tensor(source, device=device), **inputs
        )
        self._running.extend(new_seqs)
        self.stats["prefill_tokens"] += sum(lengths)
        self._accept(new_seqs, logits[torch.tensor(source, device=device)], finished)

    def _decode(self, finished: list[EngineRequest]) -> None:
        """Decode the running batch: the static step (:mod:`.decode_step`), one step or a burst, when
        every row shares its sampling settings and needs nothing per token beyond its token and
        log-prob; else the eager step, counted by reason in ``eager_reasons``."""
        reason = self._eager_reason()
        if reason is None:
            self._decode_static(self._burst_steps(), finished)
            return
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        self.stats["eager_steps"] += 1
        running = self._running
        device = self.model.device
        tokens = torch.tensor([s.pending for s in running], device=device)
        lengths = torch.tensor([s.length for s in running], device=device)
        rope = None
        if any(s.rope_delta for s in running):  # image prompts' rows: rotary position = length + delta
            rope = lengths + torch.tensor([s.rope_delta for s in running], device=device)
        logits = self.model.decode(
            tokens, lengths, self.cache, span=max(s.length for s in running) + 1, rope_positions=rope
        )
        for seq in running:
            seq.length += 1
        self.stats["decode_steps"] += 1
        self._accept(running, logits, finished)

    def _eager_reason(self) -> str | None:
        """Why the running batch cannot take the static step (None: it can)."""
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
        if self._waiting and self._waiting[0].n <= self.cache.num_slots - len(running):
            return 1  # a request can join now: admit it at the next step
        room = min(
            min(s.request.max_new_tokens - len(s.token_ids), self.cache.max_len - s.length) for s in running
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
            self.stats["generated_tokens"] += len(alive)
            self._take(
                [seq for _, seq in alive],
                [host_tokens[i][row] for row, _ in alive],
                [host_log_probs[i][row] for row, _ in alive],
                {},
                finished,
            )

    def _accept(
        self, seqs: list[RunningSequence], logits: torch.Tensor, finished: list[EngineRequest]
    ) -> None:
        """Choose the next token of each sequence from its logits row (B, V) and retire finished ones."""
        tokens, log_probs = self._choose(seqs, logits, finished)
        self.stats["generated_tokens"] += len(seqs)
        self.stats["host_reads"] += 1
        self._take(seqs, tokens.tolist(), log_probs.tolist(), top_alternatives(seqs, logits), finished)

    def _take(
        self,
        seqs: list[RunningSequence],
        tokens: list[int],
        log_probs: list[float],
        tops: dict[int, list[tuple[int, float]]],
        finished: list[EngineRequest],
    ) -> None:
        """Append each sequence's chosen token (and log-prob) and retire those that stop or reach their
        length."""
        for row, (seq, token, log_prob) in enumerate(zip(seqs, tokens, log_probs, strict=True)):
            if seq.pending == -2:  # failed in this step (its logits processor raised)
                continue
            seq.token_ids.append(token)
            seq.log_probs.append(log_prob)
            if row in tops:
                seq.top_log_probs.append(tops[row])
            seq.pending = token
            request = seq.request
            if request.listener is not None:
                self._to_loop(request.listener.put_nowait, (seq.index, token, log_prob, tops.get(row)))
            if token in request.stop_ids:
                reason = "stop"
            elif len(seq.token_ids) >= request.max_new_tokens:
                reason = "length"
            elif request.params.stop_checker is not None and self._stops(seq, finished):
                if seq.pending == -2:
                    continue  # the checker raised: the request failed
                reason = "stop"
            else:
                continue
            request.completions[seq.index] = finished_completion(seq, reason)
            seq.pending = -2  # retired: removed from the batch by _compact
            if request.done:
                finished.append(request)

    def _stops(self, seq: RunningSequence, finished: list[EngineRequest]) -> bool:
        """Whether the request's stop checker (stop strings) ends ``seq`` at its latest token; a checker
        that raises fails the request."""
        try:
            return bool(seq.request.params.stop_checker(seq.token_ids))
        except Exception as error:
            self._fail(seq.request, error, finished)
            return True

    def _choose(
        self, seqs: list[RunningSequence], logits: torch.Tensor, finished: list[EngineRequest]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        processed = [(row, seq) for row, seq in enumerate(seqs) if seq.request.params.logits_processor]
        if processed:
            logits = logits.clone()
            for row, seq in processed:
                try:
                    logits[row] = seq.request.params.logits_processor(seq.token_ids, logits[row])
                except Exception as error:  # this request fails; the row's token is not taken
                    self._fail(seq.request, error, finished)
        groups: dict[tuple, list[int]] = {}
        for row, seq in enumerate(seqs):
            groups.setdefault(seq.request.params.choice_key(), []).append(row)
        if len(groups) == 1:
            params = seqs[0].request.params
            return choose_tokens(logits, params, self.generator, self._uniforms(seqs, params))
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        log_probs = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        for rows in groups.values():
            index = torch.tensor(rows, device=logits.device)
            params = seqs[rows[0]].request.params
            uniforms = self._uniforms([seqs[row] for row in rows], params)
            tokens[index], log_probs[index] = choose_tokens(logits[index], params, self.generator, uniforms)
        return tokens, log_probs

    def _uniforms(self, seqs: list[RunningSequence], params: SamplingParams) -> torch.Tensor | None:
        """Each row's draw when any row samples from a seeded stream (see :mod:`.sampling`): seeded rows
        from (seed, sample index, position), the others from the engine's generator. None when no row
        is seeded (or the rows are greedy): :func:`choose_tokens` draws from the generator itself."""
        seeded = [seq.request.params.seed is not None for seq in seqs]
        if params.greedy or not any(seeded):
            return None
        uniforms = (
            1.0 - torch.rand(len(seqs), generator=self.generator, device=self.generator.device).double()
        )
        rows = torch.tensor([row for row, is_seeded in enumerate(seeded) if is_seeded])
        seeds, samples, positions = torch.tensor(stream_keys(seqs), dtype=torch.long)[rows].T
        uniforms[rows] = seeded_uniforms(seeds, samples, positions).to(uniforms.device)
        return uniforms

    def _compact(self) -> None:
        """Drop retired sequences and move tail survivors into their slots, keeping rows 0..B-1 packed."""
        alive = [s for s in self._running if s.pending != -2]
        if len(alive) == len(self._running):
            return
        keep = len(alive)
        holes = [s.slot for s in self._running[:keep] if s.pending == -2]
        movers = [s for s in self._running[keep:] if s.pending != -2]
        if movers:
            self.cache.move_rows([m.slot for m in movers], holes, max(m.length for m in movers))
            for mover, hole in zip(movers, holes, strict=True):
                mover.slot = hole
        self._running = sorted(alive, key=lambda s: s.slot)

    async def _run_loop(self) -> None:
        """Step while anything is pending, yielding to the event loop between steps (with
        ``step_in_thread``, awaiting each step run in the engine's thread)."""
        try:
            while self.has_unfinished():
                if self.step_in_thread:
                    if self._executor is None:
                        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
                    self._stepping_in_thread = True
                    try:
                        await asyncio.get_running_loop().run_in_executor(self._executor, self._thread_step)
                    finally:
                        self._stepping_in_thread = False
                else:
                    self.step()
                await asyncio.sleep(0)
        except Exception as error:  # a failure no single request explains: every waiter learns it
            with self._lock:
                pending = [r for r in self._waiting] + [s.request for s in self._running]
                self._waiting, self._running = [], []
            for request in {id(r): r for r in pending}.values():
                if request.future is not None and not request.future.done():
                    request.future.set_exception(error)
                if request.listener is not None:
                    request.listener.put_nowait(error)
            raise

    def _thread_step(self) -> None:
        self._step_thread = threading.current_thread()
        self.step()

    def _to_loop(self, callback, *args) -> None:
        """Run ``callback(*args)`` on the event loop: now, or from the step thread via the loop."""
        if self._stepping_in_thread and self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(callback, *args)
        else:
            callback(*args)

    def _deliver(self, request: EngineRequest, result: GenerationResult) -> None:
        """Hand a finished request's result to whoever awaits it (``generate`` / ``stream``)."""
        if request.future is not None:
            self._to_loop(settle, request.future, result)
        if request.listener is not None:
            self._to_loop(request.listener.put_nowait, result)
