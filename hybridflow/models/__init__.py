"""Model helpers: tiny offline models/tokenizers and local loading.

Importing this package is cheap; ``transformers``/``torch`` load when a function is first used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_tokenizer": "hybridflow.models.tiny",
    "build_tiny_model": "hybridflow.models.tiny",
    "CHATML_TEMPLATE": "hybridflow.models.tiny",
    "load_tokenizer": "hybridflow.models.loading",
    "load_model_config": "hybridflow.models.loading",
    "get_generation_eos_ids": "hybridflow.models.loading",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridflow.models' has no attribute {name!r}")
