"""The config trees' shared facts, read by validation and by the command-line mistake check
(:mod:`.mistakes`) alike: where the YAML files are, which sections are free-form, and which keys of a
config a schema does not have."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONFIG_DIR = Path(__file__).parent  # the YAML files live beside this module

# Sections whose content is free-form (passed through to a model config, an engine, a manager).
FREE_FORM_KEYS = frozenset(
    {
        "override_config",
        "engine_kwargs",
        "reward_kwargs",
        "mixed_precision",
        "wrap_policy",
        "custom_cls",
        "resource_pool_spec",
        "role_pool_mapping",
        "controller_nsight_options",  # nsys options (global_profiler.global_tool_config.nsys)
        "worker_nsight_options",
    }
)


def unknown_keys(config: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    """Dotted paths present in ``config`` but not in ``schema`` (free-form sections excepted)."""
    found = []
    for key in config.keys():
        path = f"{prefix}{key}"
        if key not in schema:
            found.append(path)
        elif (
            key not in FREE_FORM_KEYS
            and isinstance(config[key], DictConfig)
            and isinstance(schema[key], DictConfig)
        ):
            found.extend(unknown_keys(config[key], schema[key], f"{path}."))
    return found
