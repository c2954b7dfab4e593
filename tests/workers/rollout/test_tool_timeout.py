"""multi_turn.tool_timeout_s: a tool call that hangs becomes an error turn (a failed call) instead of
stalling the rollout; a hanging calc_reward is an error naming the tool."""

import asyncio
import time

import pytest

from hybridflow.workers.rollout.engine import SamplingParams
from hybridflow.workers.rollout.multi_turn import MultiTurnLimits
from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema
from tests.workers.rollout.test_multi_turn import AddTool, Script, _call, _loop, _prompt


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.workers.rollout.engine import EngineModel

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return load_tokenizer(tiny_model_dir), EngineModel.from_hf_module(model, 1024)


class HangingTool(BaseTool):
    """Awaits forever (a network call that never answers); records that it was cancelled."""

    def __init__(self):
        super().__init__({}, ToolSchema("hang"))
        self.cancelled = False

    async def execute(self, instance_id, parameters, **kwargs):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "never", 0.0, {}


class OwnTimeoutTool(BaseTool):
    """Raises its own TimeoutError at once: reported as the tool's failure, not as the loop's limit."""

    def __init__(self):
        super().__init__({}, ToolSchema("flaky"))

    async def execute(self, instance_id, parameters, **kwargs):
        raise TimeoutError("upstream took too long")


class HangingRewardTool(AddTool):
    async def calc_reward(self, instance_id, **kwargs):
        await asyncio.sleep(3600)


def test_a_hanging_tool_call_becomes_an_error_turn(setup):
    hang = HangingTool()
    tokenizer, loop = _loop(
        setup, [hang, OwnTimeoutTool(), AddTool()], tool_timeout_s=0.5, response_length=600
    )
    turns = [
        '<tool_call>{"name": "hang", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "flaky", "arguments": {}}</tool_call>',
        _call(2, 3),
        "The answer is 5",
    ]
    start = time.monotonic()
    conv = asyncio.run(
        loop.run(_prompt(tokenizer), SamplingParams(logits_processor=Script(tokenizer, turns)))
    )
    assert time.monotonic() - start < 20
    tool_turns = tokenizer.decode([t for t, m in zip(conv.response_ids, conv.response_mask) if m == 0])
    assert "tool 'hang' did not finish within 0.5s and was stopped" in tool_turns
    assert "tool 'flaky' failed: TimeoutError: upstream took too long" in tool_turns
    assert hang.cancelled
    assert (conv.tool_calls, conv.tool_failures, conv.finish_reason) == (3, 2, "stop")


def test_a_hanging_calc_reward_is_an_error_naming_the_tool(setup):
    tokenizer, loop = _loop(setup, [HangingRewardTool()], tool_timeout_s=0.5)
    script = Script(tokenizer, [_call(2, 3), "The answer is 5"])
    with pytest.raises(TimeoutError, match=r"tool 'add': calc_reward .*tool_timeout_s=0.5s"):
        asyncio.run(loop.run(_prompt(tokenizer), SamplingParams(logits_processor=script)))


def test_the_limit_comes_from_the_rollout_config():
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {"response_length": 8, "multi_turn": {"tool_timeout_s": 7}},
    )
    assert MultiTurnLimits.from_rollout_config(config).tool_timeout_s == 7
    config.multi_turn.tool_timeout_s = None
    assert MultiTurnLimits.from_rollout_config(config).tool_timeout_s is None
