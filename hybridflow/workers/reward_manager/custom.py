"""Custom reward functions from a file, and building a reward manager from verl-style config.

Config keys read (verl's names, plus ``on_score_error``)::

    custom_reward_function: {path: /abs/my_reward.py, name: compute_score, reward_kwargs: {...}}
    reward_model:
      reward_manager: naive | batch | dapo | prime | <registered name>
      reward_kwargs: {...}          # forwarded to the manager (and from there to compute_score)
      overlong_buffer: {enable, len, penalty_factor, log}   # for managers that take it (dapo)
      on_score_error: raise | zero  # hybridflow: what a raising / NaN / timed-out scorer does
      score_timeout_s: 300          # hybridflow: one scorer call (null: no limit)
      batch_timeout_s: 1800         # hybridflow: all of one batch's scoring (null: no limit)
    data.max_response_length        # passed by the caller as max_resp_len
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.workers.reward_manager.dapo import cfg_get as _get
from hybridflow.workers.reward_manager.naive import DEFAULT_BATCH_TIMEOUT_S, DEFAULT_SCORE_TIMEOUT_S
from hybridflow.workers.reward_manager.registry import get_reward_manager_cls


def _import_file(file: Path):
    """The module of ``file``, imported once per process under a stable name derived from its path
    (importing it again for the validation manager would make the training manager's function "not
    the same object" as the module's, and unpicklable)."""
    module_name = f"hybridflow_custom_reward_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path: cannot import {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_custom_reward_function(path: str | Path | None, name: str = "compute_score") -> Callable | None:
    """Import the Python file at ``path`` (once per process) and return its function ``name``
    (``None`` path → ``None``)."""
    if path is None or path == "":
        return None
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path: reward function file {str(path)!r} not found")
    module = _import_file(file)
    fn = getattr(module, name, None)
    if not callable(fn):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom_reward_function.name: {file} has no function {name!r} (callables there: {available})"
        )
    return fn


class CustomRewardFunction:
    """``custom_reward_function.{path, name, reward_kwargs}`` as a callable that pickles as its path,
    name and kwargs: a process that unpickles it (the ``prime`` manager's workers, whatever their
    start method) imports the file itself, once."""

    def __init__(self, path: str | Path, name: str = "compute_score", kwargs: dict | None = None) -> None:
        self.path = str(Path(path).expanduser().resolve())
        self.name = name
        self.kwargs = dict(kwargs or {})
        self._fn: Callable | None = None
        self._load()  # fail at start-up, not at the first batch

    def _load(self) -> Callable:
        if self._fn is None:
            self._fn = load_custom_reward_function(self.path, self.name)
        return self._fn

    def target(self) -> Callable:
        """The user's function itself (the reward loop reads whether it is ``async def``)."""
        return self._load()

    def __call__(self, *args, **kwargs):
        return self._load()(*args, **{**self.kwargs, **kwargs})

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name, "kwargs": self.kwargs}

    def __setstate__(self, state: dict) -> None:
        self.path, self.name, self.kwargs = state["path"], state["name"], state["kwargs"]
        self._fn = None  # imported on the first call in this process

    def __repr__(self) -> str:
        return f"CustomRewardFunction({self.path!r}, {self.name!r})"


def _custom_compute_score(custom_reward_cfg: Any) -> Callable | None:
    path = _get(custom_reward_cfg, "path")
    if path is None or path == "":
        return None
    name = _get(custom_reward_cfg, "name") or "compute_score"
    return CustomRewardFunction(path, name, dict(_get(custom_reward_cfg, "reward_kwargs") or {}))


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
    limits = {"score_timeout_s": DEFAULT_SCORE_TIMEOUT_S, "batch_timeout_s": DEFAULT_BATCH_TIMEOUT_S}
    for key, default in limits.items():
        kwargs[key] = _get(reward_model_cfg, key, default)  # null in the config: no limit
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
