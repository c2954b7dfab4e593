"""``tool_agent``: multi-turn tool use through the servers (verl's ``ToolAgentLoop``).

The conversation machine is the one the synchronous multi-turn rollout runs
(:class:`hybridflow.workers.rollout.multi_turn.ToolAgentLoop`: tool YAML, sandbox, Hermes parser, turn
and length limits, tool timeouts); here each assistant turn is a request to the sample's sticky replica
instead of a call into the rank's engine. Tool-response tokens get mask 0 and log-prob 0.
An abort (partial rollout) ends the conversation where it stands (``extra_fields["is_partial"]``).
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

from hybridflow.workers.rollout.agent_loop.base import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)
from hybridflow.workers.rollout.agent_loop.single_turn import prompt_ids_of, version_span
from hybridflow.workers.rollout.engine import Completion, GenerationResult

FINISH_REASONS = {"completed": "stop", "length": "length", "aborted": "abort"}


class _ServerTurns:
    """The engine call the conversation machine makes (``await generate(prompt_ids, params)``), as a
    request to the servers. Times the generation (the rest of the loop's time is tools)."""

    def __init__(self, server_manager, request_id: str, sampling_params: dict, prompt_len: int) -> None:
        self.server_manager, self.request_id = server_manager, request_id
        self.sampling_params, self.prompt_len = dict(sampling_params), prompt_len
        self.seconds = 0.0
        self.aborted = False
        self.extra: dict = {}

    async def generate(self, prompt_ids: list[int], params, n: int = 1, request_id: str | None = None):
        sampling = dict(self.sampling_params, max_tokens=int(params.max_new_tokens))
        if sampling.get("seed") is not None:
            sampling["seed_position"] = len(prompt_ids) - self.prompt_len  # response tokens so far
        start = time.perf_counter()
        out = await self.server_manager.generate(
            self.request_id, prompt_ids=list(prompt_ids), sampling_params=sampling
        )
        self.seconds += time.perf_counter() - start
        self.aborted = self.aborted or out.stop_reason == "aborted"
        version_span(self.extra, out.weight_version, len(out.token_ids))
        reason = FINISH_REASONS.get(out.stop_reason or "completed", "stop")
        completion = Completion(
            list(out.token_ids), list(out.log_probs or [0.0] * len(out.token_ids)), reason
        )
        return GenerationResult(self.request_id, list(prompt_ids), [completion])


@functools.lru_cache(maxsize=8)
def _tools(path: str | None):
    """The tools of a tool YAML, built once per process."""
    from hybridflow.workers.rollout.tools.registry import load_tools

    return load_tools(path) if path else {}


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """Multi-turn with tools; settings from ``rollout.multi_turn`` (as the synchronous rollout)."""

    def __init__(self, *args, eos_token_ids: list[int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.eos_token_ids = list(eos_token_ids or [self.tokenizer.eos_token_id])

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        from hybridflow.workers.rollout.multi_turn import MultiTurnLimits
        from hybridflow.workers.rollout.multi_turn import ToolAgentLoop as Conversations
        from hybridflow.workers.rollout.tools.parser import get_tool_call_parser

        multi_turn = self.rollout_config.multi_turn
        prompt_ids = await prompt_ids_of(self, kwargs)
        turns = _ServerTurns(
            self.server_manager,
            str(kwargs.get("sample_id") or uuid.uuid4().hex),
            sampling_params,
            len(prompt_ids),
        )
        machine = Conversations(
            turns,
            self.tokenizer,
            _tools(multi_turn.get("tool_config_path")),
            get_tool_call_parser(str(multi_turn.get("format", "hermes"))),
            MultiTurnLimits.from_rollout_config(self.rollout_config),
            self.eos_token_ids,
        )
        start = time.perf_counter()
        conv = await machine.run(prompt_ids, _engine_params(), dict(kwargs.get("tools_kwargs") or {}))
        total = time.perf_counter() - start
        extra = {
            **turns.extra,
            "is_partial": turns.aborted,
            "tool_calls": conv.tool_calls,
            "tool_failures": conv.tool_failures,
            "tool_rewards": conv.tool_reward,
        }
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=conv.response_ids,
            response_mask=conv.response_mask,
            response_logprobs=conv.log_probs,
            num_turns=conv.assistant_turns + conv.user_turns + 1,
            metrics=AgentLoopMetrics(
                generate_sequences=turns.seconds,
                tool_calls=max(total - turns.seconds, 0.0),
                num_preempted=int(turns.aborted),
            ),
            extra_fields=extra,
        )


def _engine_params():
    """The machine only reads ``max_new_tokens`` from these; sampling settings go to the server."""
    from hybridflow.workers.rollout.engine import SamplingParams

    return SamplingParams(max_new_tokens=1)
