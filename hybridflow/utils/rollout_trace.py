"""The rollout trace (verl's ``verl/utils/rollout_trace.py``): every agent-loop call, per sample and step.

Config ``actor_rollout_ref.rollout.trace`` (verl's keys): ``backend`` (``jsonl`` | ``tensorboard``;
verl's ``weave`` and ``mlflow`` are refused before Ray starts, see
:mod:`hybridflow.trainer.config.honesty`), ``token2text`` (token ids also written as text) and
``max_samples_per_step_per_worker`` (null: every sample; N: each agent-loop worker traces N dataset
prompts a step, with all their ``rollout.n`` samples, as verl does). ``dir`` (ours; null: the run's
``outputs/{project}/{experiment}/rollout_trace``) says where the records go.

The API is verl's, so a verl agent loop or tool traced with it runs unchanged (through the verl alias,
``verl.utils.rollout_trace``):

- :func:`rollout_trace_attr` (a context manager) says which sample the calls inside belong to
  (``step``, ``sample_index``, ``rollout_n``, ``validate``); ``trace=False`` turns tracing off inside;
- :func:`rollout_trace_op` (a decorator, async or sync methods) records one call of the method: its
  inputs (the bound arguments but ``self``), its output or its error, its start and duration. Outside a
  :func:`rollout_trace_attr`, or with no backend, it only calls the method.

**Never blocks the loop.** A record is made JSON-ready on the caller's thread (a snapshot: the caller
may change its lists afterwards) and queued; decoding ids to text, JSON encoding and the file writes
happen on the writer's thread (:mod:`hybridflow.utils.rollout_trace_backends`).
:meth:`RolloutTraceConfig.flush` (the agent-loop worker awaits it off the loop at the end of each
call) waits until what was queued is written.

**Never loses a turn.** A call is recorded when it returns, when it raises (with the error) and when
it is cancelled; an aborted generation returns (``stop_reason="aborted"``) and is recorded as such. A
sample's records carry ``seq``, its call count in this process in the order the calls started, which
continues when the sample is resumed here (partial rollout), and ``t_start``; the reader orders by
``t_start``. Which samples are traced is decided once per (step, dataset index) in a worker, so a
resumed group is traced again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import random
import threading
import time
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any

BACKENDS_HERE = ("jsonl", "tensorboard")  # what runs offline here
REFUSED_BACKENDS = {
    "weave": "weave logs to the Weights & Biases service (weave.init needs a network service), which "
    "this machine cannot reach",
    "mlflow": "mlflow is not part of this environment and no mlflow backend is wired (measured "
    "2026-11-26: mlflow-skinny 3.17.2 installs, 117 MB, and writes traces to a local file store only with "
    "MLFLOW_ALLOW_FILE_STORE=true, its file store being in maintenance mode; verl's default sqlite store "
    "needs the full mlflow; docs/agent_loops.md#trace)",
}
MAX_LIST = 65_536  # longer lists are cut in a record (with a note of the full length)
_NUMBERS = (int, float, bool, str)
_trace_enabled: ContextVar[bool] = ContextVar("_trace_enabled", default=True)
_sample: ContextVar[dict | None] = ContextVar("_rollout_trace_sample", default=None)


def trace_dir(config) -> str:
    """The absolute directory of a run's trace: ``rollout.trace.dir``, or the run's log directory
    (``outputs/{project_name}/{experiment_name}``, as the trackers use) ``/rollout_trace``."""
    trace = (config.actor_rollout_ref.rollout.get("trace") or {}) if config is not None else {}
    if trace.get("dir"):
        return os.path.abspath(os.path.expanduser(str(trace["dir"])))
    trainer = config.trainer
    return os.path.abspath(
        os.path.join("outputs", str(trainer.project_name), str(trainer.experiment_name), "rollout_trace")
    )


class RolloutTraceConfig:
    """The process's trace settings (verl's singleton): ``init`` once per process, ``get_instance``,
    ``get_backend``, ``get_client`` (the writer), ``enable_token2text``, ``reset``."""

    _instance: RolloutTraceConfig | None = None
    backend: str | None = None
    client: Any = None  # the TraceWriter (verl: the backend's client)
    token2text: bool = False
    project_name: str | None = None
    experiment_name: str | None = None
    max_samples_per_step_per_worker: int | None = None
    tokenizer: Any = None
    _initialized: bool = False

    def __new__(cls, *args, **kwargs):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._calls = OrderedDict()  # sample key -> calls recorded so far
            cls._instance._chosen = OrderedDict()  # (step, validate) -> {dataset index: traced?}
            cls._instance._lock = threading.Lock()
        return cls._instance

    @classmethod
    def get_instance(cls) -> RolloutTraceConfig:
        return cls()

    @classmethod
    def init(
        cls,
        project_name: str,
        experiment_name: str,
        backend: str | None,
        token2text: bool = False,
        max_samples_per_step_per_worker: int | None = None,
        directory: str | None = None,
        tokenizer=None,
    ) -> None:
        """Set up tracing in this process (a second call does nothing, as verl's). ``directory``: where
        the backend writes; ``tokenizer``: decodes ids for ``token2text`` when the traced object has none."""
        config = cls.get_instance()
        if config._initialized:
            return
        if backend is not None:
            from hybridflow.utils.rollout_trace_backends import TraceWriter, build_backend

            check_backend(backend)
            if max_samples_per_step_per_worker is not None and int(max_samples_per_step_per_worker) < 0:
                raise ValueError("rollout.trace.max_samples_per_step_per_worker must be >= 0 or null")
            config.client = TraceWriter(build_backend(backend, directory or "rollout_trace"), token2text)
        config.backend, config.token2text = backend, bool(token2text)
        config.project_name, config.experiment_name = project_name, experiment_name
        config.max_samples_per_step_per_worker = (
            None if max_samples_per_step_per_worker is None else int(max_samples_per_step_per_worker)
        )
        config.tokenizer = tokenizer
        config._initialized = True

    @classmethod
    def get_backend(cls) -> str | None:
        return cls.get_instance().backend

    @classmethod
    def get_client(cls):
        return cls.get_instance().client

    @classmethod
    def enable_token2text(cls) -> bool:
        return cls.get_instance().token2text

    @classmethod
    def flush(cls, timeout_s: float | None = 60.0) -> bool:
        """Wait until every queued record is written (call it off the event loop); True when done."""
        client = cls.get_instance().client
        return True if client is None else client.flush(timeout_s)

    @classmethod
    def reset(cls) -> None:
        """Close the writer (flushing it) and forget the settings."""
        instance = cls._instance
        if instance is not None and instance.client is not None:
            instance.client.close()
        cls._instance = None

    # ------------------------------------------------------------------ sampling whole groups
    def traced_rows(self, index: list, step: int, validate: bool = False) -> set[int]:
        """The rows of a batch to trace: with ``max_samples_per_step_per_worker`` N, up to N dataset
        indices a (step, validate) in this process, drawn at random among the indices not seen yet, with
        every row (all ``rollout.n`` samples) of each; an index seen before keeps its decision (a
        resumed or later call of the same step). ``index``: the rows' dataset indices."""
        limit = self.max_samples_per_step_per_worker
        if limit is None:
            return set(range(len(index)))
        with self._lock:
            chosen = self._chosen.setdefault((step, bool(validate)), {})
            self._chosen.move_to_end((step, bool(validate)))
            while len(self._chosen) > 8:  # only recent steps are resumed
                self._chosen.popitem(last=False)
            new = sorted({i for i in index if i not in chosen}, key=str)
            room = max(limit - sum(chosen.values()), 0)
            picked = set(random.sample(new, min(room, len(new))))
            for i in new:
                chosen[i] = i in picked
            return {row for row, i in enumerate(index) if chosen[i]}

    def next_seq(self, key: tuple) -> int:
        """The sample's next call number in this process (continues across a resume here)."""
        with self._lock:
            seq = self._calls.get(key, 0) + 1
            self._calls[key] = seq
            self._calls.move_to_end(key)
            while len(self._calls) > 100_000:
                self._calls.popitem(last=False)
            return seq


def check_backend(backend) -> None:
    """Raise a clear ``ValueError`` for a backend that cannot run here."""
    if backend is None or backend in BACKENDS_HERE:
        return
    if backend in REFUSED_BACKENDS:
        raise ValueError(
            f"rollout.trace.backend={backend}: {REFUSED_BACKENDS[backend]}; "
            f"use one of {', '.join(BACKENDS_HERE)}"
        )
    raise ValueError(f"rollout.trace.backend={backend!r} is unknown; use one of {', '.join(BACKENDS_HERE)}")


# ---------------------------------------------------------------------- verl's API
@contextlib.contextmanager
def rollout_trace_attr(
    sample_index=None, step=None, rollout_n=None, name="rollout_trace", validate=False, trace: bool = True
):
    """The calls inside belong to this sample (verl's signature); ``trace=False``: record none of them."""
    backend = RolloutTraceConfig.get_backend()
    if backend is not None and not trace:
        token = _trace_enabled.set(False)
        try:
            yield
        finally:
            _trace_enabled.reset(token)
        return
    if backend is None:
        yield
        return
    attributes = {
        "step": _plain(step),
        "sample_index": _plain(sample_index),
        "rollout_n": _plain(rollout_n),
        "validate": bool(validate),
        "name": name,
        "experiment_name": RolloutTraceConfig.get_instance().experiment_name,
    }
    token, enabled = _sample.set(attributes), _trace_enabled.set(True)
    try:
        yield
    finally:
        _sample.reset(token)
        _trace_enabled.reset(enabled)


def rollout_trace_op(func):
    """Record each call of ``func`` (a method, async or not) in the current sample's trace."""
    signature = inspect.signature(func)

    def started(self, args, kwargs):
        attributes = _sample.get()
        if attributes is None or not _trace_enabled.get() or RolloutTraceConfig.get_backend() is None:
            return None
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        inputs = {}
        for name, value in list(bound.arguments.items())[1:]:
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                inputs.update(value)
            else:
                inputs[name] = value
        seq = RolloutTraceConfig.get_instance().next_seq(_sample_key(attributes))  # in start order
        return attributes, inputs, seq, time.time(), time.perf_counter()

    def finish(self, call, output=None, error: BaseException | None = None) -> None:
        attributes, inputs, seq, t_start, clock = call
        config = RolloutTraceConfig.get_instance()
        record = {
            **attributes,
            "seq": seq,
            "call": func.__qualname__,
            "kind": call_kind(func.__qualname__),
            "t_start": t_start,
            "duration_s": round(time.perf_counter() - clock, 6),
            "inputs": to_jsonable(inputs),
            "output": None if error is not None else to_jsonable(output),
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "pid": os.getpid(),
        }
        tokenizer = None
        if config.token2text:  # `is None`: a tokenizer's truth value is its vocabulary size
            tokenizer = getattr(self, "tokenizer", None)
            tokenizer = config.tokenizer if tokenizer is None else tokenizer
        config.client.put(record, tokenizer)

    @functools.wraps(func)
    async def async_wrapper(self, *args, **kwargs):
        call = started(self, args, kwargs)
        if call is None:
            return await func(self, *args, **kwargs)
        try:
            output = await func(self, *args, **kwargs)
        except BaseException as error:  # cancelled or failed: the call is still part of the sample
            finish(self, call, error=error)
            raise
        finish(self, call, output)
        return output

    @functools.wraps(func)
    def wrapper(self, *args, **kwargs):
        call = started(self, args, kwargs)
        if call is None:
            return func(self, *args, **kwargs)
        try:
            output = func(self, *args, **kwargs)
        except BaseException as error:
            finish(self, call, error=error)
            raise
        finish(self, call, output)
        return output

    return async_wrapper if inspect.iscoroutinefunction(func) else wrapper


def record_event(kind: str, call: str, inputs: dict | None = None, output=None) -> None:
    """Record a step that is not a decorated call (the worker's reward) in the current sample's trace."""
    attributes = _sample.get()
    config = RolloutTraceConfig.get_instance()
    if attributes is None or not _trace_enabled.get() or config.backend is None:
        return
    key = _sample_key(attributes)
    record = {
        **attributes,
        "seq": config.next_seq(key),
        "call": call,
        "kind": kind,
        "t_start": time.time(),
        "duration_s": 0.0,
        "inputs": to_jsonable(inputs or {}),
        "output": to_jsonable(output),
        "error": None,
        "pid": os.getpid(),
    }
    config.client.put(record, None)


def call_kind(qualname: str) -> str:
    """What a traced call is, for the reader: generate | tool | agent_loop | call."""
    method = qualname.rsplit(".", 1)[-1]
    if "generate" in method:
        return "generate"
    if method == "run":
        return "agent_loop"
    if method in ("execute", "call") or "Tool" in qualname:
        return "tool"
    return "call"


# ---------------------------------------------------------------------- JSON-ready snapshots
def to_jsonable(value, depth: int = 0):
    """A JSON-ready copy of ``value``: containers copied, pydantic models and dataclasses as dicts,
    numpy/torch values as Python numbers or lists (tensors over :data:`MAX_LIST` elements as their
    shape), anything else as its ``repr``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if depth > 12:
        return repr(value)[:200]
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        if len(items) <= MAX_LIST and all(type(v) in _NUMBERS for v in items):  # token ids, log-probs
            return items
        out = [to_jsonable(v, depth + 1) for v in items[:MAX_LIST]]
        if len(items) > MAX_LIST:
            out.append(f"... ({len(items)} items)")
        return out
    if hasattr(value, "model_dump"):  # pydantic
        return to_jsonable(value.model_dump(), depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # numpy / torch
        size = getattr(value, "size", None)
        numel = value.numel() if hasattr(value, "numel") else (size if isinstance(size, int) else 0)
        if numel > MAX_LIST:
            return f"<{type(value).__name__} shape {tuple(value.shape)}>"
        return to_jsonable(value.tolist(), depth + 1)
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return repr(value)[:2000]


def _sample_key(attributes: dict) -> tuple:
    return (attributes["step"], attributes["validate"], attributes["sample_index"], attributes["rollout_n"])


def _plain(value):
    """A dataset index or step as a plain JSON value (numpy ints arrive from the batch)."""
    return to_jsonable(value)


def rollout_numbers(groups, rows: int) -> list[int]:
    """Each row's sample number within its group (verl's ``rollout_n``): rows of one group (a ``uid``
    or dataset index) are consecutive, as ``repeat(n, interleave=True)`` lays them out; no groups: 0."""
    if groups is None:
        return [0] * rows
    numbers, count = [], 0
    for row in range(rows):
        count = count + 1 if row > 0 and groups[row] == groups[row - 1] else 0
        numbers.append(count)
    return numbers
