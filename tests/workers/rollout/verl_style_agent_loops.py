"""Agent loops for the failure tests (registered from a YAML through
``rollout.agent.agent_loop_config_path``); ``verl_written_agent_loop.py`` holds one written for verl."""

import os
import signal
from typing import Any
from uuid import uuid4

from hybridflow.workers.rollout.agent_loop import AgentLoopBase, AgentLoopOutput, SingleTurnAgentLoop


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


class SlowSingleTurnAgentLoop(SingleTurnAgentLoop):
    """The built-in single turn, but every ``every``-th prompt (by dataset index; every third by default)
    waits ``delay_s`` first: a long tail of slow samples."""

    def __init__(self, *args, delay_s: float = 0.3, every: int = 3, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay_s, self.every = delay_s, int(every)

    async def run(self, sampling_params, **kwargs):
        import asyncio

        if int(kwargs["index"]) % self.every == 0:
            await asyncio.sleep(self.delay_s)
        return await super().run(sampling_params, **kwargs)
