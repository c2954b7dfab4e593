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
      sandbox_fusion: {url, max_concurrent, memory_limit_mb}  # code rows' test cases (:mod:`.sandbox_fusion`)
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
from hybridflow.workers.reward_manager.dapo import overlong_settings
from hybridflow.workers.reward_manager.naive import DEFAULT_BATCH_TIMEOUT_S, DEFAULT_SCORE_TIMEOUT_S
from hybridflow.workers.reward_manager.registry import get_reward_manager_cls
from hybridflow.workers.reward_manager.sandbox_fusion import sandbox_fusion_compute_score


def _import_file(file: Path, module_name: str | None = None):
    """The module of ``file``, imported once per process under a stable name derived from its path, or
    under ``module_name`` (importing it again for the validation manager would make the training
    manager's function "not the same object" as the module's, and unpicklable)."""
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:8]
    module_name = module_name or f"hybridflow_custom_reward_{file.stem}_{digest}"
    loaded = sys.modules.get(module_name)
    if loaded is not None and getattr(loaded, "__file__", None) not in (None, str(file)):
        module_name = f"{module_name}_{digest}"  # the name is another file's: keep both
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {file} as a Python module")
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
    reward_fn_key: str = "data_source",
    manager_section: Any = None,
):
    """Instantiate ``reward_model.reward_manager`` (default ``naive``) with the custom scorer, if any; or,
    with verl's top-level ``manager_section`` (``reward_manager``) at ``source: importlib``, the class it
    names, with verl's arguments (``tokenizer``, ``num_examine``, ``compute_score``, ``reward_fn_key``,
    ``**reward_kwargs``).

    DAPO's overlong settings (:func:`~.dapo.overlong_settings`: verl's ``reward_kwargs.overlong_buffer_cfg``
    and ``max_resp_len``, else ``reward_model.overlong_buffer`` with ``max_resp_len``, the caller's
    ``data.max_response_length``) reach managers whose constructor declares ``overlong_buffer_cfg``; an
    enabled penalty for a manager without it is an error rather than silently ignored.
    """
    imported = _get(manager_section, "source", "register") == "importlib"
    if imported:
        cls = imported_manager_class(manager_section)
    else:
        cls = get_reward_manager_cls(_get(reward_model_cfg, "reward_manager", "naive") or "naive")
    kwargs = dict(_get(reward_model_cfg, "reward_kwargs") or {})
    kwargs["on_score_error"] = _get(reward_model_cfg, "on_score_error", "raise") or "raise"
    limits = {"score_timeout_s": DEFAULT_SCORE_TIMEOUT_S, "batch_timeout_s": DEFAULT_BATCH_TIMEOUT_S}
    for key, default in limits.items():
        kwargs[key] = _get(reward_model_cfg, key, default)  # null in the config: no limit
    overlong, max_resp_len = overlong_settings(reward_model_cfg, max_resp_len)
    accepted = inspect.signature(cls).parameters
    if "overlong_buffer_cfg" in accepted:
        kwargs.update(overlong_buffer_cfg=overlong, max_resp_len=max_resp_len)
    elif _get(overlong, "enable", False):
        raise ValueError(
            f"DAPO's overlong penalty is enabled but reward manager {cls.__name__} ignores it; "
            "use reward_model.reward_manager=dapo"
        )
    kwargs["reward_fn_key"] = reward_fn_key
    if imported:  # a class written for verl: verl's arguments, and ours only where it names them
        kwargs = {k: v for k, v in kwargs.items() if k in accepted or k not in HYBRIDFLOW_MANAGER_KWARGS}
    compute_score = _custom_compute_score(custom_reward_cfg) or sandbox_fusion_compute_score(reward_model_cfg)
    return cls(tokenizer, num_examine, compute_score=compute_score, **kwargs)


HYBRIDFLOW_MANAGER_KWARGS = ("on_score_error", "score_timeout_s", "batch_timeout_s")


def imported_manager_class(section: Any, where: str = "reward_manager") -> type:
    """verl's ``reward_manager.source=importlib``: the class ``reward_manager.name`` from the file
    ``reward_manager.module.path``, imported as the module ``reward_manager.module.name`` (verl's
    ``load_reward_manager``; the class name is ``name``, not ``module.name``)."""
    module = _get(section, "module") or {}
    path, class_name = _get(module, "path"), _get(section, "name")
    if not path:
        raise ValueError(f"{where}.source=importlib needs {where}.module.path (the file holding the class)")
    return load_class_from_file(path, class_name, f"{where}.name", _get(module, "name"))


def load_class_from_file(path: str, class_name: str | None, key: str, module_name: str | None = None) -> type:
    """The class ``class_name`` of the Python file ``path`` (verl's ``load_extern_object``), its module
    imported once per process; errors name the key to fix."""
    file = Path(str(path)).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{key}: the module file {str(path)!r} does not exist")
    if not class_name:
        raise ValueError(f"{key}: name the reward manager class to load from {file}")
    loaded = _import_file(file, module_name)
    if not hasattr(loaded, str(class_name)):
        classes = sorted(k for k, v in vars(loaded).items() if isinstance(v, type) and not k.startswith("_"))
        raise AttributeError(f"{key}: {file} has no class {class_name!r} (classes there: {classes})")
    return getattr(loaded, str(class_name))
