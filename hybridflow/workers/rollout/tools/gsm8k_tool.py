"""``calc_gsm8k_reward``: lets the model check its GSM8K answer mid-rollout (verl's ``Gsm8kTool``).

Each rollout sample creates an instance holding its ground truth. Every call submits an answer, which
is scored with the project's GSM8K scorer (``hybridflow.utils.reward_score.gsm8k``) and echoed back
as ``"Current parsed answer='72' reward=1.0"``. The step reward follows verl: ``0.0`` when the call
beats the instance's best reward so far, otherwise a ``-0.05`` penalty (so spamming the checker with
non-improving answers costs reward). :meth:`Gsm8kTool.calc_reward` re-scores the latest answer.
"""

from __future__ import annotations

from typing import Any

from hybridflow.utils.reward_score.gsm8k import compute_score
from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema

ANSWER_PREFIX = "#### "
NON_IMPROVING_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    """Config keys (all optional): ``score_method`` (``"flexible"`` as in verl, or ``"strict"``)."""

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema) -> None:
        super().__init__(config, tool_schema)
        self.score_method = str(self.config.get("score_method", "flexible"))
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs) -> str:
        """Start an instance for one sample; ``ground_truth`` is the GSM8K final answer (e.g. ``"72"``)."""
        instance_id = await super().create(instance_id)
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[str, float, dict]:
        """Score ``parameters["answer"]``; returns ``(message, step_reward, metrics)``, never raises
        (metrics is ``{}``, or ``{"error": reason}`` for a call that could not be scored)."""
        state = self._instances.get(instance_id)
        if state is None:
            message = f"Error: unknown instance id {instance_id!r} for tool {self.name!r}."
            return message, 0.0, {"error": "unknown instance"}
        if not isinstance(parameters, dict) or "answer" not in parameters:
            message = f"Error: tool {self.name!r} requires the argument 'answer'."
            return message, 0.0, {"error": "bad arguments"}
        answer = parameters["answer"]
        if not isinstance(answer, str):
            answer = str(answer)
        state["response"] = answer if answer.startswith(ANSWER_PREFIX) else ANSWER_PREFIX + answer
        reward = self._score(state)
        step_reward = 0.0 if reward > state["reward"] else NON_IMPROVING_PENALTY
        state["reward"] = max(state["reward"], reward)
        return f"Current parsed {answer=} {reward=}", step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The scorer's reward for the instance's latest answer (0.0 for an unknown instance)."""
        state = self._instances.get(instance_id)
        return 0.0 if state is None else self._score(state)

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)

    def _score(self, state: dict[str, Any]) -> float:
        if state["ground_truth"] is None:
            return 0.0
        return compute_score(
            state["response"],
            state["ground_truth"],
            method=self.score_method,
            format_score=0.0,
            score=1.0,
        )
