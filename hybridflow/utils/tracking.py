"""Experiment tracking: one ``Tracking`` front end fanning each step's metrics out to named backends.

Backends register by name (``@register_tracker("jsonl")``) and share one interface: constructed with
``(project_name, experiment_name, config, log_dir)``, then ``log(data, step)`` and ``finish()``; a
backend that keeps its own history may also offer ``rewind(step)``, which the trainer calls once it
knows where the run starts (:meth:`Tracking.rewind`).

- ``console``: one sorted ``step:N - key:value`` line per step, via ``tqdm.write`` (safe under a bar);
- ``jsonl`` (alias ``file``): ``{"step": N, **metrics}`` appended to ``{log_dir}/metrics.jsonl``; on
  resume from step N the records of later steps (logged before the interruption, about to be logged
  again) are dropped, so each step appears once; a fresh start moves an old file to
  ``metrics.jsonl.previous``;
- ``tensorboard``: scalars in ``{log_dir}/tensorboard`` (``TENSORBOARD_DIR`` overrides);
- ``wandb``: offline unless ``WANDB_API_KEY`` is set (``WANDB_MODE`` overrides).

``log_generations(samples, step)`` (verl's ``trainer.log_val_generations``) sends ``(input, output, score)``
samples to every backend that can show them: a wandb Table (one row per step, as verl's
ValidationGenerationsLogger), a tensorboard text panel, ``{log_dir}/val_generations.jsonl``, console lines.

The default ``log_dir`` is ``outputs/{project_name}/{experiment_name}``. Heavy backends import their
library only when selected.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Tracking", "TrackerBackend", "register_tracker", "registered_trackers", "to_float"]

_INSTALL_HINT = 'pip install "hybridflow[tracking]"'
FIELDS = ("input", "output", "score")  # one logged generation sample


class TrackerBackend(Protocol):
    """What every backend provides; the constructor is ``(project, experiment, config, log_dir)``."""

    def log(self, data: dict[str, Any], step: int) -> None: ...

    def finish(self) -> None: ...

    # Optional: ``log_generations(samples, step, table_name)`` with samples ``[(input, output, score), ...]``.


_TRACKERS: dict[str, type] = {}


def register_tracker(name: str) -> Callable[[type], type]:
    """Class decorator registering a backend under ``name``; a different class under a taken name raises."""

    def decorator(cls: type) -> type:
        existing = _TRACKERS.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"tracker {name!r} is already registered to {existing.__qualname__}")
        _TRACKERS[name] = cls
        return cls

    return decorator


def registered_trackers() -> list[str]:
    return sorted(_TRACKERS)


def to_float(value: Any) -> float | None:
    """``value`` as a Python float (ints, bools, numpy/torch scalars), or None if it is not numeric."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool | int | float):
        return float(value)
    return None


class _NonNumericFilter:
    """Keeps the numeric entries of a metrics dict, warning once per key about the others."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.warned: set[str] = set()

    def __call__(self, data: dict[str, Any]) -> dict[str, float]:
        out = {}
        for key, value in data.items():
            number = to_float(value)
            if number is not None:
                out[key] = number
            elif key not in self.warned:
                self.warned.add(key)
                warnings.warn(
                    f"{self.backend} tracker: skipping non-numeric metric {key!r} ({type(value).__name__})",
                    stacklevel=3,
                )
        return out


def _format_value(value: Any) -> str:
    number = to_float(value)
    if number is None:
        return str(value)
    if isinstance(value, bool | int) or (hasattr(value, "dtype") and "int" in str(value.dtype)):
        return str(int(number))
    return f"{number:.4g}"


@register_tracker("console")
class ConsoleTracker:
    """One compact line per step, keys sorted: ``step:3 - actor/pg_loss:0.012 - ...``."""

    def __init__(self, project_name: str, experiment_name: str, config: dict | None, log_dir: str) -> None:
        del project_name, experiment_name, config, log_dir

    @staticmethod
    def format_line(data: dict[str, Any], step: int) -> str:
        parts = [f"step:{step}"] + [f"{key}:{_format_value(data[key])}" for key in sorted(data)]
        return " - ".join(parts)

    def log(self, data: dict[str, Any], step: int) -> None:
        from tqdm import tqdm

        tqdm.write(self.format_line(data, step))

    def log_generations(self, samples: list[tuple], step: int, table_name: str) -> None:
        from tqdm import tqdm

        lines = [f"{table_name} step:{step}"]
        for i, (prompt, output, score) in enumerate(samples, start=1):
            lines.append(f"  [{i}] score={_format_value(score)} input={prompt!r} output={output!r}")
        tqdm.write("\n".join(lines))

    def finish(self) -> None:
        pass


@register_tracker("jsonl")
@register_tracker("file")
class JsonlTracker:
    """Appends ``{"step": n, **metrics}`` lines to ``{log_dir}/metrics.jsonl``, flushed per line.

    Values are stored as floats; NaN and inf are written as the ``NaN``/``Infinity`` tokens that
    Python's ``json`` reads back.
    """

    def __init__(self, project_name: str, experiment_name: str, config: dict | None, log_dir: str) -> None:
        del project_name, experiment_name, config
        self.path = Path(log_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._numeric = _NonNumericFilter("jsonl")

    def log(self, data: dict[str, Any], step: int) -> None:
        record = {"step": int(step), **self._numeric(data)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def rewind(self, step: int) -> int:
        """The run continues after ``step`` (0: a fresh start): drop the records of later steps from
        ``metrics.jsonl`` and ``val_generations.jsonl`` (and unreadable lines, e.g. one cut short by a
        kill), so a resumed run logs each step once. A fresh start moves an existing file aside to
        ``<name>.previous`` instead. Returns how many records were dropped."""
        self._file.close()
        dropped = 0
        for path in (self.path, self.path.parent / "val_generations.jsonl"):
            dropped += _rewind_file(path, step)
        self._file = self.path.open("a", encoding="utf-8")
        return dropped

    def log_generations(self, samples: list[tuple], step: int, table_name: str) -> None:
        """One ``{"step", "table", "input", "output", "score"}`` line per sample, appended to
        ``{log_dir}/val_generations.jsonl``."""
        with (self.path.parent / "val_generations.jsonl").open("a", encoding="utf-8") as f:
            for prompt, output, score in samples:
                record = {"step": int(step), "table": table_name, "input": prompt, "output": output}
                f.write(json.dumps({**record, "score": to_float(score)}, ensure_ascii=False) + "\n")

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()


def _record_step(line: str) -> int | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _rewind_file(path: Path, step: int) -> int:
    """Keep the lines of ``path`` whose record's step is <= ``step``; with ``step == 0`` move a non-empty
    file to ``<name>.previous``. Rewritten through a temp file and a rename (a kill keeps the old)."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    if step <= 0:
        os.replace(path, path.with_name(path.name + ".previous"))
        return len(lines)
    keep = [line for line in lines if (s := _record_step(line)) is not None and s <= step]
    if len(keep) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)
    return len(lines) - len(keep)


@register_tracker("tensorboard")
class TensorboardTracker:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, project_name: str, experiment_name: str, config: dict | None, log_dir: str) -> None:
        del project_name, experiment_name
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's wrapper raises this when tensorboard is absent
            raise ImportError(f"the tensorboard tracker needs tensorboard: {_INSTALL_HINT}") from err
        self.log_dir = os.environ.get("TENSORBOARD_DIR") or str(Path(log_dir) / "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir)
        if config:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2, default=str)}\n```")
        self._numeric = _NonNumericFilter("tensorboard")

    def log(self, data: dict[str, Any], step: int) -> None:
        for key, value in self._numeric(data).items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_generations(self, samples: list[tuple], step: int, table_name: str) -> None:
        """A markdown text panel per step (as verl's tensorboard generations logger)."""
        blocks = [
            f"### Sample {i}\n**Input:** {prompt}\n\n**Output:** {output}\n\n**Score:** {score}\n"
            for i, (prompt, output, score) in enumerate(samples, start=1)
        ]
        self.writer.add_text(table_name, f"**Generations, step {step}**\n\n" + "\n---\n".join(blocks), step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


@register_tracker("wandb")
class WandbTracker:
    """Weights & Biases; runs offline (no network) unless an API key is configured."""

    def __init__(self, project_name: str, experiment_name: str, config: dict | None, log_dir: str) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(f"the wandb tracker needs wandb: {_INSTALL_HINT}") from err
        default_mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project_name,
            name=experiment_name,
            config=config,
            mode=os.environ.get("WANDB_MODE", default_mode),
            dir=log_dir,
        )
        self._tables: dict[str, Any] = {}

    def log(self, data: dict[str, Any], step: int) -> None:
        self.run.log(data, step=step)

    def log_generations(self, samples: list[tuple], step: int, table_name: str) -> None:
        """verl's layout: columns ``step, input_1, output_1, score_1, ...``, one row per call, the whole
        table re-logged each time (a wandb Table cannot be appended to after logging)."""
        import wandb

        columns = ["step"] + [f"{kind}_{i}" for i in range(1, len(samples) + 1) for kind in FIELDS]
        previous = self._tables.get(table_name)
        rows = previous.data if previous is not None and previous.columns == columns else []
        table = wandb.Table(columns=columns, data=rows)
        table.add_data(step, *[value for sample in samples for value in sample])
        self.run.log({table_name: table}, step=step)
        self._tables[table_name] = table

    def finish(self) -> None:
        self.run.finish()


class Tracking:
    """Sends ``log(data, step)`` to every selected backend; ``finish()`` closes them (idempotent)."""

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | list[str],
        config: dict | None = None,
        log_dir: str | None = None,
    ) -> None:
        names = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        unknown = [name for name in names if name not in _TRACKERS]
        if unknown:
            raise ValueError(f"unknown tracking backend(s) {unknown}; registered: {registered_trackers()}")
        self.log_dir = log_dir or os.path.join("outputs", project_name, experiment_name)
        self.backends: dict[str, TrackerBackend] = {}
        for name in dict.fromkeys(names):  # de-duplicate, keep order
            cls = _TRACKERS[name]
            if any(type(b) is cls for b in self.backends.values()):
                continue  # an alias of a backend already open (file / jsonl)
            self.backends[name] = cls(project_name, experiment_name, config, self.log_dir)
        self._finished = False

    def log(self, data: dict[str, Any], step: int) -> None:
        for backend in self.backends.values():
            backend.log(data, step)

    def rewind(self, step: int) -> None:
        """The run starts after ``step`` (a resume; 0: fresh): backends that keep a history file drop
        what a previous attempt logged past it (``jsonl``)."""
        for backend in self.backends.values():
            if hasattr(backend, "rewind"):
                dropped = backend.rewind(step)
                if dropped and step > 0:
                    print(f"tracking: resuming after step {step}: dropped {dropped} records logged past it")
                elif dropped:
                    print(f"tracking: a fresh start: {dropped} earlier records moved to *.jsonl.previous")

    def log_generations(self, samples: list[tuple], step: int, table_name: str = "val/generations") -> None:
        """``samples``: ``[(input, output, score), ...]``, to every backend that shows generations."""
        for backend in self.backends.values():
            if hasattr(backend, "log_generations"):
                backend.log_generations(samples, step, table_name)

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        for backend in self.backends.values():
            backend.finish()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()
