"""``rollout.name=vllm``: vLLM generates, colocated with the actor (verl's hybrid mode).

Each actor rank holds one in-process vLLM engine (:mod:`.engine`) in its own worker process. Before a
generation that follows an update, the actor's weights go into vLLM in place: the FSDP2 units are
gathered one at a time (:func:`~hybridflow.workers.rollout.engine.weight_sync.iter_parameter_buckets`,
a LoRA adapter merged in — vLLM gets merged weights, not adapters) and streamed into vLLM's
``reload_weights``, so no second full copy of the model exists beside vLLM's own. With
``free_cache_engine`` the KV cache is freed after each generation (the update runs without it) and
re-created before the next; the prefix cache is reset after every weight change.

Single-turn batches go to vLLM as one request per prompt with ``n`` samples (vLLM shares the prompt's
prefill among them); multi-turn tool conversations (``multi_turn.enable``) run the same tool loop as
the embedded engine (:mod:`..multi_turn`), driving vLLM by token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import torch
from torch import nn

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.workers.lora import merged_hf_weights
from hybridflow.workers.rollout.base import (
    BaseRollout,
    completions_output,
    generation_seed,
    register_rollout,
)
from hybridflow.workers.rollout.engine.weight_sync import iter_parameter_buckets, storage_bytes
from hybridflow.workers.rollout.engine_rollout import (
    engine_dtype,
    engine_max_len,
    engine_sampling_params,
    request_groups,
    row_params,
    unpadded_rows,
)


class VLLMRolloutError(RuntimeError):
    """vLLM cannot serve this rollout config (the message says which key and what to do)."""


def vllm_config_problems(config, actor_tp: int = 1) -> list[str]:
    """Rollout settings vLLM cannot honour in hybrid mode here, one line each."""
    problems = []
    if int(config.get("tensor_model_parallel_size") or 1) > 1 or actor_tp > 1:
        problems.append(
            "rollout.name=vllm runs one in-process vLLM per actor rank (TP 1): tensor parallelism "
            "(rollout or actor tensor_model_parallel_size > 1) needs rollout.name=engine"
        )
    if config.get("decode_threads") is not None:
        problems.append(
            "rollout.decode_threads is the embedded engine's; vLLM decodes with the worker's threads "
            "(trainer.num_threads_per_worker): remove it"
        )
    if config.get("decode_steps_per_sync") is not None:
        problems.append(
            "rollout.decode_steps_per_sync is the embedded engine's (vLLM schedules its own): remove it"
        )
    return problems


@register_rollout("vllm")
class VLLMRollout(BaseRollout):
    """``module``: the actor's (FSDP2-sharded) HF model; ``config``: the rollout section;
    ``model_path``: the HF directory vLLM reads the architecture (and tokenizer) from."""

    reads_model_directory = True  # the worker passes model.path

    def __init__(
        self,
        module: nn.Module,
        config,
        rank: int = 0,
        tokenizer=None,
        model_path: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        from hybridflow.workers.rollout.vllm_rollout.config import local_rank_count, start_vllm

        problems = vllm_config_problems(config)
        if problems:
            raise VLLMRolloutError("; ".join(problems))
        if model_path is None:
            raise VLLMRolloutError("rollout.name=vllm needs the model directory (model.path)")
        self.module, self.config, self.rank, self.tokenizer = module, config, rank, tokenizer
        self.multi_turn = bool(config.get("multi_turn", {}).get("enable", False))
        self.free_cache = bool(config.get("free_cache_engine", True))
        self._agent_loop = None
        device = next(iter(module.parameters())).device
        start = time.perf_counter()
        self.engine = start_vllm(
            model_path,
            config,
            engine_dtype(config.get("dtype"), device.type),
            engine_max_len(config),
            local_ranks=local_rank_count(),
            trust_remote_code=trust_remote_code,
        )
        self.startup_s = time.perf_counter() - start
        self.last_sync = self.update_weights()
        if self.free_cache:
            self.engine.release()

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self) -> dict[str, float]:
        """Stream the actor's weights into vLLM (a collective over the actor's ranks: every rank
        gathers the same FSDP units in the same order); returns the sync's metrics."""
        peak = 0
        copied = 0

        def weights():
            nonlocal peak, copied
            earlier: list[torch.Tensor] = []
            for bucket, gathered in iter_parameter_buckets(self.module):
                tensors = [tensor for _, tensor in bucket]
                if gathered:
                    peak = max(peak, storage_bytes(tensors) + storage_bytes(earlier))
                for name, full in merged_hf_weights(self.module, bucket):
                    copied += full.numel() * full.element_size()
                    yield name, full
                if gathered:
                    earlier.extend(tensors)

        with torch.no_grad():
            seconds = self.engine.load_weights(weights())
        return {
            "update_weights": seconds,
            "perf/update_weights_peak_extra_mb": peak / 2**20,
            "perf/update_weights_mb": copied / 2**20,
        }

    def release(self) -> None:
        self.engine.release()

    def release_weights(self) -> None:
        """vLLM keeps its weights (they are its only copy beside the actor's shards); what the update
        does not need is the KV cache, freed here."""
        self.engine.release()

    def resume(self, rows: int | None = None) -> None:
        """vLLM's KV cache at its configured size (vLLM sizes its blocks once, at start-up)."""
        self.engine.resume()

    @contextlib.contextmanager
    def _kv_cache(self):
        self.engine.resume()
        try:
            yield
        finally:
            if self.free_cache:
                self.engine.release()

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta = prompts.meta_info
        eos_ids = meta["eos_token_id"] if isinstance(meta["eos_token_id"], list) else [meta["eos_token_id"]]
        pad_id = int(meta["pad_token_id"])
        params = engine_sampling_params(self.config, meta, eos_ids)
        self.engine.reseed(
            generation_seed(self.config.get("seed", 0), meta.get("global_steps", 0), self.rank)
        )
        start = time.perf_counter()
        with self._kv_cache():
            if self.multi_turn:
                output = self._generate_conversations(prompts, params, eos_ids, pad_id)
            else:
                groups = request_groups(prompts, params, self.config.get("seed", 0))
                results = self.engine.finish([self.engine.add_request(p, g, n) for p, n, g in groups])
                completions = [c for result in results for c in result.completions]
                output = completions_output(
                    prompts,
                    completions,
                    int(self.config.response_length),
                    pad_id,
                    bool(self.config.get("calculate_log_probs")),
                )
        output.meta_info["metrics"] = {"engine_generate": time.perf_counter() - start}
        return output

    def _generate_conversations(self, prompts: DataProto, params, eos_ids, pad_id) -> DataProto:
        """Multi-turn: every row is its own conversation with tool calls, driving vLLM by token ids."""
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
        per_row = row_params(request_groups(prompts, params, self.config.get("seed", 0)))
        interaction_kwargs, messages = interaction_columns(prompts)
        convs = asyncio.run(
            self._agent_loop.run_batch(rows, per_row, kwargs, None, interaction_kwargs, messages)
        )
        return assemble_conversations(
            prompts,
            convs,
            pad_id,
            int(self.config.response_length),
            bool(self.config.get("calculate_log_probs")),
        )
