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


def type_mismatches(
    config: DictConfig, schema: DictConfig, prefix: str = ""
) -> list[tuple[str, object, str]]:
    """``(path, value, "true or false" | "a number")`` for each key whose schema default is a boolean
    (a number) and whose value in ``config`` is not one: ``enable_gradient_checkpointing=maybe`` or
    ``calculate_log_probs=yes`` are strings, true for Python, whatever was meant. Null is left to the
    key's own check; interpolated defaults and free-form sections are skipped."""
    from omegaconf import OmegaConf

    found = []
    for key in config.keys():
        if key not in schema or key in FREE_FORM_KEYS or OmegaConf.is_interpolation(schema, key):
            continue
        path, default = f"{prefix}{key}", schema[key]
        try:
            value = config[key]
        except Exception:  # an interpolation that does not resolve: the composition says so
            continue
        if isinstance(default, DictConfig) and isinstance(value, DictConfig):
            found.extend(type_mismatches(value, default, f"{path}."))
        elif value is None or isinstance(default, DictConfig):
            continue
        elif isinstance(default, bool) and not isinstance(value, bool):
            found.append((path, value, "true or false"))
        elif isinstance(default, int | float) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, int | float):
                found.append((path, value, "a number"))
    return found
