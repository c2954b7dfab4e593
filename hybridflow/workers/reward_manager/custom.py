"""Custom reward functions from a file, and building a reward manager from verl-style config.

Config keys read (verl's names, plus ``on_score_error``)::

    custom_reward_function: {path: /abs/my_reward.py, name: compute_score, reward_kwargs: {...}}
    reward_model:
      reward_manager: naive | batch | dapo | prime | <registered name>
      reward_kwargs: {...}          # forwarded to the manager (and from there to compute_score)
      overlong_buffer: {enable, len, penalty_factor, log}   # for managers that take it (dapo)
      on_score_error: raise | zero  # hybridflow: what a raising / NaN scorer does
    data.max_response_length        # passed by the caller as max_resp_len
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.workers.reward_manager.dapo import cfg_get as _get
from hybridflow.workers.reward_manager.registry import get_reward_manager_cls


def load_custom_reward_function(path: str | Path | None, name: str = "compute_score") -> Callable | None:
    """Import the Python file at ``path`` and return its function ``name`` (``None`` path → ``None``).

    The module is registered in ``sys.modules`` under a stable name derived from the path, so the
    function pickles by reference (needed by the ``prime`` manager's worker processes).
    """
    if path is None or path == "":
        return None
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path: reward function file {str(path)!r} not found")
    module_name = f"hybridflow_custom_reward_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path: cannot import {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        raise
    fn = getattr(module, name, None)
    if not callable(fn):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom_reward_function.name: {file} has no function {name!r} (callables there: {available})"
        )
    return fn


def _custom_compute_score(custom_reward_cfg: Any) -> Callable | None:
    fn = load_custom_reward_function(
        _get(custom_reward_cfg, "path"), _get(custom_reward_cfg, "name") or "compute_score"
    )
    kwargs = dict(_get(custom_reward_cfg, "reward_kwargs") or {})
    return functools.partial(fn, **kwargs) if fn is not None and kwargs else fn


def build_reward_manager(
    reward_model_cfg: Any,
    custom_reward_cfg: Any,
    tokenizer,
    num_examine: int,
    max_resp_len: int | None = None,
):
    """Instantiate ``reward_model.reward_manager`` (default ``naive``) with the custom scorer, if any.

    ``max_resp_len`` and ``overlong_buffer`` reach managers whose constructor declares
    ``max_resp_len``/``overlong_buffer_cfg``; an enabled ``overlong_buffer`` for a manager without
    them is an error rather than silently ignored.
    """
    cls = get_reward_manager_cls(_get(reward_model_cfg, "reward_manager", "naive") or "naive")
    kwargs = dict(_get(reward_model_cfg, "reward_kwargs") or {})
    kwargs["on_score_error"] = _get(reward_model_cfg, "on_score_error", "raise") or "raise"
    overlong = _get(reward_model_cfg, "overlong_buffer")
    accepted = inspect.signature(cls).parameters
    if "overlong_buffer_cfg" in accepted:
        kwargs.update(overlong_buffer_cfg=overlong, max_resp_len=max_resp_len)
    elif _get(overlong, "enable", False):
        raise ValueError(
            f"reward_model.overlong_buffer.enable is set but reward manager {cls.__name__} ignores it; "
            "use reward_model.reward_manager=dapo"
        )
    return cls(tokenizer, num_examine, compute_score=_custom_compute_score(custom_reward_cfg), **kwargs)
