"""Name → reward-manager class (verl's ``reward_model.reward_manager``)."""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.utils.registry import Registry, lookup_in

__all__ = [
    "REWARD_MANAGERS",
    "REWARD_MANAGER_REGISTRY",
    "get_reward_manager_cls",
    "register",
    "register_reward_manager",
]

REWARD_MANAGERS: Registry[type] = Registry("reward manager")
REWARD_MANAGER_REGISTRY = REWARD_MANAGERS  # verl's name; a Registry is also a dict-like mapping


def register_reward_manager(name: str, *aliases: str) -> Callable[[type], type]:
    """Class decorator: make the manager constructible by ``name`` (and ``aliases``)."""
    return REWARD_MANAGERS.register(name, *aliases)


register = register_reward_manager  # verl's name for the decorator: ``@register("my_manager")``


def get_reward_manager_cls(name: str) -> type:
    """The class registered under ``name`` (case-sensitive); an unknown name raises a ``ValueError``
    worded as verl's (``Unknown reward manager: <name>``) that lists the registered ones."""
    return lookup_in(REWARD_MANAGERS, name, f"Unknown reward manager: {name}")
