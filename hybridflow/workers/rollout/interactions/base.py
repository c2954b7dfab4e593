"""verl's ``BaseInteraction``: one kind of simulated user, answering the model after its turns.

A multi-turn conversation with an interaction runs: the model answers; when that answer calls no tool,
the conversation's interaction gets the messages so far (``generate_response``) and returns
``(should_terminate_sequence, response_content, current_turn_score, additional_data)``; the content
becomes the next user message (its tokens masked out of training) and, unless told to stop, the model
answers again. One instance per configured name serves every sample of a process: per-sample state is
kept under the ``instance_id`` that ``start_interaction`` returns (the sample's request id), as
:class:`~.gsm8k_interaction.Gsm8kInteraction` keeps it.
"""

from __future__ import annotations

import inspect
from typing import Any
from uuid import uuid4


class BaseInteraction:
    """The interface (verl's signatures); the defaults answer "acceptable" with score 0.8 and never stop,
    as verl's do. ``config``: the entry's ``config`` mapping from the YAML, with its ``name`` added."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        """Open one sample's session; ``kwargs``: the sample's ``interaction_kwargs`` (dataset
        ``extra_info``). Returns its instance id (``instance_id``, or a new one when None)."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's reply to ``messages`` (the chat so far, the model's last answer at the end):
        ``(should_terminate_sequence, response_content, current_turn_score, additional_data)``."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        """A score for the session so far (the loops do not call it; interactions use it themselves)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        """Close one sample's session and drop its state."""


async def finalize(interaction: BaseInteraction, instance_id: str) -> None:
    """``interaction.finalize_interaction(instance_id)``; without the id when the method takes no
    argument (verl's base class declares ``finalize_interaction(self)``, and subclasses may copy it)."""
    method = interaction.finalize_interaction
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: give it the id
        params = None
    takes_id = params is None or any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )
    await (method(instance_id) if takes_id else method())
