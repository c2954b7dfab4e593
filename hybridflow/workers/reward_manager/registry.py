"""Name → reward-manager class (verl's ``reward_model.reward_manager``)."""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.utils.registry import Registry

REWARD_MANAGERS: Registry[type] = Registry("reward manager")


def register_reward_manager(name: str, *aliases: str) -> Callable[[type], type]:
    """Class decorator: make the manager constructible by ``name`` (and ``aliases``)."""
    return REWARD_MANAGERS.register(name, *aliases)


def get_reward_manager_cls(name: str) -> type:
    """The class registered under ``name``; an unknown name raises an error listing the registered ones."""
    return REWARD_MANAGERS.get(name)
