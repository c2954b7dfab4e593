"""Name → reward-loop manager class (verl's ``verl.experimental.reward_loop.reward_manager.registry``).

The reward loop's managers score one sample at a time (``async run_single``) and have their own registry,
apart from the batch managers of :mod:`hybridflow.workers.reward_manager`: ``reward_model.reward_manager``
names one of these when ``reward_model.use_reward_loop`` is on.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.utils.registry import Registry, lookup_in

__all__ = ["REWARD_LOOP_MANAGERS", "get_reward_manager_cls", "register"]

REWARD_LOOP_MANAGERS: Registry[type] = Registry("reward-loop manager")


def register(name: str, *aliases: str) -> Callable[[type], type]:
    """Class decorator: ``@register("my_manager")`` makes ``reward_model.reward_manager=my_manager`` work."""
    return REWARD_LOOP_MANAGERS.register(name, *aliases)


def get_reward_manager_cls(name: str) -> type:
    """The class under ``name``; an unknown name lists the registered ones."""
    return lookup_in(REWARD_LOOP_MANAGERS, name, f"Unknown reward manager: {name}")
