"""Typed config sections: dataclasses that read like the YAML they come from (verl's ``BaseConfig``
and ``omega_conf_to_dataclass``).

A section of the composed YAML (a ``DictConfig``) becomes a dataclass either by its ``_target_`` key
(``_target_: hybridflow.trainer.config.AlgoConfig``, built with Hydra's ``instantiate``) or by naming
the class: ``omega_conf_to_dataclass(cfg.algorithm, AlgoConfig)`` merges the section over the class
defaults. The dataclass keeps the dict-style reads existing callers use (``cfg.get("gamma", 1.0)``,
``cfg["gamma"]``, iteration over field names) and refuses re-assignment after construction, so one
object stays one source of truth; a class lists its exceptions in ``_mutable_fields``.
"""

from __future__ import annotations

import collections.abc
from dataclasses import FrozenInstanceError, dataclass, fields, is_dataclass
from typing import Any, ClassVar

from hybridflow.errors import InvalidInputError

__all__ = ["BaseConfig", "omega_conf_to_dataclass"]


@dataclass
class BaseConfig(collections.abc.Mapping):
    """A dataclass config that also reads like a mapping of its fields.

    ``_target_`` holds the class path when the section names one (Hydra's convention), so a YAML
    section with ``_target_`` merges into the dataclass without an unknown-key error.
    """

    _mutable_fields: ClassVar[frozenset[str]] = frozenset()
    _target_: str = ""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ and name not in self._mutable_fields:
            raise FrozenInstanceError(f"{type(self).__name__}.{name} is frozen; build a new config instead")
        super().__setattr__(name, value)

    def _set_once(self, name: str, value: Any) -> None:
        """For ``__post_init__``: normalise a field's value once, before anyone reads it."""
        object.__setattr__(self, name, value)

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key``, or ``default`` when the config has no such field."""
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def __iter__(self):
        return (f.name for f in fields(self))

    def __len__(self) -> int:
        return len(fields(self))


def omega_conf_to_dataclass(config: Any, dataclass_type: type | None = None) -> Any:
    """A config section (``DictConfig`` or dict) as a dataclass instance.

    - ``dataclass_type`` given: the section is merged over the class defaults (``{"gamma": 0.8}``
      gives an ``AlgoConfig`` with ``gamma=0.8`` and every other field at its default); an empty
      section gives ``dataclass_type()``;
    - no ``dataclass_type``: the section must name its class in ``_target_``; it is built with Hydra's
      ``instantiate`` (nested sections with their own ``_target_`` too, the rest as plain dicts);
      an empty section gives None.

    Anything that is not a dict-like section (an already built dataclass, say) is returned as is.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if not config:
        return None if dataclass_type is None else dataclass_type()
    if not isinstance(config, DictConfig | ListConfig | dict | list):
        return config
    if dataclass_type is None:
        if "_target_" not in config:
            raise InvalidInputError(
                "omega_conf_to_dataclass: pass dataclass_type, or give the section a _target_ "
                f"(e.g. _target_: hybridflow.trainer.config.AlgoConfig); got keys {sorted(config.keys())}"
            )
        from hydra.utils import instantiate

        return instantiate(config, _convert_="partial")
    if not is_dataclass(dataclass_type):
        raise InvalidInputError(f"omega_conf_to_dataclass: {dataclass_type} is not a dataclass")
    merged = OmegaConf.merge(OmegaConf.structured(dataclass_type), OmegaConf.create(config))
    return OmegaConf.to_object(merged)
