"""Multi-turn rollout with tool calls: one state machine per sample over the engine's async API.

Each sample goes PENDING → RUNNING (the model generates a turn) → TOOL_CALLING (its tool calls are
parsed and executed, up to ``max_parallel_calls`` at once) → RUNNING → ... → COMPLETED, bounded by
``max_assistant_turns``, ``max_user_turns`` (tool-response and interaction turns) and
``response_length`` (all tokens after the prompt). All samples run concurrently, so their generation
steps share the engine's running batch while tools execute.

With an interaction (verl's, ``multi_turn.interaction_config_path``; the sample's
``interaction_kwargs["name"]`` picks it), a turn that calls no tool goes to INTERACTING instead of
ending: the interaction reads the chat so far and replies; its reply is a user turn (mask 0, as a tool
turn) and its score a turn score (``turn_scores``); the conversation ends when it says so
(``finish_reason="interaction"``) or a limit does. The reply that ends it is appended too, as verl does.

Token-in, token-out: the conversation is kept as token ids. Generated tokens are appended as the
engine returned them (mask 1); a tool turn is rendered with the model's chat template and only its
new tokens are appended (mask 0), so the trained tokens are exactly the sampled ones. Bad tool calls
(malformed JSON, unknown tool, missing arguments, a tool that raises or reports an error, a call that
runs past ``tool_timeout_s``) become an error message in the tool turn and count in ``tool_failures``;
the model's strings reach messages escaped (lone surrogates, NUL) and clipped, so the rollout never
crashes on model output. The time limit cancels a tool that awaits (I/O, a subprocess, the Python
tool's sandbox, which also has its own ``wall_timeout_s``); a tool that blocks the event loop in
synchronous code cannot be cancelled, so tools must await or use ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

from hybridflow.utils.rollout_trace import rollout_trace_op
from hybridflow.workers.rollout.engine import LLMEngine, SamplingParams
from hybridflow.workers.rollout.interactions.base import BaseInteraction, finalize
from hybridflow.workers.rollout.tools.base_tool import BaseTool
from hybridflow.workers.rollout.tools.parser import ToolCall, ToolCallParser, short_repr

PARSE_IN_THREAD_CHARS = 100_000  # longer assistant messages are parsed off the event loop
logger = logging.getLogger(__name__)


class TurnState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    TOOL_CALLING = "tool_calling"
    INTERACTING = "interacting"
    COMPLETED = "completed"


@dataclass(frozen=True)
class MultiTurnLimits:
    response_length: int
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256  # characters of one tool response
    tool_response_truncate_side: str = "middle"  # left | right | middle
    tool_timeout_s: float | None = 60.0  # one tool call (create + execute), calc_reward, release

    @classmethod
    def from_rollout_config(cls, config) -> MultiTurnLimits:
        mt = config.multi_turn
        return cls(
            response_length=int(config.response_length),
            max_assistant_turns=mt.get("max_assistant_turns"),
            max_user_turns=mt.get("max_user_turns"),
            max_parallel_calls=int(mt.get("max_parallel_calls", 1)),
            max_tool_response_length=int(mt.get("max_tool_response_length", 256)),
            tool_response_truncate_side=str(mt.get("tool_response_truncate_side", "middle")),
            tool_timeout_s=mt.get("tool_timeout_s", 60.0),
        )


@dataclass
class Conversation:
    """One sample's growing response: ``response_ids``/``response_mask``/``log_probs`` are aligned.
    ``messages``: the chat so far as role/content dicts (kept only with an interaction, which reads
    it); ``turn_scores``: the interaction's score of each of its replies, in order."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    state: TurnState = TurnState.PENDING
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    tool_reward: float = 0.0
    finish_reason: str = ""
    turn_start: int = 0  # where the last assistant turn's tokens begin in response_ids
    messages: list[dict] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    # a vision-language prompt's images (pixel_values, image_grid_thw): every turn's prefill takes them
    images: dict | None = None
    # router replay R3 (engine/routing.py): the last turn's expert ids over the whole conversation it
    # read and wrote, (prompt + response tokens, L, k); later tool / user tokens were never fed: 0 there
    routed_experts: Any = None

    def append(self, token_ids: list[int], generated: bool, log_probs: list[float] | None = None) -> None:
        self.response_ids.extend(token_ids)
        self.response_mask.extend([int(generated)] * len(token_ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(token_ids))

    def truncate(self, length: int) -> None:
        del self.response_ids[length:], self.response_mask[length:], self.log_probs[length:]

    def metrics(self) -> dict[str, float]:
        return {
            "num_turns": self.assistant_turns + self.user_turns,
            "assistant_turns": self.assistant_turns,
            "tool_calls": self.tool_calls,
            "tool_failures": self.tool_failures,
        }


def truncate_text(text: str, limit: int, side: str = "middle") -> str:
    """At most ``limit`` characters of ``text``, dropping from the ``side`` given (marked with ...)."""
    if len(text) <= limit:
        return text
    marker = "...(truncated)..."
    keep = max(limit - len(marker), 0)
    if side == "left":
        return marker + text[len(text) - keep :]
    if side == "right":
        return text[:keep] + marker
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def encodable(text) -> str:
    """``text`` as a string every tokenizer accepts: lone surrogates (which a model's JSON can carry,
    ``"\\udc80"``) become their ``\\udc80`` escape instead of making the encode raise TypeError."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


# id(tokenizer) -> (a weak reference to it, {(template, end-of-turn ids, kwargs): reference prefix ids})
_PREFIXES: dict[int, tuple[weakref.ref, dict]] = {}


def _reference_prefixes(tokenizer) -> dict:
    """The reference chat's token ids computed for ``tokenizer`` so far, by (chat template, end-of-turn
    ids, template kwargs): a conversation starts without rendering that chat again (~0.9 ms a sample
    before its first request, on the agent-loop worker's event loop). Forgotten with the tokenizer;
    holds no reference to it."""
    entry = _PREFIXES.get(id(tokenizer))
    if entry is None or entry[0]() is not tokenizer:
        forget = functools.partial(_PREFIXES.pop, id(tokenizer), None)
        entry = _PREFIXES[id(tokenizer)] = (weakref.ref(tokenizer, lambda _ref: forget()), {})
    return entry[1]


class ToolTurnRenderer:
    """The token ids a tool-response turn adds after an assistant turn, rendered by the chat template.

    It renders a reference conversation with and without the tool messages and keeps the difference
    after the assistant's end-of-turn token, so earlier turns are never re-tokenised."""

    def __init__(self, tokenizer, end_of_turn_ids: list[int], template_kwargs: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn_ids = set(end_of_turn_ids)
        # data.apply_chat_template_kwargs (verl's, e.g. {enable_thinking: false}), as the prompts had them
        self.template_kwargs = dict(template_kwargs or {})
        self._base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        template = getattr(tokenizer, "chat_template", None)  # a template set later renders anew
        key = (str(template), tuple(sorted(self.end_of_turn_ids)), repr(sorted(self.template_kwargs.items())))
        prefixes = _reference_prefixes(tokenizer)
        if key not in prefixes:
            prefixes[key] = self._reference_prefix()
        self._prefix = prefixes[key]

    def _reference_prefix(self) -> tuple[int, ...]:
        base_ids = self._encode(self._base, add_generation_prompt=False)
        ends = [i for i, t in enumerate(base_ids) if t in self.end_of_turn_ids]
        if not ends:
            raise ValueError("the chat template does not end an assistant turn with an EOS token")
        return tuple(base_ids[: ends[-1] + 1])

    def _encode(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tool_turn_ids(self, responses: list[str]) -> list[int]:
        return self._turn_ids([{"role": "tool", "content": encodable(text)} for text in responses])

    def user_turn_ids(self, text: str) -> list[int]:
        """The tokens of a user message (an interaction's reply) and the next assistant header."""
        return self._turn_ids([{"role": "user", "content": encodable(text)}])

    def _turn_ids(self, messages: list[dict]) -> list[int]:
        full = self._encode(self._base + messages, add_generation_prompt=True)
        if tuple(full[: len(self._prefix)]) != self._prefix:
            role = messages[0]["role"]
            raise ValueError(f"the chat template re-renders earlier turns when a {role} turn is added")
        return full[len(self._prefix) :]


class ToolAgentLoop:
    """Runs conversations with ``tools`` (name → tool) and ``interactions`` (name → interaction, from
    ``interaction_config_path``; empty: none) through ``engine``."""

    def __init__(
        self,
        engine: LLMEngine,
        tokenizer,
        tools: dict[str, BaseTool],
        parser: ToolCallParser,
        limits: MultiTurnLimits,
        end_of_turn_ids: list[int],
        interactions: dict[str, BaseInteraction] | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.tools, self.parser, self.limits = (
            engine,
            tokenizer,
            tools,
            parser,
            limits,
        )
        self.interactions = dict(interactions or {})
        self.end_of_turn_ids = list(end_of_turn_ids)
        self.renderer = ToolTurnRenderer(tokenizer, end_of_turn_ids)

    def use_template_kwargs(self, template_kwargs: dict | None) -> None:
        """Render tool and user turns with ``data.apply_chat_template_kwargs`` (the generate call's meta
        info): a Qwen3 prompt rendered with ``enable_thinking: false`` gets its next assistant header
        rendered the same way."""
        if dict(template_kwargs or {}) != self.renderer.template_kwargs:
            self.renderer = ToolTurnRenderer(self.tokenizer, self.end_of_turn_ids, template_kwargs)

    async def run_batch(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        tools_kwargs: list[dict | None],
        images: list[dict | None] | None = None,
        interaction_kwargs: list[dict | None] | None = None,
        messages: list[list[dict] | None] | None = None,
    ) -> list[Conversation]:
        """All conversations concurrently; results in input order. ``images``: each prompt's (a
        vision-language model's ``multi_modal_inputs``; None or {} for a text prompt);
        ``interaction_kwargs`` and ``messages`` (the prompt's chat): each row's, for an interaction."""
        rows = len(prompts)
        images = images if images is not None else [None] * rows
        interaction_kwargs = interaction_kwargs if interaction_kwargs is not None else [None] * rows
        messages = messages if messages is not None else [None] * rows
        runs = (
            self.run(p, sp, kw, im, ik, ms)
            for p, sp, kw, im, ik, ms in zip(
                prompts, params, tools_kwargs, images, interaction_kwargs, messages, strict=True
            )
        )
        return list(await asyncio.gather(*runs))

    async def run(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tools_kwargs: dict | None = None,
        images: dict | None = None,
        interaction_kwargs: dict | None = None,
        messages: list[dict] | None = None,
    ) -> Conversation:
        conv = Conversation(list(prompt_ids), images=images or None, messages=list(messages or []))
        session = self.open_session(tools_kwargs, interaction_kwargs)
        try:
            await self.converse(conv, params, session)
            conv.tool_reward += await session.rewards()
        finally:
            await session.release()
        return self.complete(conv)

    def open_session(
        self, tools_kwargs: dict | None = None, interaction_kwargs: dict | None = None, request_id=None
    ) -> _ToolSession:
        """One sample's tool instances (created on first use) and interaction (started at its first
        reply as ``request_id``, a new id when None), released by :meth:`_ToolSession.release`."""
        session = _ToolSession(self.tools, tools_kwargs or {}, self.limits.tool_timeout_s)
        session.user = _UserSession.pick(self.interactions, interaction_kwargs, request_id)
        return session

    def complete(self, conv: Conversation) -> Conversation:
        """A finished conversation: cut at ``response_length``, state COMPLETED."""
        conv.truncate(self.limits.response_length)
        conv.state = TurnState.COMPLETED
        return conv

    async def converse(self, conv: Conversation, params: SamplingParams, session: _ToolSession) -> None:
        """Turns until the conversation ends (its ``finish_reason`` says why). A conversation that an
        abort ended (``finish_reason == "abort"``, partial rollout) continues its cut assistant turn:
        the turn's tokens so far are kept, the turn is not counted twice, its tool calls are parsed from
        the whole turn, and no earlier tool call runs again (their answers are already tokens)."""
        limits = self.limits
        resuming = conv.finish_reason == "abort"
        conv.finish_reason = ""
        while True:
            budget = limits.response_length - len(conv.response_ids)
            if budget <= 0:
                conv.finish_reason = "length"
                return
            conv.state = TurnState.RUNNING
            turn_params = replace(params, max_new_tokens=budget, seed_position=len(conv.response_ids))
            ids = conv.prompt_ids + conv.response_ids
            if conv.images:  # the first turn's images stay in the conversation: every prefill takes them
                result = await self.engine.generate(ids, turn_params, images=conv.images)
            else:
                result = await self.engine.generate(ids, turn_params)
            turn = result.completions[0]
            if turn.routed_experts is not None:  # the engine recomputes every turn (no prefix cache)
                conv.routed_experts = turn.routed_experts  # (an aborted turn that fed nothing has none)
            if not resuming:
                conv.turn_start = len(conv.response_ids)
                conv.assistant_turns += 1
            resuming = False
            conv.append(turn.token_ids, generated=True, log_probs=turn.log_probs)
            text = self.tokenizer.decode(conv.response_ids[conv.turn_start :], skip_special_tokens=True)
            if len(text) < PARSE_IN_THREAD_CHARS:
                _, calls, errors = self.parser.parse(text)
            else:  # a long message: keep the event loop (other conversations) moving meanwhile
                _, calls, errors = await asyncio.to_thread(self.parser.parse, text)
            wants_tools = bool(calls or errors)
            if turn.finish_reason in ("length", "abort") or (not wants_tools and session.user is None):
                conv.finish_reason = turn.finish_reason
                return
            if limits.max_assistant_turns and conv.assistant_turns >= limits.max_assistant_turns:
                conv.finish_reason = "max_assistant_turns"
                return
            if limits.max_user_turns and conv.user_turns >= limits.max_user_turns:
                conv.finish_reason = "max_user_turns"
                return
            if session.user is not None:  # the interaction reads the chat: the answer joins it
                conv.messages.append({"role": "assistant", "content": text})
            done = False
            if wants_tools:
                conv.state = TurnState.TOOL_CALLING
                responses = await self._tool_responses(conv, calls, [e.message for e in errors], session)
                conv.append(self.renderer.tool_turn_ids(responses), generated=False)
                if session.user is not None:
                    conv.messages.extend({"role": "tool", "content": r} for r in responses)
            else:
                conv.state = TurnState.INTERACTING
                done, reply, score = await session.user.reply(conv.messages)
                conv.messages.append({"role": "user", "content": reply})
                if score is not None:
                    conv.turn_scores.append(score)
                conv.append(self.renderer.user_turn_ids(reply), generated=False)
            conv.user_turns += 1
            if done:
                conv.finish_reason = "interaction"
                return

    async def _tool_responses(
        self, conv: Conversation, calls: list[ToolCall], parse_errors: list[str], session: _ToolSession
    ) -> list[str]:
        limit = self.limits.max_parallel_calls
        run, refused = calls[:limit], calls[limit:]
        outcomes = await asyncio.gather(*(session.call(call) for call in run))
        conv.tool_calls += len(calls) + len(parse_errors)
        conv.tool_failures += sum(not ok for _, ok in outcomes) + len(refused) + len(parse_errors)
        texts = [text for text, _ in outcomes]
        texts += [
            f"Error: at most {limit} tool calls run per turn; {short_repr(c.name)} was not run."
            for c in refused
        ]
        texts += [f"Error: {message}" for message in parse_errors]
        side, size = self.limits.tool_response_truncate_side, self.limits.max_tool_response_length
        return [truncate_text(encodable(text), size, side) for text in texts]


class _UserSession:
    """One sample's interaction: the instance chosen by ``interaction_kwargs["name"]``, the sample's
    kwargs (passed to every call, as verl passes them) and its instance id once started."""

    def __init__(self, interaction: BaseInteraction, kwargs: dict, request_id: str | None) -> None:
        self.interaction, self.kwargs = interaction, kwargs
        self.request_id = request_id or uuid.uuid4().hex
        self.instance_id: str | None = None

    @classmethod
    def pick(cls, interactions: dict, kwargs: dict | None, request_id: str | None) -> _UserSession | None:
        """None without interactions; else the sample's (a ValueError names a missing or unknown name)."""
        if not interactions:
            return None
        kwargs = dict(kwargs or {})
        name = kwargs.get("name")
        if name is None:
            raise ValueError(
                "rollout.multi_turn.interaction_config_path is set but the sample's "
                f"extra_info.interaction_kwargs has no 'name'; interactions: {sorted(interactions)}"
            )
        if name not in interactions:
            raise ValueError(
                f"interaction {name!r} (extra_info.interaction_kwargs.name) is not in "
                f"rollout.multi_turn.interaction_config_path; interactions: {sorted(interactions)}"
            )
        return cls(interactions[name], kwargs, request_id)

    @rollout_trace_op
    async def reply(self, messages: list[dict]) -> tuple[bool, str, float | None]:
        """The interaction's reply to the chat ``messages`` (started on first use):
        ``(should_terminate_sequence, user message text, turn score or None)``."""
        if self.instance_id is None:
            started = await self.interaction.start_interaction(self.request_id, **self.kwargs)
            self.instance_id = started if started is not None else self.request_id
        done, text, score, _ = await self.interaction.generate_response(
            self.instance_id, messages, **self.kwargs
        )
        return bool(done), "" if text is None else str(text), None if score is None else float(score)

    async def release(self) -> None:
        if self.instance_id is not None:
            instance_id, self.instance_id = self.instance_id, None
            await finalize(self.interaction, instance_id)


_MEDIA_WARNED: set[str] = set()  # tools whose images/videos were dropped (warned once each)


def response_text(response: Any, tool_name: str = "") -> str:
    """The text of a tool's response: a string as it is, verl's ``ToolResponse`` its ``text`` ("" when
    None). Its images and videos are not rendered in the tool turn (a warning, once per tool)."""
    if isinstance(response, str):
        return response
    if all(hasattr(response, key) for key in ("text", "image", "video")):  # verl's ToolResponse
        if (response.image or response.video) and tool_name not in _MEDIA_WARNED:
            _MEDIA_WARNED.add(tool_name)
            logger.warning("tool %r returned images or videos: only its text enters the tool turn", tool_name)
        return "" if response.text is None else str(response.text)
    return str(response)


class _ToolSession:
    """One sample's tool instances, created on first use with ``tools_kwargs[name]["create_kwargs"]``,
    and its interaction (``user``; None without one)."""

    def __init__(
        self, tools: dict[str, BaseTool], tools_kwargs: dict[str, Any], timeout_s: float | None = None
    ) -> None:
        self.tools, self.tools_kwargs, self.timeout_s = tools, tools_kwargs, timeout_s
        self.instances: dict[str, str] = {}
        self.step_rewards = 0.0
        self.user: _UserSession | None = None

    def _kwargs(self, name: str, stage: str) -> dict:
        return dict((self.tools_kwargs.get(name) or {}).get(f"{stage}_kwargs") or {})

    @rollout_trace_op
    async def call(self, call: ToolCall) -> tuple[str, bool]:
        """(response text, succeeded). A call fails when the tool is unknown, arguments are missing, the
        tool raises or returns something malformed, or its metrics carry an ``"error"``."""
        tool = self.tools.get(call.name)
        name = short_repr(call.name)  # the model's string, escaped and clipped for the message
        if tool is None:
            return f"Error: unknown tool {name}; available: {', '.join(sorted(self.tools))}", False
        missing = tool.missing_arguments(call.arguments)
        if missing:
            return f"Error: tool {name} is missing required argument(s): {', '.join(missing)}", False
        started = time.monotonic()
        try:
            text, reward, metrics = await asyncio.wait_for(self._run(call, tool), self.timeout_s)
            reward = float(reward)
        except TimeoutError as error:
            if self.timeout_s is None or time.monotonic() - started < self.timeout_s:  # the tool's own
                return f"Error: tool {name} failed: {type(error).__name__}: {error}", False
            return f"Error: tool {name} did not finish within {self.timeout_s:g}s and was stopped", False
        except Exception as error:  # a broken tool is the model's feedback, not a crashed rollout
            return f"Error: tool {name} failed: {type(error).__name__}: {error}", False
        self.step_rewards += reward
        return response_text(text, call.name), not (isinstance(metrics, dict) and metrics.get("error"))

    async def _run(self, call: ToolCall, tool: BaseTool) -> tuple:
        if call.name not in self.instances:
            created = await tool.create(**self._kwargs(call.name, "create"))
            # verl's tools return (instance_id, ToolResponse); ours the id
            self.instances[call.name] = created[0] if isinstance(created, tuple) else created
        return await tool.execute(
            self.instances[call.name], call.arguments, **self._kwargs(call.name, "execute")
        )

    async def rewards(self) -> float:
        total = self.step_rewards
        for name, instance_id in self.instances.items():
            pending = self.tools[name].calc_reward(instance_id, **self._kwargs(name, "calc_reward"))
            try:
                total += float(await asyncio.wait_for(pending, self.timeout_s))
            except TimeoutError:
                raise TimeoutError(
                    f"tool {name!r}: calc_reward did not return within "
                    f"rollout.multi_turn.tool_timeout_s={self.timeout_s:g}s"
                ) from None
        return total

    async def release(self) -> None:
        if self.user is not None:
            await self.user.release()
        for name, instance_id in self.instances.items():
            pending = self.tools[name].release(instance_id, **self._kwargs(name, "release"))
            try:
                await asyncio.wait_for(pending, self.timeout_s)
            except TimeoutError:  # cleanup only: the rollout's result stands
                logger.warning("tool %r: release did not return within %ss", name, self.timeout_s)


def build_agent_loop(
    engine: LLMEngine, tokenizer, rollout_config, end_of_turn_ids: list[int]
) -> ToolAgentLoop:
    """The agent loop a rollout config asks for: tools from ``multi_turn.tool_config_path`` (none when
    unset), interactions from ``multi_turn.interaction_config_path`` (none when unset), the
    ``multi_turn.format`` parser, and the turn/length limits."""
    from hybridflow.workers.rollout.interactions.registry import shared_interactions
    from hybridflow.workers.rollout.tools.parser import get_tool_call_parser
    from hybridflow.workers.rollout.tools.registry import load_tools

    if tokenizer is None:
        raise ValueError("multi-turn rollouts need the tokenizer (to render tool turns)")
    path = rollout_config.multi_turn.get("tool_config_path")
    tools = load_tools(path) if path else {}
    parser = get_tool_call_parser(str(rollout_config.multi_turn.get("format", "hermes")))
    limits = MultiTurnLimits.from_rollout_config(rollout_config)
    interactions = shared_interactions(rollout_config.multi_turn.get("interaction_config_path"))
    return ToolAgentLoop(engine, tokenizer, tools, parser, limits, end_of_turn_ids, interactions)


def interaction_columns(prompts) -> tuple[list[dict | None] | None, list | None]:
    """Each row's ``interaction_kwargs`` and chat (``raw_prompt``) from a rollout batch's columns (None
    where the batch has no such column)."""
    columns = prompts.non_tensor_batch
    kwargs, chats = columns.get("interaction_kwargs"), columns.get("raw_prompt")
    return (
        None if kwargs is None else [dict(k) if k else None for k in kwargs],
        None if chats is None else [list(c) if c is not None else None for c in chats],
    )


def assemble_conversations(
    prompts, conversations: list[Conversation], pad_id: int, response_length: int, with_log_probs: bool = True
):
    """The standard rollout output (:func:`~hybridflow.workers.rollout.base.assemble_output`) for
    finished conversations: ``response_mask`` (B, T_r) is 1 only on generated tokens, the response
    part of ``attention_mask`` on every token (tool turns too), ``rollout_log_probs`` 0 on tool tokens.
    Per-row ``__num_turns__``, ``tool_calls``, ``tool_failures`` and ``tool_rewards`` ride along as
    non-tensor columns, and ``turn_scores`` (a list per row: the interaction's score of each reply)."""
    import numpy as np
    import torch

    from hybridflow.workers.rollout.base import assemble_output

    rows = len(conversations)
    responses = torch.full((rows, response_length), pad_id, dtype=torch.long)
    response_mask = torch.zeros(rows, response_length, dtype=torch.long)
    present = torch.zeros(rows, response_length, dtype=torch.long)
    log_probs = torch.zeros(rows, response_length, dtype=torch.float32)
    for row, conv in enumerate(conversations):
        n = len(conv.response_ids)
        responses[row, :n] = torch.tensor(conv.response_ids, dtype=torch.long)
        response_mask[row, :n] = torch.tensor(conv.response_mask, dtype=torch.long)
        log_probs[row, :n] = torch.tensor(conv.log_probs, dtype=torch.float32)
        present[row, :n] = 1
    output = assemble_output(
        prompts,
        responses,
        [],
        pad_id,
        log_probs if with_log_probs else None,
        response_mask=response_mask,
        response_attention=present,
    )
    output.non_tensor_batch.update(
        {
            "__num_turns__": np.array(
                [c.assistant_turns + c.user_turns for c in conversations], dtype=np.int64
            ),
            "tool_calls": np.array([c.tool_calls for c in conversations], dtype=np.int64),
            "tool_failures": np.array([c.tool_failures for c in conversations], dtype=np.int64),
            "tool_rewards": np.array([c.tool_reward for c in conversations], dtype=np.float64),
        }
    )
    turn_scores = np.empty(rows, dtype=object)  # the interaction's scores, a list per row (verl's)
    turn_scores[:] = [list(c.turn_scores) for c in conversations]
    output.non_tensor_batch["turn_scores"] = turn_scores
    if any(c.routed_experts is not None for c in conversations):  # router replay R3
        from hybridflow import keys
        from hybridflow.workers.rollout.engine.routing import routed_experts_rows

        output.batch[keys.ROUTED_EXPERTS] = routed_experts_rows(
            prompts.batch[keys.ATTENTION_MASK], [c.routed_experts for c in conversations], response_length
        )
    return output
