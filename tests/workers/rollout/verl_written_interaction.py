"""An interaction written for verl, as its users write one: verl's imports and signatures, state kept per
instance id, verl's base-class ``finalize_interaction(self)``. It runs unchanged on hybridflow through the
verl alias (``tests/workers/rollout/test_interactions.py``)."""

from typing import Any

from verl.interactions.base import BaseInteraction


class CountdownInteraction(BaseInteraction):
    """Replies "Reply k." to the k-th answer with turn score k, and ends the conversation after the
    sample's ``interaction_kwargs["turns"]`` replies (default: ``config["turns"]``)."""

    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict: dict[str, dict[str, Any]] = {}
        self.finalized = 0

    async def start_interaction(self, instance_id=None, turns=None, **kwargs) -> str:
        self._instance_dict[instance_id] = {"replies": 0, "turns": int(turns or self.config["turns"])}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs) -> tuple[bool, str, float, dict]:
        assert messages[-1]["role"] == "assistant"  # the model's answer is the last message
        state = self._instance_dict[instance_id]
        state["replies"] += 1
        done = state["replies"] >= state["turns"]
        return done, f"Reply {state['replies']}.", float(state["replies"]), {}

    async def finalize_interaction(self) -> None:
        self.finalized += 1
