"""Load tokenizers and model configs from local Hugging Face directories (never from a hub).

hybridflow runs offline: every ``path`` must be a directory on disk, e.g. one written by
``python -m hybridflow.models.tiny --out DIR``. A hub name fails fast with an error saying so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _local_dir(path: str | Path, what: str) -> Path:
    local = Path(path).expanduser()
    if not local.is_dir():
        raise FileNotFoundError(
            f"{what}: {str(path)!r} is not a local directory. hybridflow has no model-hub access; "
            "pass a directory holding the files (build a tiny one with "
            "`python -m hybridflow.models.tiny --out DIR`)."
        )
    return local


def load_tokenizer(
    path: str | Path, trust_remote_code: bool = False, custom_chat_template: str | None = None
):
    """``AutoTokenizer`` from a local directory; pad falls back to eos (with a warning) when missing.

    ``custom_chat_template`` (a Jinja string) replaces the directory's chat template, as verl's
    ``model.custom_chat_template`` does.
    """
    from transformers import AutoTokenizer

    local = _local_dir(path, "load_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(
        local, trust_remote_code=trust_remote_code, local_files_only=True
    )
    if custom_chat_template is not None:
        tokenizer.chat_template = custom_chat_template
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {local} has neither a pad token nor an eos token")
        logger.warning("tokenizer at %s has no pad token; using eos %r as pad", local, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_config(path: str | Path, override_config: dict | None = None, trust_remote_code: bool = False):
    """``AutoConfig`` from a local directory with ``override_config`` applied (verl's ``override_config``).

    Nested dicts update sub-configs / dict attributes (e.g. ``{"rope_parameters": {"rope_theta": 1e4}}``).
    An override naming an attribute the config does not have raises ``ValueError``.
    """
    from transformers import AutoConfig

    local = _local_dir(path, "load_model_config")
    config = AutoConfig.from_pretrained(local, trust_remote_code=trust_remote_code, local_files_only=True)
    _apply_overrides(config, dict(override_config or {}), where=f"config at {local}")
    return config


def _apply_overrides(target: Any, overrides: dict, where: str) -> None:
    for key, value in overrides.items():
        if not hasattr(target, key):
            raise ValueError(f"override_config: {where} has no attribute {key!r}")
        current = getattr(target, key)
        if isinstance(value, dict) and isinstance(current, dict):
            current.update(value)
        elif isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
            _apply_overrides(current, value, where=f"{where}.{key}")
        else:
            setattr(target, key, value)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def get_generation_eos_ids(path_or_tokenizer: Any, trust_remote_code: bool = False) -> list[int]:
    """Stop-token ids: ``generation_config.json`` ``eos_token_id``(s), then the tokenizer's eos; no repeats.

    Accepts a local model directory (its tokenizer loaded with ``trust_remote_code``) or a tokenizer
    (whose ``name_or_path`` directory is searched for ``generation_config.json`` when it is a local
    directory).
    """
    if isinstance(path_or_tokenizer, (str, Path)):
        directory = _local_dir(path_or_tokenizer, "get_generation_eos_ids")
        tokenizer = load_tokenizer(directory, trust_remote_code=trust_remote_code)
    else:
        tokenizer = path_or_tokenizer
        name = getattr(tokenizer, "name_or_path", "") or ""
        directory = Path(name).expanduser() if name and Path(name).expanduser().is_dir() else None
    ids: list[int] = []
    gen_file = directory / "generation_config.json" if directory is not None else None
    if gen_file is not None and gen_file.is_file():
        ids += _as_id_list(json.loads(gen_file.read_text()).get("eos_token_id"))
    ids += _as_id_list(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("no eos token id found in generation_config.json or the tokenizer")
    return list(dict.fromkeys(ids))


def is_sequence_classifier(path: str | Path) -> bool:
    """Whether the model in the directory ``path`` is a sequence classifier (a DisRM: its config's
    ``architectures`` end in ``ForSequenceClassification``). The one test of it: the server's ``--task
    auto``, the reward loop and the config check all read this."""
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(str(Path(path).expanduser())).architectures or []
    return any(a.endswith("ForSequenceClassification") for a in archs)
