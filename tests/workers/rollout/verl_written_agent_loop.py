"""An agent loop written for verl, as its users write one: verl's imports, ``@register``, ``run`` talking
to the servers by token ids. It runs unchanged on hybridflow through the verl alias
(``HYBRIDFLOW_VERL_ALIAS=1``; ``tests/trainer/ppo/test_agent_loop_e2e.py``)."""

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register


@register("two_turn_agent")
class TwoTurnAgentLoop(AgentLoopBase):
    """Answers, hears "Check." from the user, answers again: two generations, one user turn between."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.response_length = self.config.actor_rollout_ref.rollout.response_length

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.apply_chat_template(messages)
        request_id = uuid4().hex
        first = await self.server_manager.generate(
            request_id=request_id, prompt_ids=prompt_ids, sampling_params={**sampling_params, "max_tokens": 3}
        )
        user_ids = self.tokenizer.encode("Check.", add_special_tokens=False)
        budget = self.response_length - len(first.token_ids) - len(user_ids)
        second = await self.server_manager.generate(
            request_id=request_id,
            prompt_ids=prompt_ids + first.token_ids + user_ids,
            sampling_params={**sampling_params, "max_tokens": max(budget, 1)},
        )
        response_ids = first.token_ids + user_ids + second.token_ids
        response_mask = [1] * len(first.token_ids) + [0] * len(user_ids) + [1] * len(second.token_ids)
        log_probs = first.log_probs + [0.0] * len(user_ids) + second.log_probs
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=log_probs[: self.response_length],
            num_turns=4,
            metrics={},
            extra_fields={"tool_calls": 0},
        )
