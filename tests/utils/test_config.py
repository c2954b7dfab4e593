"""hybridflow.utils.config: verl's BaseConfig (a frozen dataclass that reads like a dict) and
omega_conf_to_dataclass (a YAML section -> its dataclass)."""

from dataclasses import FrozenInstanceError, dataclass, field

import pytest
from omegaconf import OmegaConf

from hybridflow.errors import InvalidInputError
from hybridflow.utils.config import BaseConfig, omega_conf_to_dataclass


@dataclass
class Inner(BaseConfig):
    size: int = 1


@dataclass
class Outer(BaseConfig):
    _mutable_fields = frozenset({"note"})
    rate: float = 0.5
    note: str = ""
    inner: Inner = field(default_factory=Inner)


def test_reads_like_a_mapping_and_refuses_reassignment():
    cfg = Outer(rate=0.25)
    assert cfg.get("rate") == 0.25 and cfg["rate"] == 0.25 and cfg.get("absent", 7) == 7
    assert list(cfg) == ["_target_", "rate", "note", "inner"] and len(cfg) == 4 and "rate" in cfg
    cfg.note = "ok"  # listed in _mutable_fields
    with pytest.raises(FrozenInstanceError):
        cfg.rate = 1.0


def test_section_merged_over_the_class_defaults():
    cfg = omega_conf_to_dataclass(OmegaConf.create({"rate": 0.125, "inner": {"size": 3}}), Outer)
    assert isinstance(cfg, Outer) and isinstance(cfg.inner, Inner)
    assert (cfg.rate, cfg.note, cfg.inner.size) == (0.125, "", 3)
    assert omega_conf_to_dataclass({}, Outer) == Outer() and omega_conf_to_dataclass({}) is None
    built = Outer()
    assert omega_conf_to_dataclass(built) is built  # not a section: returned as is


def test_target_builds_nested_sections():
    section = {
        "_target_": f"{__name__}.Outer",
        "rate": 2.0,
        "inner": {"_target_": f"{__name__}.Inner", "size": 9},
    }
    cfg = omega_conf_to_dataclass(section)
    assert isinstance(cfg, Outer) and cfg.rate == 2.0 and isinstance(cfg.inner, Inner) and cfg.inner.size == 9


def test_refusals():
    with pytest.raises(InvalidInputError, match="_target_"):
        omega_conf_to_dataclass({"rate": 1.0})
    with pytest.raises(AssertionError, match="not a dataclass"):
        omega_conf_to_dataclass({"rate": 1.0}, dict)
