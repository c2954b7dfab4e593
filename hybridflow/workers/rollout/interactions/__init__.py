"""verl's interactions (``verl/interactions``): a simulated user who answers the model between its turns.

- :mod:`.base` — ``BaseInteraction``, the interface (start, respond, score, finalize);
- :mod:`.gsm8k_interaction` — ``Gsm8kInteraction``: says whether the GSM8K answer is right and lets the
  model try again when it is not;
- :mod:`.registry` — the YAML of ``rollout.multi_turn.interaction_config_path`` (verl's
  ``initialize_interactions_from_config``).

The multi-turn machine (:mod:`hybridflow.workers.rollout.multi_turn`, which the ``tool_agent`` loop runs
too) hands the user's reply to the model as a user turn whose tokens have mask 0.
"""

from hybridflow.workers.rollout.interactions.base import BaseInteraction

__all__ = ["BaseInteraction"]
