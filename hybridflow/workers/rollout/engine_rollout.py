"""The default rollout: hybridflow's embedded engine, fed with the actor's weights in place.

``actor_rollout_ref.rollout.name=engine`` (``vllm`` is vLLM itself: :mod:`.vllm_rollout`). The engine
keeps its own copy of the weights in a generation layout; :meth:`EngineRollout.update_weights`
refreshes it from the (FSDP2-sharded) actor one FSDP unit at a time after each update. The KV cache
lives only while generating when ``free_cache_engine`` is on (verl's sleep/wake), so it never sits
beside the training memory; the worker frees the engine's weights then too
(:meth:`EngineRollout.release_weights`).

With ``rollout.tensor_model_parallel_size`` t_g > 1, or a tensor-parallel actor, the engine holds one
rank's share of a generation group (:mod:`.engine.parallel`) and a sync reshards the actor's training
shards into it (:mod:`.engine.reshard`, HybridFlow §5).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import replace

import torch
from torch import nn

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.device import default_compute_dtype, has_fast_bf16
from hybridflow.workers.rollout.base import (
    BaseRollout,
    completions_output,
    generation_seed,
    register_rollout,
    sample_seed,
    sampling_params,
)
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.engine.kv_cache import DEFAULT_BLOCK_SIZE, blocks_for_budget
from hybridflow.workers.rollout.engine.parallel import SINGLE, GenerationShard
from hybridflow.workers.rollout.engine.reshard import ReshardLayout, reshard_weights
from hybridflow.workers.rollout.engine.routing import routed_experts_rows
from hybridflow.workers.rollout.engine.threaded import (
    decode_shards,
    generate_threaded,
    split_groups,
    sub_engines,
)
from hybridflow.workers.rollout.engine.weight_sync import sync_weights

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def kv_cache_budget_bytes(config, device: torch.device) -> int:
    """``kv_cache_memory_gb`` if set, else ``gpu_memory_utilization`` x the free device memory
    (free RAM on CPU)."""
    if config.get("kv_cache_memory_gb"):
        return int(float(config.kv_cache_memory_gb) * 2**30)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = available_ram_bytes()
    return int(float(config.get("gpu_memory_utilization", 0.5)) * free)


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (free + reclaimable), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def engine_dtype(name: str | None, device_type: str) -> torch.dtype:
    """``rollout.dtype`` on ``device_type``: fp32 | bf16 | auto (bf16 where the device computes it
    fast: :func:`hybridflow.utils.device.has_fast_bf16`) | null (the device's default: bf16 on CUDA,
    as verl's vLLM; fp32 on CPU, which keeps rollout and actor log-probs equal to ~1e-6)."""
    if name is None or name == "None":
        return default_compute_dtype(device_type)
    if name == "auto":
        return torch.bfloat16 if has_fast_bf16(device_type) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"rollout.dtype={name!r}; use one of {sorted(DTYPES) + ['auto', 'null']}")
    return DTYPES[name]


def engine_max_len(config) -> int:
    """Positions per sequence: ``max_model_len``, else ``prompt_length + response_length``."""
    return int(config.get("max_model_len") or int(config.prompt_length) + int(config.response_length))


def build_llm_engine(
    model: EngineModel, config, eos_token_ids=(), share: int = 1, allocate_cache: bool = True
) -> LLMEngine:
    """An engine over ``model`` sized by a rollout config section (KV-cache budget in blocks of
    ``block_size``, batch limits, prefix caching, seed); ``share`` engines splitting the budget and
    ``max_num_seqs`` get 1/share each. ``allocate_cache=False``: no cache until the first ``resume`` (a
    rollout that sizes it per call never holds the full budget)."""
    max_len = engine_max_len(config)
    budget = kv_cache_budget_bytes(config, model.device) // share
    max_seqs = max(1, int(config.get("max_num_seqs", 256)) // share)
    block_size = int(config.get("block_size") or DEFAULT_BLOCK_SIZE)
    if block_size < 1:
        raise ValueError(f"rollout.block_size={block_size} must be at least 1")
    # never more than max_num_seqs sequences of max_len can hold at once (a budget-sized pool on the CPU
    # would zero gigabytes no sequence reaches)
    most = max_seqs * -(-max_len // block_size)
    blocks = min(blocks_for_budget(model.spec, block_size, model.dtype, budget, max_len), most)
    if model.shard.parallel:  # the ranks of a generation group must schedule identically: the fewest blocks
        agreed = torch.tensor([blocks], device=model.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=model.shard.group)
        blocks = int(agreed.item())
    return LLMEngine(
        model,
        max_num_seqs=max_seqs,
        num_blocks=blocks,
        block_size=block_size,
        enable_prefix_caching=bool(config.get("enable_prefix_caching", True)),
        max_model_len=max_len,
        eos_token_ids=list(eos_token_ids),
        max_num_batched_tokens=int(config.get("max_num_batched_tokens", 8192)),
        seed=int(config.get("seed", 0)),
        allocate_cache=allocate_cache,
        decode_steps_per_sync=decode_steps_per_sync(config, model.device),
        enforce_eager=bool(config.get("enforce_eager", False)),
        cudagraph_capture_sizes=_capture_sizes(config),
        record_routing=bool(config.get("enable_rollout_routing_replay", False)),  # R3 (engine/routing.py)
    )


def _capture_sizes(config) -> list[int] | None:
    """``rollout.cudagraph_capture_sizes`` as a list of ints (None: the engine's default buckets)."""
    sizes = config.get("cudagraph_capture_sizes")
    return None if sizes is None else [int(size) for size in sizes]


def decode_steps_per_sync(config, device: torch.device) -> int:
    """``rollout.decode_steps_per_sync``, or (null) the device's default: 1 on the CPU, where a read
    back costs nothing and a burst only decodes tokens past a stop; 8 on a GPU, where each read back
    idles it."""
    value = config.get("decode_steps_per_sync")
    if value is not None:
        return int(value)
    return 1 if torch.device(device).type == "cpu" else 8


def call_cache_size(groups: list[tuple], params: SamplingParams) -> tuple[int, int]:
    """``(rows, length)`` of KV cache that one call over ``(prompt, n[, params])`` groups can use: every
    sample at once, each as long as the longest prompt plus ``max_new_tokens``."""
    rows = sum(group[1] for group in groups)
    return rows, max(len(group[0]) for group in groups) + int(params.max_new_tokens)


def engine_sampling_params(config, meta: dict, eos_ids: list[int]) -> SamplingParams:
    """Engine sampling settings for one generate call (``val_kwargs`` when validating, greedy when
    ``do_sample`` is off; stops at ``eos_ids`` unless ``ignore_eos``)."""
    chosen = sampling_params(config, meta)
    return SamplingParams(
        max_new_tokens=int(config.response_length),
        temperature=chosen["temperature"],
        top_k=chosen["top_k"],
        top_p=chosen["top_p"],
        do_sample=chosen["do_sample"],
        stop_token_ids=() if config.get("ignore_eos", False) else tuple(eos_ids),
        ignore_eos=bool(config.get("ignore_eos", False)),  # the engine's own eos ids too
    )


def unpadded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Left-padded rows (B, T_p) → each row's prompt ids without padding."""
    return [
        [t for t, m in zip(ids, mask, strict=True) if m]
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True)
    ]


def request_groups(
    prompts: DataProto, params: SamplingParams, base_seed
) -> list[tuple[list[int], int, SamplingParams]]:
    """``(prompt ids, n, params)`` per run of neighbouring rows of one prompt (and one dataset ``index``).
    With the dataset index in the batch (and sampling on), each group draws from its prompt's own
    streams (:func:`~hybridflow.workers.rollout.base.sample_seed` of rollout.seed, the batch's epoch and
    the index; sample k from stream k), so what a sample draws does not depend on the batch or the rank."""
    runs = prompt_runs(prompts)
    seeded = prompts.non_tensor_batch.get("index") is not None and base_seed is not None and not params.greedy
    meta = prompts.meta_info
    return [
        (
            prompt,
            n,
            replace(
                params,
                seed=sample_seed(
                    int(base_seed), int(meta.get("epoch", 0)), int(key), bool(meta.get("validate"))
                ),
            )
            if seeded
            else params,
        )
        for prompt, n, key, _ in runs
    ]


def prompt_runs(prompts: DataProto) -> list[list]:
    """``[prompt ids, n, dataset index or None, images or None]`` per run of neighbouring rows of one
    prompt, one index and the same images (a vision-language row's ``multi_modal_inputs``: equal
    ``image_grid_thw`` and ``pixel_values``, usually the same object, as ``DataProto.repeat`` leaves
    the n copies of a row)."""
    rows = unpadded_rows(prompts.batch[keys.INPUT_IDS], prompts.batch[keys.ATTENTION_MASK])
    index = prompts.non_tensor_batch.get("index")
    inputs = prompts.non_tensor_batch.get(keys.MULTI_MODAL_INPUTS)
    runs: list[list] = []
    for row, prompt in enumerate(rows):
        key = None if index is None else index[row]
        images = None if inputs is None else (inputs[row] or None)
        last = runs[-1] if runs else None
        if last and last[0] == prompt and last[2] == key and _same_images(last[3], images):
            last[1] += 1
        else:
            runs.append([prompt, 1, key, images])
    return runs


def group_images(prompts: DataProto) -> list[dict | None]:
    """The images of each of :func:`request_groups`' groups (None: a text prompt)."""
    return [images for *_, images in prompt_runs(prompts)]


def row_params(groups: list[tuple[list[int], int, SamplingParams]]) -> list[SamplingParams]:
    """One params per row of :func:`request_groups`' groups: a seeded group's k-th row draws from
    stream k (``seed_sample``), as its k-th sample would in one request."""
    return [
        replace(params, seed_sample=k) if params.seed is not None else params
        for _, n, params in groups
        for k in range(n)
    ]


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[list[int], int]]:
    """Left-padded rows (B, T_p) → [(prompt ids, how many consecutive rows repeat it)]: the ``n``
    samples of one prompt arrive as neighbouring rows and share one prefill."""
    groups: list[tuple[list[int], int]] = []
    for prompt in unpadded_rows(input_ids, attention_mask):
        if groups and groups[-1][0] == prompt:
            groups[-1] = (prompt, groups[-1][1] + 1)
        else:
            groups.append((prompt, 1))
    return groups


@register_rollout("engine")
class EngineRollout(BaseRollout):
    """``module`` is the actor's (possibly FSDP2- and TP-sharded) HF model; ``config`` the rollout
    section; ``rank`` this process's rank in the actor's group. ``layout`` (training TP and generation
    TP over the group) and ``shard`` (this rank's place in its generation group) come from the worker;
    without them the engine holds the whole model."""

    def __init__(
        self,
        module: nn.Module,
        config,
        rank: int = 0,
        tokenizer=None,
        layout: ReshardLayout | None = None,
        shard: GenerationShard = SINGLE,
    ) -> None:
        self.module, self.config, self.rank, self.tokenizer = module, config, rank, tokenizer
        self.layout = layout
        # the ranks of one generation group sample the same tokens: they share a seed
        self.seed_rank = layout.gen_coords(rank)[0] if layout is not None else rank
        self.multi_turn = bool(config.get("multi_turn", {}).get("enable", False))
        self._agent_loop = None
        device = _module_device(module)
        dtype = engine_dtype(config.get("dtype"), device.type)
        self.model = EngineModel.empty_like_hf_module(
            module, engine_max_len(config), dtype=dtype, device=device, shard=shard
        )
        self.last_sync = self._sync()
        self.free_cache = bool(config.get("free_cache_engine", True))
        self.engine = build_llm_engine(self.model, config, allocate_cache=not self.free_cache)
        self._decode_engines: list[LLMEngine] = []  # threaded decoding (engine/threaded.py), built on use
        self._call_seed = 0

    def _sync(self):
        from hybridflow.workers.lora import is_peft_model

        if self.layout is None or self.layout.trivial or is_peft_model(self.module):
            return sync_weights(self.model, self.module)
        return reshard_weights(self.model, self.module, self.layout, self.rank)

    def update_weights(self) -> dict[str, float]:
        """Refresh the engine from the actor (a collective over the actor's ranks); returns metrics."""
        self.last_sync = self._sync()
        return self.last_sync.metrics()

    @property
    def weights_loaded(self) -> bool:
        return self.model.allocated

    def release_weights(self) -> None:
        """Free the engine's weights (the next :meth:`update_weights` re-creates and fills them)."""
        self.model.release()

    def release(self) -> None:
        for engine in (self.engine, *self._decode_engines):
            engine.release()

    def resume(self, rows: int | None = None) -> None:
        """The KV cache back: ``rows`` slots when a serving phase knows how many samples it runs (the
        cache the call needs, as a batch rollout sizes it), else the full budget."""
        self.engine.resume(rows)

    @contextlib.contextmanager
    def _kv_cache(self, engines: list[LLMEngine] | None = None, sizes: list[tuple[int, int]] | None = None):
        """The KV caches of ``engines`` (default: the main engine) exist for the duration, and only
        theirs (freed after it with ``free_cache_engine``). ``sizes``: ``(rows, length)`` per engine,
        the most the call will run on it (None: each engine's full budget)."""
        engines = engines or [self.engine]
        for engine in (self.engine, *self._decode_engines):
            if all(engine is not chosen for chosen in engines):
                engine.release()
        for index, engine in enumerate(engines):
            if sizes is None or not self.free_cache:
                engine.resume()
            elif index < len(sizes):  # re-created per call anyway: sized to the call
                engine.release()
                engine.resume(*sizes[index])
            # else: an engine this call leaves idle (fewer shards than engines) gets no cache
        try:
            yield
        finally:
            if self.free_cache:
                for engine in engines:
                    engine.release()

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta = prompts.meta_info
        eos_ids = meta["eos_token_id"] if isinstance(meta["eos_token_id"], list) else [meta["eos_token_id"]]
        pad_id = int(meta["pad_token_id"])
        params = engine_sampling_params(self.config, meta, eos_ids)
        self._call_seed = generation_seed(
            self.config.get("seed", 0), meta.get("global_steps", 0), self.seed_rank
        )
        self.engine.reseed(self._call_seed)
        start, captured, before = time.perf_counter(), self._graph_capture_s(), self._cache_counts()
        if self.multi_turn:
            output = self._generate_conversations(prompts, params, eos_ids, pad_id)
        else:
            output = self._generate_single_turn(prompts, params, eos_ids, pad_id)
        output.meta_info["metrics"] = {"engine_generate": time.perf_counter() - start}
        if self.engine.decoder.capture:  # CUDA graphs re-captured this rollout (the cache moved)
            output.meta_info["metrics"]["engine_graph_capture"] = self._graph_capture_s() - captured
        output.meta_info["metrics"].update(self._cache_metrics(before))
        return output

    def _engines(self) -> list[LLMEngine]:
        return [self.engine, *self._decode_engines]

    def _cache_counts(self, restart_peak: bool = True) -> dict[int, tuple[int, int, int]]:
        """Per engine (by id): (prefix-cache queries, hits, preemptions) so far; ``restart_peak``: each
        pool's peak block count starts again from what it holds now."""
        counts = {}
        for engine in self._engines():
            pool = engine.pool
            if restart_peak:
                pool.stats["peak_blocks"] = pool.num_used
            stats = pool.stats
            counts[id(engine)] = (stats["prefix_queries"], stats["prefix_hits"], engine.stats["preemptions"])
        return counts

    def _cache_metrics(self, before: dict[int, tuple[int, int, int]]) -> dict[str, float]:
        """This call's ``rollout/prefix_cache_hit_rate`` (cached prompt tokens / prompt tokens),
        ``rollout/preemptions`` and ``rollout/kv_blocks_peak_frac`` (the most blocks held at once, over
        the pool), over this worker's engines (decode engines made during the call start from 0)."""
        now = self._cache_counts(restart_peak=False)
        pairs = [(counts, before.get(key, (0, 0, 0))) for key, counts in now.items()]
        queries, hits, preempted = (sum(n[i] - b[i] for n, b in pairs) for i in range(3))
        peak = max(e.pool.stats["peak_blocks"] / max(1, e.pool.num_blocks) for e in self._engines())
        return {
            "rollout/prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "rollout/preemptions": float(preempted),
            "rollout/kv_blocks_peak_frac": peak,
        }

    def _graph_capture_s(self) -> float:
        return sum(e.stats["graph_capture_s"] for e in (self.engine, *self._decode_engines))

    def _generate_single_turn(self, prompts: DataProto, params: SamplingParams, eos_ids, pad_id) -> DataProto:
        groups = request_groups(prompts, params, self.config.get("seed", 0))
        if keys.MULTI_MODAL_INPUTS in prompts.non_tensor_batch:  # a vision-language batch: (.., images)
            groups = [(*group, images) for group, images in zip(groups, group_images(prompts), strict=True)]
        threads = decode_shards(
            self.config.get("decode_threads"), self.model.device, len(groups), not self.model.shard.parallel
        )
        if threads > 1:  # one engine per thread, one torch thread each (engine/threaded.py)
            engines = sub_engines(
                lambda k: build_llm_engine(
                    self.model, self.config, share=k, allocate_cache=not self.free_cache
                ),
                threads,
                self._decode_engines,
            )
            sizes = [call_cache_size(shard, params) for shard in split_groups(groups, threads)]
            with self._kv_cache(engines, sizes):
                completions = generate_threaded(engines, groups, params, self._call_seed)
        else:
            with self._kv_cache(sizes=[call_cache_size(groups, params)]):
                requests = [
                    self.engine.add_request(group[0], group[2], group[1], images=_images(group))
                    for group in groups
                ]
                while self.engine.has_unfinished():
                    self.engine.step()
            completions = [c for r in requests for c in r.completions]
        output = completions_output(
            prompts,
            completions,
            int(self.config.response_length),
            pad_id,
            bool(self.config.get("calculate_log_probs")),
        )
        if self.engine.record_routing:  # router replay R3: each token's experts, input_ids' columns
            output.batch[keys.ROUTED_EXPERTS] = routed_experts_rows(
                prompts.batch[keys.ATTENTION_MASK], [c.routed_experts for c in completions],
                int(self.config.response_length),
            )  # fmt: skip
        return output

    def _generate_conversations(
        self, prompts: DataProto, params: SamplingParams, eos_ids, pad_id
    ) -> DataProto:
        """Multi-turn: every row is its own conversation with tool calls (``multi_turn.enable``)."""
        from hybridflow.workers.rollout.multi_turn import (
            assemble_conversations,
            build_agent_loop,
            interaction_columns,
        )

        if self._agent_loop is None:
            self._agent_loop = build_agent_loop(self.engine, self.tokenizer, self.config, eos_ids)
        self._agent_loop.use_template_kwargs(prompts.meta_info.get("apply_chat_template_kwargs"))
        rows = unpadded_rows(prompts.batch[keys.INPUT_IDS], prompts.batch[keys.ATTENTION_MASK])
        tools_kwargs = prompts.non_tensor_batch.get("tools_kwargs")
        kwargs = [tools_kwargs[i] if tools_kwargs is not None else None for i in range(len(rows))]
        inputs = prompts.non_tensor_batch.get(keys.MULTI_MODAL_INPUTS)  # images: every turn's prefill
        images = [inputs[i] or None for i in range(len(rows))] if inputs is not None else None
        per_row = row_params(request_groups(prompts, params, self.config.get("seed", 0)))
        interaction_kwargs, messages = interaction_columns(prompts)
        with self._kv_cache(sizes=[(len(rows), self.engine.max_model_len)]):  # one slot per conversation
            convs = asyncio.run(
                self._agent_loop.run_batch(rows, per_row, kwargs, images, interaction_kwargs, messages)
            )
        return assemble_conversations(
            prompts,
            convs,
            pad_id,
            int(self.config.response_length),
            bool(self.config.get("calculate_log_probs")),
        )


def _same_images(a: dict | None, b: dict | None) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    return all(torch.equal(a[k], b[k]) for k in ("image_grid_thw", "pixel_values"))


def _images(group: tuple) -> dict | None:
    """A request group's images: ``(prompt, n, params[, images])``."""
    return group[3] if len(group) > 3 else None


def _module_device(module: nn.Module) -> torch.device:
    """Where the actor's (sharded) parameters live: the engine computes there."""
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        return local.device
    return torch.device("cpu")
