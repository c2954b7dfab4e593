"""An agent loop with a tool, written for verl and traced with verl's decorator, as its users write one:
verl's imports only. Through the verl alias it runs unchanged on hybridflow, and its calls land in the
rollout trace (``tests/trace/test_trace_e2e.py``)."""

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.rollout_trace import rollout_trace_op


class CheckTool:
    """A tool the loop calls once: it reads the model's first answer back."""

    @rollout_trace_op
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[str, float, dict]:
        return f"You said {parameters['answer']}. Check.", 0.0, {}


@register("traced_tool_agent")
class TracedToolAgentLoop(AgentLoopBase):
    """Answers (3 tokens), calls ``CheckTool`` with the answer, answers again after the tool's turn."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.response_length = self.config.actor_rollout_ref.rollout.response_length
        self.tool = CheckTool()

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        prompt_ids = await self.apply_chat_template(list(kwargs["raw_prompt"]))
        request_id = uuid4().hex
        first = await self.server_manager.generate(
            request_id=request_id, prompt_ids=prompt_ids, sampling_params={**sampling_params, "max_tokens": 3}
        )
        answer = self.tokenizer.decode(first.token_ids, skip_special_tokens=True)
        text, _, _ = await self.tool.execute(request_id, {"answer": answer})
        tool_ids = self.tokenizer.encode(text, add_special_tokens=False)
        budget = self.response_length - len(first.token_ids) - len(tool_ids)
        second = await self.server_manager.generate(
            request_id=request_id,
            prompt_ids=prompt_ids + first.token_ids + tool_ids,
            sampling_params={**sampling_params, "max_tokens": max(budget, 1)},
        )
        response_ids = first.token_ids + tool_ids + second.token_ids
        response_mask = [1] * len(first.token_ids) + [0] * len(tool_ids) + [1] * len(second.token_ids)
        log_probs = first.log_probs + [0.0] * len(tool_ids) + second.log_probs
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=log_probs[: self.response_length],
            num_turns=4,
            metrics={},
            extra_fields={"tool_calls": 1},
        )
