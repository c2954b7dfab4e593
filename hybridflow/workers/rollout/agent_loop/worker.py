"""``AgentLoopWorker``: runs a chunk of the batch, one asyncio agent loop per sample (verl's class).

Every sample's loop runs concurrently; each talks to the servers through the worker's
:class:`~.server_manager.AsyncLLMServerManager`, so the replicas see requests one at a time as the
loops produce them. As soon as a sample's loop returns it is scored with the run's reward manager
(the rule reward functions, custom ``compute_score`` and their time limits — on one of
:data:`SCORING_THREADS` threads of the worker's own, so the other samples keep generating), unless the
loop scored itself (``reward_score``) or a reward model is in use (the trainer runs it). A scorer that
hangs past ``reward_model.score_timeout_s`` cannot be stopped in a thread: it is counted
(``agent_loop/stuck_scorers``, with a warning) and bounded (``reward_manager/timeouts.py``: past
``MAX_STUCK_SCORERS`` the run ends naming the sample). The chunk comes back as the same DataProto the
synchronous rollout gives (``responses``, ``response_mask``, ``rollout_log_probs``, prompt + response
``input_ids`` ...), plus ``token_level_scores`` and the reward extras when scored here, and with router
replay R3 the loops' ``routed_experts`` laid out in ``input_ids``' columns as the sync rollout lays them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.rollout_trace import (
    RolloutTraceConfig,
    record_event,
    rollout_numbers,
    rollout_trace_attr,
    to_jsonable,
    trace_dir,
)
from hybridflow.workers.reward_manager.timeouts import stuck_scorers
from hybridflow.workers.rollout.agent_loop import single_turn, tool_agent  # noqa: F401  (register built-ins)
from hybridflow.workers.rollout.agent_loop.base import (
    AgentLoopOutput,
    DictConfigWrap,
    agent_loop_class,
    load_agent_loop_configs,
)
from hybridflow.workers.rollout.agent_loop.server_manager import AsyncLLMServerManager
from hybridflow.workers.rollout.base import assemble_output, sample_seed, sampling_params
from hybridflow.workers.rollout.engine.routing import routed_experts_rows

# extra_fields a loop may return that become per-sample columns (numbers) of the batch
NUMERIC_EXTRAS = ("tool_calls", "tool_failures", "tool_rewards")
# extra_fields the reward function sees in its extra_info (verl's tool_extra_fields): tool_agent's
TOOL_EXTRA_FIELDS = ("turn_scores", "tool_rewards")
SCORING_THREADS = 8  # samples scored at once in one worker (off its event loop)


class AgentLoopError(RuntimeError):
    """An agent loop raised for a sample (the message names the loop and the sample)."""


def default_agent_loop(rollout_cfg) -> str:
    """``rollout.agent.default_agent_loop``, or (null) ``tool_agent`` with ``multi_turn.enable`` and
    ``single_turn_agent`` without."""
    configured = (rollout_cfg.get("agent") or {}).get("default_agent_loop")
    if configured:
        return str(configured)
    return "tool_agent" if (rollout_cfg.get("multi_turn") or {}).get("enable") else "single_turn_agent"


def loop_sampling_params(rollout_cfg, meta: dict) -> dict:
    """verl's per-call sampling dict from the rollout config (``val_kwargs`` when validating; greedy
    as temperature 0)."""
    chosen = sampling_params(rollout_cfg, meta)
    params = {"temperature": chosen["temperature"], "top_p": chosen["top_p"], "top_k": chosen["top_k"]}
    params["logprobs"] = bool(rollout_cfg.get("calculate_log_probs", True))
    return params


class AgentLoopWorker:
    """``config``: the whole run config (a plain dict or DictConfig); ``server_handles`` / ``server_names``:
    the replicas. Built as a Ray actor by :class:`~.manager.AgentLoopManager`."""

    def __init__(self, config, server_handles: list, server_names: list[str] | None = None) -> None:
        from hybridflow.models.loading import get_generation_eos_ids, load_tokenizer
        from hybridflow.utils.dataset.multimodal import load_processor
        from hybridflow.workers.model_builder import resolve_local_path

        self.config: DictConfig = config if isinstance(config, DictConfig) else OmegaConf.create(config)
        rollout = self.config.actor_rollout_ref.rollout
        agent = rollout.get("agent") or {}
        model = self.config.actor_rollout_ref.model
        path = resolve_local_path(model.path)
        self.tokenizer = load_tokenizer(
            path,
            trust_remote_code=bool(model.get("trust_remote_code", False)),
            custom_chat_template=model.get("custom_chat_template"),
        )
        self.eos_token_ids = get_generation_eos_ids(
            path, trust_remote_code=bool(model.get("trust_remote_code", False))
        )
        self.processor = load_processor(path, self.tokenizer)  # None for a text-only model
        self.server_manager = AsyncLLMServerManager(
            self.config,
            server_handles,
            names=server_names,
            timeout_s=agent.get("generate_timeout_s"),
            processor=self.processor,
        )
        load_agent_loop_configs(agent.get("agent_loop_config_path"))
        self.default_agent_loop = default_agent_loop(rollout)
        self.reward_fn = self._reward_fn()
        self._reward_clock = {"generated": 0.0, "scored": 0.0}  # wall times: last sample generated / scored
        self._scoring = ThreadPoolExecutor(SCORING_THREADS, thread_name_prefix="agent-loop-scoring")
        self._init_trace()

    def _init_trace(self) -> None:
        """``rollout.trace``: this process's trace writer (nothing when no backend is set)."""
        trace = self.config.actor_rollout_ref.rollout.get("trace") or {}
        if not trace.get("backend"):
            return
        RolloutTraceConfig.init(
            self.config.trainer.project_name,
            self.config.trainer.experiment_name,
            str(trace.backend),
            bool(trace.get("token2text", False)),
            trace.get("max_samples_per_step_per_worker"),
            directory=trace_dir(self.config),
            tokenizer=self.tokenizer,
        )

    def _reward_fn(self):
        """The run's reward manager, scoring in the loop; None when a reward model scores (the trainer
        runs it: the reward-model worker, or a served RM colocated) or ``rollout.agent.reward_in_loop``
        is off. A served RM standalone (``reward_model.enable_resource_pool``) scores here."""
        from hybridflow.workers.reward_manager import build_reward_manager

        agent = self.config.actor_rollout_ref.rollout.get("agent") or {}
        rm = self.config.reward_model
        standalone = rm.get("enable") and rm.get("use_reward_loop") and rm.get("enable_resource_pool")
        if (rm.get("enable") and not standalone) or not agent.get("reward_in_loop", True):
            return None
        if self.config.reward_model.get("use_reward_loop", False):  # awaited per sample (_maybe_score)
            from hybridflow.workers.reward_loop import RewardLoop

            return RewardLoop(self.config, self.tokenizer)
        return build_reward_manager(
            self.config.reward_model,
            self.config.custom_reward_function,
            self.tokenizer,
            num_examine=0,
            max_resp_len=int(self.config.data.max_response_length),
            reward_fn_key=str(self.config.data.get("reward_fn_key", "data_source")),
            manager_section=self.config.get("reward_manager"),
        )

    # ------------------------------------------------------------------ elastic replicas (the driver's)
    async def replica_down(self, index: int) -> None:
        """Replica ``index``'s engine died: route nothing more to it until :meth:`replica_up`."""
        self.server_manager.replica_down(index)

    async def replica_up(self, index: int) -> None:
        self.server_manager.replica_up(index)

    async def requests_rerouted(self) -> int:
        """Calls this worker sent again to another replica because theirs died (the run's total)."""
        return self.server_manager.rerouted

    # ------------------------------------------------------------------ one chunk
    async def generate_sequences(self, batch: DataProto) -> DataProto:
        """Run every row of ``batch`` (prompt rows, already repeated ``n`` times) through its loop."""
        rollout = self.config.actor_rollout_ref.rollout
        meta = batch.meta_info
        params = loop_sampling_params(rollout, meta)
        rows = len(batch)
        names = batch.non_tensor_batch.get("agent_name")
        names = (
            [str(n) if n else self.default_agent_loop for n in names]
            if names is not None
            else [self.default_agent_loop] * rows
        )
        seeds = self._seeds(batch, params)
        partials = meta.get("partial_outputs") or {}  # row -> its output so far (a resumed chunk)
        traces = self._trace_plan(batch)
        tasks = [
            asyncio.create_task(
                self._run_row(batch, row, names[row], params, seeds[row], partials.get(row), traces[row])
            )
            for row in range(rows)
        ]
        results = await asyncio.gather(*tasks)
        if RolloutTraceConfig.get_backend() is not None:  # the chunk's trace written before it returns
            await asyncio.get_running_loop().run_in_executor(None, RolloutTraceConfig.flush)
        outputs = [output for output, _ in results]
        scores = [score for _, score in results]
        return self._assemble(batch, outputs, scores)

    def _seeds(self, batch: DataProto, params: dict) -> list[dict | None]:
        """Each row's sampling stream, as ``{seed, seed_sample}``: the prompt's seed (rollout.seed, epoch,
        its dataset index) and the sample's number within the prompt's group (``rollout_n``, counted by
        the manager over the whole batch, since a group may span two workers' chunks; else counted here
        over the rows of one ``uid``); None when greedy or the batch carries no dataset index."""
        index = batch.non_tensor_batch.get("index")
        rollout = self.config.actor_rollout_ref.rollout
        if params["temperature"] == 0 or index is None or rollout.get("seed") is None:
            return [None] * len(batch)
        numbers = batch.non_tensor_batch.get("rollout_n")
        if numbers is None:
            numbers = rollout_numbers(batch.non_tensor_batch.get(keys.UID), len(batch))
        streams = []
        for row in range(len(batch)):
            sample = int(numbers[row])
            seed = sample_seed(
                int(rollout.seed),
                int(batch.meta_info.get("epoch", 0)),
                int(index[row]),
                validate=bool(batch.meta_info.get("validate", False)),
            )
            streams.append({"seed": seed, "seed_sample": sample})
        return streams

    def _trace_plan(self, batch: DataProto) -> list[dict]:
        """Each row's :func:`rollout_trace_attr` arguments: its step, dataset index, number within its
        group, and whether it is traced (``max_samples_per_step_per_worker`` draws whole groups)."""
        rows, meta = len(batch), batch.meta_info
        if RolloutTraceConfig.get_backend() is None:
            return [{"trace": False}] * rows
        columns = batch.non_tensor_batch
        index = columns.get("index")
        index = [to_jsonable(i) for i in index] if index is not None else list(range(rows))
        step, validate = int(meta.get("global_steps", -1)), bool(meta.get("validate", False))
        numbers = columns.get("rollout_n")  # the manager's, over the whole batch (a group may span chunks)
        numbers = numbers if numbers is not None else rollout_numbers(columns.get(keys.UID, index), rows)
        traced = RolloutTraceConfig.get_instance().traced_rows(index, step, validate)
        return [
            {
                "sample_index": index[row],
                "step": step,
                "rollout_n": int(numbers[row]),
                "validate": validate,
                "name": "agent_loop",
                "trace": row in traced,
            }
            for row in range(rows)
        ]

    async def _run_row(self, batch: DataProto, row: int, name: str, params: dict, seed, partial, trace: dict):
        """One sample, in its trace (every traced call inside is recorded as this sample's)."""
        with rollout_trace_attr(**trace):
            output, score = await self._run_sample(batch, row, name, params, seed, partial)
            if score is not None:
                record_event(
                    "reward", "AgentLoopWorker.reward", output={"score": float(score[0].sum()), **score[1]}
                )
            elif output.reward_score is not None:
                record_event("reward", "AgentLoopOutput.reward_score", output={"score": output.reward_score})
            return output, score

    async def _run_sample(self, batch: DataProto, row: int, name: str, params: dict, seed, partial):
        fields = {key: value[row] for key, value in batch.non_tensor_batch.items()}
        sample_params = dict(params) if seed is None else {**params, **seed}
        uid = fields.get(keys.UID)
        fields.setdefault("sample_id", f"{uid or uuid.uuid4().hex}-{row}")
        if partial is not None and not partial.extra_fields.get("is_partial"):
            output = partial  # a sample that had finished when its group was stopped: kept as it is
            return output, await self._maybe_score(batch, row, output)
        if partial is not None:
            fields["partial_output"] = partial
        try:
            cls, init_kwargs = agent_loop_class(name)
            loop = cls(
                trainer_config=DictConfigWrap(self.config),
                server_manager=self.server_manager,
                tokenizer=self.tokenizer,
                processor=self.processor,
                dataset_cls=None,
                dataset_config=DictConfigWrap(self.config.data),
                eos_token_ids=self.eos_token_ids,
                **init_kwargs,
            )
            output = await loop.run(sample_params, **fields)
        except Exception as error:
            where = f"row {row} (dataset index {fields.get('index')}, uid {uid})"
            raise AgentLoopError(
                f"agent loop {name!r} failed on {where}: {type(error).__name__}: {error}"
            ) from error
        if not isinstance(output, AgentLoopOutput):
            raise AgentLoopError(
                f"agent loop {name!r} returned {type(output).__name__}, not AgentLoopOutput (row {row})"
            )
        return output, await self._maybe_score(batch, row, output)

    async def _maybe_score(self, batch: DataProto, row: int, output: AgentLoopOutput):
        """The sample's reward (in a thread, so other samples keep going), unless the loop scored
        itself, a reward model scores, or the sample is unfinished (aborted)."""
        from hybridflow.workers.reward_manager.timeouts import ScorersStuck

        if output.reward_score is not None or self.reward_fn is None or output.extra_fields.get("is_partial"):
            return None
        self._reward_clock["generated"] = max(self._reward_clock["generated"], time.time())
        try:
            if hasattr(self.reward_fn, "score_batch"):  # the reward loop: on this event loop, beside the rest
                return await self._score_in_loop(batch, row, output)
            return await asyncio.get_running_loop().run_in_executor(
                self._scoring, self._score, batch, row, output
            )
        except ScorersStuck as error:  # the scorers hang: the run ends, naming this sample too
            index = batch.non_tensor_batch.get("index")
            where = f"row {row} (dataset index {None if index is None else index[row]})"
            raise AgentLoopError(f"scoring {where}: {error}") from None

    # ------------------------------------------------------------------ assembling the chunk
    def _prompt_rows(self, outputs: list[AgentLoopOutput], width: int) -> DataProto:
        """Left-padded prompt tensors (B, width) of the loops' prompt ids, as the dataset lays them out."""
        pad = int(self.tokenizer.pad_token_id)
        width = max(width, *(len(o.prompt_ids) for o in outputs))
        input_ids = torch.full((len(outputs), width), pad, dtype=torch.long)
        mask = torch.zeros(len(outputs), width, dtype=torch.long)
        for row, output in enumerate(outputs):
            n = len(output.prompt_ids)
            input_ids[row, width - n :] = torch.tensor(output.prompt_ids, dtype=torch.long)
            mask[row, width - n :] = 1
        positions = torch.clamp(torch.cumsum(mask, dim=1) - 1, min=0)
        return DataProto.from_dict(
            {keys.INPUT_IDS: input_ids, keys.ATTENTION_MASK: mask, keys.POSITION_IDS: positions}
        )

    def _rollout_rows(self, batch: DataProto, outputs: list[AgentLoopOutput]) -> DataProto:
        """The standard rollout output for ``outputs`` (responses cut at ``response_length``)."""
        length = int(self.config.actor_rollout_ref.rollout.response_length)
        pad = int(self.tokenizer.pad_token_id)
        rows = len(outputs)
        responses = torch.full((rows, length), pad, dtype=torch.long)
        response_mask = torch.zeros(rows, length, dtype=torch.long)
        present = torch.zeros(rows, length, dtype=torch.long)
        log_probs = torch.zeros(rows, length, dtype=torch.float32)
        for row, output in enumerate(outputs):
            n = min(len(output.response_ids), length)
            responses[row, :n] = torch.tensor(output.response_ids[:n], dtype=torch.long)
            response_mask[row, :n] = torch.tensor(output.response_mask[:n], dtype=torch.long)
            present[row, :n] = 1
            if output.response_logprobs:
                log_probs[row, :n] = torch.tensor(output.response_logprobs[:n], dtype=torch.float32)
        width = (
            batch.batch[keys.INPUT_IDS].shape[1]
            if batch.batch is not None and keys.INPUT_IDS in batch.batch.keys()
            else 1
        )
        with_log_probs = all(o.response_logprobs is not None for o in outputs)
        prompts = self._prompt_rows(outputs, width)
        out = assemble_output(
            prompts,
            responses,
            [],
            pad,
            log_probs if with_log_probs else None,
            response_mask=response_mask,
            response_attention=present,
        )
        routed = self._routed_experts(outputs)
        if routed is not None:  # router replay R3: (B, T, L, k) in input_ids' columns, 0 on padding
            out.batch[keys.ROUTED_EXPERTS] = routed_experts_rows(
                prompts.batch[keys.ATTENTION_MASK], routed, length
            )
        return out

    def _routed_experts(self, outputs: list[AgentLoopOutput]) -> list[torch.Tensor | None] | None:
        """Each output's ``routed_experts`` (prompt + response tokens, L, k) as a tensor (verl's loops
        may hand numpy arrays); None when no output has them. With
        ``rollout.enable_rollout_routing_replay`` a finished sample without them is an error: R3 would
        replay expert 0 on its every token."""
        found = [None if o.routed_experts is None else torch.as_tensor(o.routed_experts) for o in outputs]
        if self.config.actor_rollout_ref.rollout.get("enable_rollout_routing_replay", False):
            for row, (ids, output) in enumerate(zip(found, outputs, strict=True)):
                if ids is None and output.response_ids and not output.extra_fields.get("is_partial"):
                    raise AgentLoopError(
                        f"row {row}: rollout.enable_rollout_routing_replay=true but its agent loop returned "
                        "no routed_experts (a loop of its own must pass the server output's routed_experts "
                        "on, as single_turn_agent and tool_agent do)"
                    )
        return found if any(ids is not None for ids in found) else None

    async def _score_in_loop(self, batch: DataProto, row: int, output: AgentLoopOutput):
        """One sample through the reward loop (:mod:`hybridflow.workers.reward_loop`): (its token-level
        scores (T_r,), its extras); an async reward function runs on this worker's event loop."""
        reward, extras = await self.reward_fn.score_batch(self._sample(batch, row, output))
        self._reward_clock["scored"] = max(self._reward_clock["scored"], time.time())
        return reward[0], {key: values[0] for key, values in extras.items()}

    def _score(self, batch: DataProto, row: int, output: AgentLoopOutput) -> tuple[torch.Tensor, dict]:
        """One sample through the reward manager: (its token-level scores (T_r,), its extras)."""
        result = self.reward_fn(self._sample(batch, row, output), return_dict=True)
        extras = {
            key: values[0] for key, values in result.get("reward_extra_info", {}).items() if len(values) == 1
        }
        return result["reward_tensor"][0], extras

    def _sample(self, batch: DataProto, row: int, output: AgentLoopOutput) -> DataProto:
        """One finished sample as a one-row rollout batch, with its dataset fields."""
        sample = self._rollout_rows(batch, [output])
        sample.non_tensor_batch = {
            key: _column([value[row]]) for key, value in batch.non_tensor_batch.items()
        }
        sample.non_tensor_batch["__num_turns__"] = np.array([output.num_turns], dtype=np.int64)
        for key in NUMERIC_EXTRAS:
            if key in output.extra_fields:
                sample.non_tensor_batch[key] = np.array([output.extra_fields[key]])
        if "turn_scores" in output.extra_fields:
            sample.non_tensor_batch["turn_scores"] = _column([list(output.extra_fields["turn_scores"])])
        shown = {key: output.extra_fields[key] for key in TOOL_EXTRA_FIELDS if key in output.extra_fields}
        sample.non_tensor_batch["tool_extra_fields"] = _column([shown])
        return sample

    def _assemble(self, batch: DataProto, outputs: list[AgentLoopOutput], scores: list) -> DataProto:
        out = self._rollout_rows(batch, outputs)
        rows = len(outputs)
        columns = {
            "__num_turns__": np.array([o.num_turns for o in outputs], dtype=np.int64),
            "is_partial": np.array([bool(o.extra_fields.get("is_partial")) for o in outputs], dtype=bool),
            "weight_versions": _column([o.extra_fields.get("weight_versions", []) for o in outputs]),
        }
        for key in NUMERIC_EXTRAS:
            if any(key in o.extra_fields for o in outputs):
                columns[key] = np.array([o.extra_fields.get(key, 0) for o in outputs])
        if any("turn_scores" in o.extra_fields for o in outputs):  # an interaction's, a list per sample
            columns["turn_scores"] = _column([list(o.extra_fields.get("turn_scores", [])) for o in outputs])
        if (
            all(s is not None or o.reward_score is not None for s, o in zip(scores, outputs, strict=True))
            and rows
        ):
            token_scores = torch.zeros_like(out.batch[keys.RESPONSE_MASK], dtype=torch.float32)
            extras: dict[str, list] = {}
            for row, (score, output) in enumerate(zip(scores, outputs, strict=True)):
                if score is not None:
                    token_scores[row], sample_extras = score
                    for key, value in sample_extras.items():
                        extras.setdefault(key, [None] * rows)[row] = value
                else:  # the loop scored itself: its score on the last response token
                    last = (
                        int(
                            out.batch[keys.ATTENTION_MASK][
                                row, -out.batch[keys.RESPONSE_MASK].shape[1] :
                            ].sum()
                        )
                        - 1
                    )
                    token_scores[row, max(last, 0)] = float(output.reward_score)
            out.batch[keys.TOKEN_LEVEL_SCORES] = token_scores
            for key, values in extras.items():
                columns[key] = _column(values)
            out.meta_info["reward_extra_keys"] = sorted(extras)
        out.non_tensor_batch.update(columns)
        out.meta_info["metrics"] = [o.metrics.model_dump() for o in outputs]
        out.meta_info["stuck_scorers"] = stuck_scorers()  # this process's scorer threads past their limit
        if hasattr(self.reward_fn, "pop_metrics"):  # the reward loop's, and when its last score came in
            out.meta_info["reward_metrics"] = self.reward_fn.pop_metrics()
            out.meta_info["reward_clock"] = dict(self._reward_clock)
            self._reward_clock = {"generated": 0.0, "scored": 0.0}
        # a chunk with aborted samples (partial rollout) hands back every row's output, for a resume
        if any(o.extra_fields.get("is_partial") for o in outputs):
            out.meta_info["loop_outputs"] = list(outputs)
        return out


def _column(values) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = list(values)
    return column
