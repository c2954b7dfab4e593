"""Agent loops written the way verl's users write them (``AgentLoopBase.run`` talking to the servers
by token ids), registered from a YAML through ``rollout.agent.agent_loop_config_path`` in the tests."""

import os
import signal
from typing import Any
from uuid import uuid4

from hybridflow.workers.rollout.agent_loop import AgentLoopBase, AgentLoopOutput, register


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


class FailingAgentLoop(AgentLoopBase):
    """Raises for the sample whose dataset index is ``fail_index``."""

    def __init__(self, *args, fail_index: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_index = fail_index

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        if int(kwargs["index"]) == self.fail_index:
            raise RuntimeError("the environment is unreachable")
        out = await self.server_manager.generate(
            uuid4().hex, prompt_ids=list(kwargs["raw_prompt_ids"]), sampling_params=sampling_params
        )
        return AgentLoopOutput(
            prompt_ids=list(kwargs["raw_prompt_ids"]),
            response_ids=out.token_ids,
            response_mask=[1] * len(out.token_ids),
            response_logprobs=out.log_probs,
            num_turns=2,
            metrics={},
        )


class KillingAgentLoop(AgentLoopBase):
    """Kills the worker process whose pid is in ``pid_file`` (a rank serving requests), then asks."""

    def __init__(self, *args, pid_file: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.pid_file = pid_file

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        if os.path.exists(self.pid_file):
            with open(self.pid_file) as f:
                pid = int(f.read())
            os.remove(self.pid_file)
            os.kill(pid, signal.SIGKILL)
        out = await self.server_manager.generate(
            uuid4().hex,
            prompt_ids=list(kwargs["raw_prompt_ids"]),
            sampling_params={**sampling_params, "max_tokens": 64, "ignore_eos": True},
        )
        return AgentLoopOutput(
            prompt_ids=list(kwargs["raw_prompt_ids"]),
            response_ids=out.token_ids,
            response_mask=[1] * len(out.token_ids),
            response_logprobs=out.log_probs,
            num_turns=2,
            metrics={},
        )
