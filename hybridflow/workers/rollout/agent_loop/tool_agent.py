"""``tool_agent``: multi-turn tool use through the servers (verl's ``ToolAgentLoop``), resumable.

The conversation machine is the one the synchronous multi-turn rollout runs
(:class:`hybridflow.workers.rollout.multi_turn.ToolAgentLoop`: tool YAML, sandbox, Hermes parser, turn
and length limits, tool timeouts); here each assistant turn is a request to the sample's sticky replica
instead of a call into the rank's engine. Tool-response tokens get mask 0 and log-prob 0.

**Interactions** (verl's, ``multi_turn.interaction_config_path``): the sample's
``extra_info["interaction_kwargs"]`` (its ``name`` picks the interaction) starts a session under the
sample's request id; an answer that calls no tool gets the interaction's reply as a user turn (mask 0,
log-prob 0), until the interaction ends the conversation or ``max_user_turns`` / ``max_assistant_turns``
/ ``response_length`` do. ``extra_fields["turn_scores"]``: the interaction's score of each reply (a
``turn_scores`` column of the batch, and in the reward function's ``extra_info`` with the reward loop,
as in verl). The chat the interaction reads starts from the sample's ``raw_prompt``.

**Partial rollout.** An abort (a parameter sync with ``async_training.partial_rollout``) can only cut an
assistant turn: tools run between turns. The loop then returns the conversation so far with
``extra_fields["is_partial"] = True`` and its state (``extra_fields["conversation"]``: turns, tool-call
counts, where the cut turn began), and keeps the sample's tool instances aside in this process (the
rollouter sends a group back to the same agent-loop worker). Run again with ``partial_output=<that
output>``, it continues the cut turn from prompt + response so far, with the same tool instances: every
token is kept, no tool call runs twice, and the rewards of the tools (``calc_reward``) are taken once,
when the conversation ends. If the instances are gone (another process resumed it), new ones are created
and ``extra_fields["tool_session_restarted"]`` says so.

**Router replay R3.** Each server answer carries its request's ``routed_experts`` (the conversation so
far + the turn's tokens: the engine prefills every turn again while it records); the output keeps the
last turn's record, as the synchronous multi-turn rollout does: the tool / user tokens after it were
never fed, and have 0s. A resumed turn's record covers the whole conversation again (its earlier tokens'
routing recomputed under the weights the continuation attended with).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any

from hybridflow.utils.rollout_trace import rollout_trace_op
from hybridflow.workers.rollout.agent_loop.base import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)
from hybridflow.workers.rollout.agent_loop.single_turn import (
    prompt_ids_of,
    rollout_backend_name,
    sample_images,
    turn_log_probs,
    version_span,
)
from hybridflow.workers.rollout.engine import Completion, GenerationResult

logger = logging.getLogger(__name__)
FINISH_REASONS = {"completed": "stop", "length": "length", "aborted": "abort"}


class _ServerTurns:
    """The engine call the conversation machine makes (``await generate(prompt_ids, params)``), as a
    request to the servers. Times the generation (the rest of the loop's time is tools)."""

    def __init__(
        self,
        server_manager,
        request_id: str,
        sampling_params: dict,
        prompt_len: int,
        backend: str,
        extra: dict | None = None,
    ) -> None:
        self.server_manager, self.request_id = server_manager, request_id
        self.sampling_params, self.prompt_len = dict(sampling_params), prompt_len
        self.backend = backend
        self.wants_log_probs = bool(self.sampling_params.get("logprobs", True))
        self.seconds = 0.0
        self.aborted = False
        self.extra: dict = dict(extra or {})

    async def generate(
        self, prompt_ids: list[int], params, n: int = 1, request_id: str | None = None, images=None
    ):
        sampling = dict(self.sampling_params, max_tokens=int(params.max_new_tokens))
        if sampling.get("seed") is not None:
            sampling["seed_position"] = len(prompt_ids) - self.prompt_len  # response tokens so far
        start = time.perf_counter()
        out = await self.server_manager.generate(
            self.request_id,
            prompt_ids=list(prompt_ids),
            sampling_params=sampling,
            **({"image_data": images} if images else {}),
        )
        self.seconds += time.perf_counter() - start
        self.aborted = self.aborted or out.stop_reason == "aborted"
        version_span(self.extra, out.weight_version, len(out.token_ids))
        reason = FINISH_REASONS.get(out.stop_reason or "completed", "stop")
        log_probs = turn_log_probs(out, self.wants_log_probs, self.request_id, self.backend)
        routed = getattr(out, "routed_experts", None)  # R3: the turn's record over the conversation so far
        completion = Completion(
            list(out.token_ids), log_probs or [0.0] * len(out.token_ids), reason, routed_experts=routed
        )
        return GenerationResult(self.request_id, list(prompt_ids), [completion])


# id(run config) -> (that config, what every sample's loop reads of it); see _settings
_SETTINGS: dict[int, tuple[Any, dict]] = {}


def _settings(config) -> dict:
    """The ``actor_rollout_ref.rollout`` settings each sample's loop reads, looked up once per run
    config object: an OmegaConf lookup costs 50-100 us, and a sample made ~20 before its first request
    (1.6 ms of the 4.8 ms a sample's start took on the agent-loop worker's event loop, 2-core CPU)."""
    from hybridflow.workers.rollout.multi_turn import MultiTurnLimits

    entry = _SETTINGS.get(id(config))
    if entry is None or entry[0] is not config:
        rollout_config = config.actor_rollout_ref.rollout
        multi_turn = rollout_config.multi_turn
        settings = {
            "rollout": rollout_config,
            "limits": MultiTurnLimits.from_rollout_config(rollout_config),  # frozen: shared
            "tool_config_path": multi_turn.get("tool_config_path"),
            "format": str(multi_turn.get("format", "hermes")),
            "interaction_config_path": multi_turn.get("interaction_config_path"),
            "backend": rollout_backend_name(rollout_config),
        }
        if len(_SETTINGS) >= 16:  # configs of finished runs in this process (tests): keep a few
            _SETTINGS.clear()
        entry = _SETTINGS[id(config)] = (config, settings)
    return entry[1]


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
        self.rollout_config = _settings(self.config)["rollout"]
        self.eos_token_ids = list(eos_token_ids or [self.tokenizer.eos_token_id])

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        from hybridflow.workers.rollout.interactions.registry import shared_interactions
        from hybridflow.workers.rollout.multi_turn import ToolAgentLoop as Conversations
        from hybridflow.workers.rollout.tools.parser import get_tool_call_parser

        settings = _settings(self.config)
        partial: AgentLoopOutput | None = kwargs.get("partial_output")
        request_id = str(kwargs.get("sample_id") or uuid.uuid4().hex)
        prompt_ids = list(partial.prompt_ids) if partial is not None else await prompt_ids_of(self, kwargs)
        previous = _Previous(partial)
        turns = _ServerTurns(
            self.server_manager,
            request_id,
            sampling_params,
            len(prompt_ids),
            settings["backend"],
            extra={k: v for k, v in previous.extra.items() if k == "weight_versions"},
        )
        machine = Conversations(
            turns,
            self.tokenizer,
            _tools(settings["tool_config_path"]),
            get_tool_call_parser(settings["format"]),
            settings["limits"],
            self.eos_token_ids,
            shared_interactions(settings["interaction_config_path"]),
        )
        conv, session = previous.conversation(prompt_ids), None
        if partial is None:
            conv.messages = list(kwargs.get("raw_prompt") or [])  # the chat an interaction reads
        conv.images = sample_images(kwargs).get("image_data")  # every turn's prefill takes them
        if partial is not None:
            session = _PARKED.pop(request_id, None)
            if session is None:
                logger.warning("tool_agent: sample %s resumes with new tool instances", request_id)
                turns.extra["tool_session_restarted"] = True
        if session is None:
            tools_kwargs = dict(kwargs.get("tools_kwargs") or {})
            session = machine.open_session(tools_kwargs, interaction_kwargs_of(kwargs), request_id)
        start = time.perf_counter()
        try:
            await machine.converse(conv, _engine_params(), session)
        except BaseException:
            await session.release()
            raise
        if turns.aborted:  # cut mid-turn: resumable, with the same tool instances
            _park(request_id, session)
        else:
            try:
                conv.tool_reward += await session.rewards()
            finally:
                await session.release()
            machine.complete(conv)
        total = time.perf_counter() - start
        extra = {
            **previous.extra,
            **turns.extra,
            "is_partial": turns.aborted,
            "tool_calls": conv.tool_calls,
            "tool_failures": conv.tool_failures,
            "tool_rewards": conv.tool_reward,
            "turn_scores": list(conv.turn_scores),
            "conversation": _state(conv),
        }
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=conv.response_ids,
            response_mask=conv.response_mask,
            response_logprobs=conv.log_probs if turns.wants_log_probs else None,
            routed_experts=conv.routed_experts,
            num_turns=conv.assistant_turns + conv.user_turns + 1,
            metrics=AgentLoopMetrics(
                generate_sequences=previous.generate_s + turns.seconds,
                tool_calls=previous.tool_s + max(total - turns.seconds, 0.0),
                num_preempted=previous.preempted + int(turns.aborted),
            ),
            extra_fields=extra,
        )


# A conversation's counters (and the chat an interaction reads) kept across an abort
# (extra_fields["conversation"]).
STATE_FIELDS = (
    "assistant_turns",
    "user_turns",
    "tool_calls",
    "tool_failures",
    "turn_start",
    "finish_reason",
    "messages",
    "turn_scores",
)


def interaction_kwargs_of(fields: dict) -> dict:
    """A sample's ``interaction_kwargs``: ``extra_info["interaction_kwargs"]`` (where verl reads them),
    else the dataset's ``interaction_kwargs`` field (the same, taken out of ``extra_info``)."""
    extra = fields.get("extra_info")
    found = extra.get("interaction_kwargs") if isinstance(extra, dict) else None
    return dict(found if found is not None else fields.get("interaction_kwargs") or {})


def _state(conv) -> dict:
    return {name: copy.deepcopy(getattr(conv, name)) for name in STATE_FIELDS}


class _Previous:
    """What a resumed sample had: its tokens, counters, times (all empty for a new sample)."""

    def __init__(self, partial: AgentLoopOutput | None) -> None:
        self.partial = partial
        self.extra = dict(partial.extra_fields) if partial is not None else {}
        self.extra.pop("tool_session_restarted", None)
        metrics = partial.metrics if partial is not None else AgentLoopMetrics()
        self.generate_s, self.tool_s = metrics.generate_sequences, metrics.tool_calls
        self.preempted = max(metrics.num_preempted, 0)

    def conversation(self, prompt_ids: list[int]):
        """The machine's conversation: new, or the cut one with its tokens and counters."""
        from hybridflow.workers.rollout.multi_turn import Conversation

        conv = Conversation(list(prompt_ids))
        if self.partial is None:
            return conv
        out = self.partial
        conv.response_ids, conv.response_mask = list(out.response_ids), list(out.response_mask)
        conv.log_probs = list(out.response_logprobs or [0.0] * len(out.response_ids))
        conv.routed_experts = out.routed_experts  # until a resumed turn brings a record of the whole
        for name, value in (self.extra.get("conversation") or {}).items():
            setattr(conv, name, copy.deepcopy(value))
        conv.finish_reason = "abort"  # continue the cut turn
        return conv


MAX_PARKED = 4096  # tool sessions of aborted samples kept for their resume, per process
_PARKED: OrderedDict = OrderedDict()  # sample id -> its tool session (this process's event loop only)


def _park(request_id: str, session) -> None:
    """Keep an aborted sample's tool instances for its resume; past :data:`MAX_PARKED` the oldest are
    released (a run that stopped never resumes them)."""
    _PARKED[request_id] = session
    while len(_PARKED) > MAX_PARKED:
        _, oldest = _PARKED.popitem(last=False)
        asyncio.get_running_loop().create_task(oldest.release())


def _engine_params():
    """The machine only reads ``max_new_tokens`` from these; sampling settings go to the server."""
    from hybridflow.workers.rollout.engine import SamplingParams

    return SamplingParams(max_new_tokens=1)
