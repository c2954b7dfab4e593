"""verl's ``Gsm8kInteraction``: a user who checks a GSM8K answer and asks for another try when it is wrong.

The answer is the model's last assistant message, scored with the GSM8K rule
(:func:`hybridflow.utils.reward_score.gsm8k.compute_score`, ``method="strict"``: the number after the
last ``#### ``) against ``ground_truth`` from the sample's ``interaction_kwargs``. Right (score 1.0):
"correct" and the conversation ends. Wrong or missing (0.0): "incorrect, try again" and it goes on,
until the model gets it or a turn/length limit ends it. Each reply's score is a turn score.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from hybridflow.utils.reward_score import gsm8k
from hybridflow.workers.rollout.interactions.base import BaseInteraction

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    """Per-sample state in ``_instance_dict[instance_id]``: ``{"response": last answer text,
    "ground_truth": str, "reward": its score}``."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs
    ) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        answer = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        state = self._instance_dict[instance_id]
        state["response"] = answer or ""
        state["reward"] = reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, CORRECT, reward, {}
        return False, INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(
            state["response"], state["ground_truth"], method="strict", format_score=0.0, score=1.0
        )

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
