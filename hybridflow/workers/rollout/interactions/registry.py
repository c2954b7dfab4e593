"""The interactions of ``rollout.multi_turn.interaction_config_path`` (verl's ``interaction_registry``).

The file is verl's format, loaded unchanged::

    interaction:
      - name: gsm8k                                    # optional: else from the class name
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

An entry without ``name`` is named after its class, lower-cased, with an ``Interaction`` suffix dropped
(``Gsm8kInteraction`` -> ``gsm8k``); names must be unique. Each class is built as ``cls(config)`` with
``config["name"]`` set. verl's own class paths for the interactions this project has resolve here
without the ``verl`` alias (:data:`VERL_CLASS_ALIASES`); a class written against verl
(``from verl.interactions.base import BaseInteraction``) imports through the alias. A sample picks its
interaction with ``extra_info["interaction_kwargs"]["name"]``.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from hybridflow.workers.rollout.interactions.base import BaseInteraction

_HERE = "hybridflow.workers.rollout.interactions"
# verl class path -> ours. Resolved (imported) only when a config names it.
VERL_CLASS_ALIASES: dict[str, str] = {
    "verl.interactions.base.BaseInteraction": f"{_HERE}.base.BaseInteraction",
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": f"{_HERE}.gsm8k_interaction.Gsm8kInteraction",
}
REQUIRED_METHODS = ("start_interaction", "generate_response", "finalize_interaction")


class InteractionConfigError(ValueError):
    """An interaction YAML that cannot be loaded; the message names the file and the entry."""


@dataclass(frozen=True)
class InteractionSpec:
    """One checked entry: its unique ``name``, the ``class_name`` as written, the class, its config."""

    name: str
    class_name: str
    cls: type
    config: dict[str, Any]


def get_interaction_class(cls_name: str) -> type:
    """The class at dotted path ``cls_name`` (verl's name; verl's paths of our interactions accepted).
    Raises :class:`InteractionConfigError` saying why it cannot be used."""
    if not isinstance(cls_name, str) or "." not in cls_name.strip():
        raise InteractionConfigError(
            f"class_name must be a dotted path 'package.module.Class', got {cls_name!r}"
        )
    target = VERL_CLASS_ALIASES.get(cls_name.strip(), cls_name.strip())
    if target.startswith("verl.interactions."):
        raise InteractionConfigError(
            f"class_name {cls_name!r} is a verl interaction with no counterpart here; "
            f"supported: {', '.join(sorted(VERL_CLASS_ALIASES))}"
        )
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        hint = (
            " (a verl module: is the verl alias on? HYBRIDFLOW_VERL_ALIAS=1)"
            if target.startswith("verl.")
            else ""
        )
        raise InteractionConfigError(
            f"cannot import {module_name!r} for class_name {cls_name!r}: {error}{hint}"
        ) from error
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise InteractionConfigError(f"class_name {cls_name!r}: module {module_name!r} has no class {attr!r}")
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise InteractionConfigError(
            f"class_name {cls_name!r} is no interaction: it lacks {', '.join(missing)}"
        )
    return cls


def default_name(cls_name: str) -> str:
    """verl's name for an entry without one: the class name lower-cased, ``Interaction`` dropped."""
    simple = cls_name.rsplit(".", 1)[-1]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def interaction_specs(path: str) -> list[InteractionSpec]:
    """Every entry of the YAML at ``path``, checked (file, format, classes importable, unique names)
    without building any; :class:`InteractionConfigError` names the file and entry of the first problem."""
    entries = _read_entries(path)
    specs: list[InteractionSpec] = []
    for index, entry in enumerate(entries):
        where = f"{path}: interaction[{index}]"
        if not isinstance(entry, dict) or not entry.get("class_name"):
            raise InteractionConfigError(
                f"{where}: each entry needs a class_name (and optionally name, config)"
            )
        try:
            cls = get_interaction_class(entry["class_name"])
        except InteractionConfigError as error:
            raise InteractionConfigError(f"{where}: {error}") from error.__cause__
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise InteractionConfigError(f"{where}: config must be a mapping, got {type(config).__name__}")
        name = str(entry.get("name") or default_name(entry["class_name"]))
        if any(spec.name == name for spec in specs):
            raise InteractionConfigError(
                f"{where}: duplicate interaction name {name!r}; each interaction needs a unique name"
            )
        specs.append(InteractionSpec(name, str(entry["class_name"]), cls, {**config, "name": name}))
    return specs


def initialize_interactions_from_config(interaction_config_file: str) -> dict[str, BaseInteraction]:
    """verl's loader: ``{name: instance}`` of every entry of the YAML, each built as ``cls(config)``."""
    interactions = {}
    for spec in interaction_specs(interaction_config_file):
        try:
            interactions[spec.name] = spec.cls(config=dict(spec.config))
        except Exception as error:
            raise InteractionConfigError(
                f"{interaction_config_file}: interaction {spec.name!r}: {spec.class_name}(config) raised "
                f"{type(error).__name__}: {error}"
            ) from error
    return interactions


@functools.lru_cache(maxsize=8)
def shared_interactions(path: str | None) -> dict[str, BaseInteraction]:
    """The interactions of the YAML at ``path``, built once per process and shared by its samples
    (each sample's state lives under its own instance id); ``{}`` when ``path`` is unset."""
    return initialize_interactions_from_config(str(path)) if path else {}


def _read_entries(path: str) -> list[Any]:
    """The ``interaction`` list of the YAML at ``path``, as plain containers."""
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise InteractionConfigError(f"interaction config file not found: {path!r}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as error:  # YAML errors, interpolation errors, a top-level list, ...
        raise InteractionConfigError(f"{path}: cannot read the interaction config: {error}") from error
    if not isinstance(data, dict) or not isinstance(data.get("interaction"), list):
        raise InteractionConfigError(f"{path}: expected a top-level 'interaction:' list of entries")
    return data["interaction"]
