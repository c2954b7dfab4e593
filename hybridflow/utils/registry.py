"""A small name -> function registry shared by every algorithm family.

Advantage estimators, policy losses, loss-aggregation modes and KL estimators each keep one
``Registry``. Entries are added with a decorator and looked up by name; the dispatchers only ever call
``registry.get(name)(...)`` and never special-case an entry, so adding an algorithm never edits a caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from enum import Enum
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)
_MISSING = object()


class RegistryError(KeyError, ValueError):
    """Unknown or conflicting name. Both a ``KeyError`` (lookup) and a ``ValueError`` (verl's choice)."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class Registry(MutableMapping, Generic[F]):
    """Maps names (and aliases) to functions of one kind with one shared signature.

    It is also a mutable mapping, as verl's registries are plain dicts: ``REGISTRY["name"]``,
    ``.clear()``, ``.update({...})``, ``del REGISTRY["name"]`` work. Item assignment replaces an entry
    deliberately; the decorator :meth:`register` is the checked path. Compared by identity.

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
        return register_in(self._entries, self.kind, name, *aliases)

    def get(self, name: str, default: Any = _MISSING) -> F:
        """The function registered under ``name``. Unknown: ``default`` when one is given, else
        ``RegistryError`` listing all names."""
        try:
            return self._entries[_key(name)]
        except (KeyError, TypeError):
            if default is not _MISSING:
                return default
            raise RegistryError(
                f"Unknown {self.kind} {name!r}. Registered: {', '.join(self.names())}"
            ) from None

    def __getitem__(self, name: str) -> F:
        return self.get(name)

    def __setitem__(self, name: str, fn: F) -> None:
        self._entries[_key(name)] = fn

    def __delitem__(self, name: str) -> None:
        del self._entries[_key(name)]

    def clear(self) -> None:
        self._entries.clear()

    __eq__ = object.__eq__
    __hash__ = object.__hash__

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


def register_in(entries: MutableMapping, kind: str, name, *aliases) -> Callable[[F], F]:
    """The registration rules, for a :class:`Registry`'s entries or any plain dict (verl's registries
    are dicts): Enum names register their ``.value``; the same function again is a no-op; a different
    function under a taken name raises :class:`RegistryError` before any name is bound."""
    names = tuple(_key(n) for n in (name, *aliases))

    def decorator(fn: F) -> F:
        for n in names:
            taken = entries.get(n, None)
            if taken is not None and taken is not fn:
                raise RegistryError(
                    f"{kind} {n!r} is already registered to {_qualname(taken)}; "
                    f"refusing to replace it with {_qualname(fn)}"
                )
        for n in names:
            entries[n] = fn
        return fn

    return decorator


def lookup_in(entries: Mapping, name, unknown: str) -> Any:
    """``entries[name]`` (an Enum stands for its value); ``RegistryError(unknown + registered names)``
    when missing. ``unknown`` is the caller's wording, e.g. verl's ``"Unknown reward manager: x"``."""
    key = _key(name)
    if key not in entries:
        raise RegistryError(f"{unknown}. Registered: {', '.join(sorted(map(str, entries)))}")
    return entries[key]


def _key(name):
    """Registry key of a name: an Enum member stands for its value."""
    return name.value if isinstance(name, Enum) else name


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
