"""verl's ``AbstractRewardManager`` (``verl.workers.reward_manager.abstract`` through the alias): the
interface of a batch reward manager that verl's ``load_reward_manager`` builds, registered or loaded with
``reward_manager.source=importlib`` (:func:`~.custom.build_reward_manager`).

A manager is built as ``cls(tokenizer=..., num_examine=..., compute_score=..., reward_fn_key=...,
**reward_model.reward_kwargs)`` and called on a whole batch: ``manager(data, return_dict=False)`` gives
the token-level reward tensor ``(B, T_r)`` float32 (each score on the row's last valid response token), or
with ``return_dict=True`` ``{"reward_tensor": ..., "reward_extra_info": {key: list of B}}``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

RawRewardFn = Callable[..., Any]  # verl's name: compute_score(data_source, solution_str, ground_truth, ...)


class AbstractRewardManager(ABC):
    """verl's batch reward-manager interface (module docstring)."""

    @abstractmethod
    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: RawRewardFn | None = None,
        reward_fn_key: str = "data_source",
        **kwargs: Any,
    ) -> None:
        pass

    @abstractmethod
    def __call__(self, data, return_dict: bool = False):
        """The reward tensor ``(B, T_r)`` of ``data``, or the dict above with ``return_dict``."""
