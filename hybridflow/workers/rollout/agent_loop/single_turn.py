"""``single_turn_agent``: one generation per sample (verl's ``SingleTurnAgentLoop``), resumable.

The prompt is the dataset's ``raw_prompt_ids`` (the chat template already applied exactly as the
synchronous rollout sees it), else ``raw_prompt`` through the chat template. A sample aborted mid-flight
(partial rollout) returns what it generated with ``extra_fields["is_partial"] = True``; run again with
``partial_output=<that output>`` it continues from prompt + partial response, drawing from the position
of its sampling stream where it stopped, so its tokens, masks and log-probs lay out exactly like an
uninterrupted sample's (on ``rollout.name=engine``; vLLM reseeds the continuation from its position:
see :mod:`hybridflow.workers.rollout.vllm_rollout.engine`). Log-probs: one per generated token when the
request asks for them (``logprobs``, from ``rollout.calculate_log_probs``), else none; a server answer
without them is an error naming the sample and the backend (:func:`turn_log_probs`).

Router replay R3 (``rollout.enable_rollout_routing_replay``): the server's answer carries the request's
``routed_experts`` (prompt + generated tokens); the output keeps the last request's. A resumed sample's
request is prompt + partial response, which the engine prefills again (no prefix cache while it
records): its record covers the whole sample, the earlier tokens' routing recomputed under the weights
the continuation attended with — ids aligned with the tokens, never stitched from two records.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from hybridflow.utils.rollout_trace import rollout_trace_op
from hybridflow.workers.rollout.agent_loop.base import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)
from hybridflow.workers.rollout.replica import TokenOutput


async def prompt_ids_of(loop: AgentLoopBase, kwargs: dict) -> list[int]:
    """The sample's prompt ids: ``raw_prompt_ids`` when the dataset gave them, else its messages
    through the chat template."""
    if kwargs.get("raw_prompt_ids") is not None:
        return [int(t) for t in kwargs["raw_prompt_ids"]]
    if kwargs.get("raw_prompt") is None:
        raise ValueError("the sample has neither raw_prompt_ids nor raw_prompt (messages)")
    return await loop.apply_chat_template(list(kwargs["raw_prompt"]))


def sample_images(kwargs: dict) -> dict:
    """``{"image_data": the sample's multi_modal_inputs}`` for a vision-language sample with images
    (the server call's keyword; the dataset's ``pixel_values`` and ``image_grid_thw``), else ``{}``."""
    inputs = kwargs.get("multi_modal_inputs")
    return {"image_data": dict(inputs)} if inputs else {}


def backend_name(loop: AgentLoopBase) -> str:
    """How errors name the generation backend: ``rollout.name=engine`` or ``rollout.name=vllm``."""
    return rollout_backend_name(loop.config.actor_rollout_ref.rollout)


def rollout_backend_name(rollout_config) -> str:
    """:func:`backend_name` from the ``rollout`` section itself."""
    return f"rollout.name={rollout_config.get('name', 'engine')}"


def turn_log_probs(output, wanted: bool, sample: str, backend: str) -> list[float] | None:
    """The log-probs of one server answer's tokens: None when they were not asked for
    (``rollout.calculate_log_probs=false``); asked for, exactly one per token, else a ValueError naming
    the sample and the backend. A missing log-prob is never filled in: a 0 would become pi_old = 1."""
    if not wanted:
        return None
    log_probs = output.log_probs
    if len(output.token_ids) and (log_probs is None or len(log_probs) != len(output.token_ids)):
        got = "no" if log_probs is None else str(len(log_probs))
        raise ValueError(
            f"sample {sample}: the {backend} server returned {len(output.token_ids)} tokens with {got} "
            "log-probs; rollout.calculate_log_probs=true needs one per token (the rollout's log-probs "
            "are pi_old or the importance-weight denominator)"
        )
    return [float(x) for x in log_probs or []]


def version_span(extra_fields: dict, version: int | None, tokens: int) -> None:
    """Record that ``tokens`` response tokens came from weights ``version`` (``weight_versions``:
    ``[[version, tokens], ...]`` in order)."""
    if version is None or tokens == 0:
        return
    spans = extra_fields.setdefault("weight_versions", [])
    if spans and spans[-1][0] == version:
        spans[-1][1] += tokens
    else:
        spans.append([int(version), int(tokens)])


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One chat completion per sample."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.response_length = int(self.config.actor_rollout_ref.rollout.response_length)

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        partial: AgentLoopOutput | None = kwargs.get("partial_output")
        if partial is not None:
            prompt_ids = list(partial.prompt_ids)
            response, log_probs = list(partial.response_ids), list(partial.response_logprobs or [])
            extra = dict(partial.extra_fields)
            preempted = max(partial.metrics.num_preempted, 0)
            spent = partial.metrics.generate_sequences
        else:
            prompt_ids = await prompt_ids_of(self, kwargs)
            response, log_probs, extra, preempted, spent = [], [], {}, 0, 0.0
        previous_routing = partial.routed_experts if partial is not None else None
        request_id = str(kwargs.get("sample_id") or uuid.uuid4().hex)
        params = dict(sampling_params)
        wanted = bool(params.get("logprobs", True))
        params["max_tokens"] = self.response_length - len(response)
        if params.get("seed") is not None:
            params["seed_position"] = len(response)  # continue the sample's own sampling stream
        start = time.perf_counter()
        if params["max_tokens"] <= 0:  # resumed with its budget spent (cut at its last token): done
            output = TokenOutput(token_ids=[], log_probs=[] if wanted else None, stop_reason="length")
        else:
            output = await self.server_manager.generate(
                request_id, prompt_ids=prompt_ids + response, sampling_params=params, **sample_images(kwargs)
            )
        spent += time.perf_counter() - start
        turn = turn_log_probs(output, wanted, request_id, backend_name(self))
        # router replay R3: this request's record covers prompt + response so far + its tokens (a resumed
        # sample's earlier tokens recomputed in its prefill); a call that generated nothing keeps the last
        routed = getattr(output, "routed_experts", None)
        routed = routed if routed is not None else previous_routing
        response += output.token_ids
        log_probs += turn or []
        version_span(extra, output.weight_version, len(output.token_ids))
        aborted = output.stop_reason == "aborted"
        extra["is_partial"] = aborted
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response[: self.response_length],
            response_mask=[1] * min(len(response), self.response_length),
            response_logprobs=log_probs[: self.response_length] if wanted else None,
            routed_experts=routed,
            num_turns=2,
            metrics=AgentLoopMetrics(generate_sequences=spent, num_preempted=preempted + int(aborted)),
            extra_fields=extra,
        )
