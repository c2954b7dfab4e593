"""A small name -> function registry shared by every algorithm family.

Advantage estimators, policy losses, loss-aggregation modes and KL estimators each keep one
``Registry``. Entries are added with a decorator and looked up by name; the dispatchers only ever call
``registry.get(name)(...)`` and never special-case an entry, so adding an algorithm never edits a caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import Enum
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class RegistryError(KeyError, ValueError):
    """Unknown or conflicting name. Both a ``KeyError`` (lookup) and a ``ValueError`` (verl's choice)."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class Registry(Generic[F]):
    """Maps names (and aliases) to functions of one kind with one shared signature.

    Example::

        KL = Registry("KL estimator")

        @KL.register("k1", "kl")
        def k1(log_prob, ref_log_prob): ...

        KL.get("kl") is k1  # True
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` and every alias.

        Re-registering the same function under a name is a no-op; registering a *different* function
        under a taken name raises ``RegistryError``. All names are checked before any is bound. An
        ``Enum`` name (verl's ``AdvantageEstimator.GRPO``) registers its ``.value``.
        """
        names = tuple(_key(n) for n in (name, *aliases))

        def decorator(fn: F) -> F:
            for n in names:
                taken = self._entries.get(n)
                if taken is not None and taken is not fn:
                    raise RegistryError(
                        f"{self.kind} {n!r} is already registered to {_qualname(taken)}; "
                        f"refusing to replace it with {_qualname(fn)}"
                    )
            for n in names:
                self._entries[n] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered under ``name``; ``RegistryError`` listing all names if unknown."""
        try:
            return self._entries[_key(name)]
        except (KeyError, TypeError):
            raise RegistryError(
                f"Unknown {self.kind} {name!r}. Registered: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        """All registered names and aliases, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return _key(name) in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


def _key(name):
    """Registry key of a name: an Enum member stands for its value."""
    return name.value if isinstance(name, Enum) else name


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
