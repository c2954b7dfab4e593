"""Built-in tasks generated offline: datasets in verl's parquet schema plus their rule-based reward.

``hybridflow.tasks.arithmetic``: multi-digit arithmetic (``data_source="hybridflow/arithmetic"``);
``python -m hybridflow.tasks.arithmetic --out DIR`` writes its train/test parquet.

The names below are imported on first use, not with the package, so that
``python -m hybridflow.tasks.arithmetic`` runs the module once (no runpy warning about a module found
in ``sys.modules`` before its execution).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ArithmeticTaskConfig", "make_problem", "task_texts", "write_rl_dataset", "write_sft_dataset"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("hybridflow.tasks.arithmetic"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
