"""Where rollout-trace records go (:mod:`hybridflow.utils.rollout_trace`): a writer thread and the backends.

:class:`TraceWriter` takes records from the event loop without waiting (a queue) and, on its own
thread, decodes ids to text (``token2text``), encodes and hands them to the backend, in batches.

Backends (``rollout.trace.backend``), registered by name in :data:`TRACE_BACKENDS`:

- ``jsonl``: one file per step, ``{dir}/step_{N}.jsonl`` (validation: ``val_step_{N}.jsonl``), one
  record a line: ``step``, ``sample_index``, ``rollout_n``, ``validate``, ``seq`` (the sample's call
  number), ``call`` (the traced method), ``kind`` (generate | tool | agent_loop | reward), ``t_start``,
  ``duration_s``, ``inputs``, ``output``, ``error``; with ``token2text`` every ``*_ids`` list of
  token ids also as ``*_text`` (``token_ids`` → ``text``). Every agent-loop worker appends to the same
  file, each batch of lines in one write under an exclusive ``flock``;
- ``tensorboard``: one text summary per record in ``{dir}/tensorboard`` (tag
  ``rollout_trace/sample_{index}_{n}``, at the record's step), read in TensorBoard's Text tab.

Read a trace back with ``python -m hybridflow.trace show RUN_DIR --step N --sample ID``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import threading
from pathlib import Path

from hybridflow.utils.registry import Registry

logger = logging.getLogger(__name__)
TRACE_BACKENDS: Registry = Registry("rollout trace backend")
BATCH = 256  # records written at once


def step_file(directory: str | Path, step, validate: bool = False) -> Path:
    """The jsonl file of one step's records."""
    return Path(directory) / f"{'val_' if validate else ''}step_{step}.jsonl"


@TRACE_BACKENDS.register("jsonl")
class JsonlTraceBackend:
    """Appends records to ``{directory}/step_{N}.jsonl``."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def write(self, records: list[dict]) -> None:
        by_file: dict[Path, list[str]] = {}
        for record in records:
            path = step_file(self.directory, record.get("step"), bool(record.get("validate")))
            by_file.setdefault(path, []).append(json.dumps(record, ensure_ascii=False, default=str))
        for path, lines in by_file.items():
            data = ("\n".join(lines) + "\n").encode()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # other workers append to the same step file
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)  # closing releases the lock

    def close(self) -> None:
        return None


@TRACE_BACKENDS.register("tensorboard")
class TensorboardTraceBackend:
    """One text summary per record under ``{directory}/tensorboard``."""

    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "rollout.trace.backend=tensorboard needs tensorboard (pip install tensorboard)"
            ) from err
        self.writer = SummaryWriter(log_dir=str(Path(directory) / "tensorboard"))

    def write(self, records: list[dict]) -> None:
        for record in records:
            prefix = "val_" if record.get("validate") else ""
            tag = f"rollout_trace/{prefix}sample_{record.get('sample_index')}_{record.get('rollout_n')}"
            step = record.get("step")
            self.writer.add_text(tag, markdown(record), global_step=step if isinstance(step, int) else None)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def markdown(record: dict) -> str:
    """A record as a short markdown block (TensorBoard's text panel)."""
    head = (
        f"**{record.get('seq')}. {record.get('kind')}** `{record.get('call')}` ({record.get('duration_s')} s)"
    )
    body = json.dumps(
        {k: record.get(k) for k in ("inputs", "output", "error") if record.get(k) is not None},
        ensure_ascii=False,
        indent=1,
        default=str,
    )
    return f"{head}\n\n```\n{body[:20_000]}\n```"


def build_backend(name: str, directory: str):
    return TRACE_BACKENDS.get(name)(directory)


class TraceWriter:
    """Queues records (never blocks the caller) and writes them on a daemon thread."""

    def __init__(self, backend, token2text: bool = False) -> None:
        self.backend, self.token2text = backend, token2text
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._done = threading.Condition()
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="rollout-trace-writer", daemon=True)
        self._thread.start()

    def put(self, record: dict, tokenizer=None) -> None:
        with self._done:
            self._pending += 1
        self._queue.put((record, tokenizer))

    def flush(self, timeout_s: float | None = 60.0) -> bool:
        """Wait until every record queued so far is written; True when it was in time."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.backend.close()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            items = [first]
            while len(items) < BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # close after this batch
                    break
                items.append(item)
            try:
                self.backend.write(
                    [_with_text(record, tok) if tok is not None else record for record, tok in items]
                )
            except Exception:  # a trace write must never take the rollout down: count and log it
                self.errors += 1
                logger.exception("rollout trace: writing %d records failed", len(items))
            with self._done:
                self._pending -= len(items)
                self._done.notify_all()


def _with_text(record: dict, tokenizer) -> dict:
    """``token2text``: every list of token ids under a ``*_ids`` key (and ``token_ids``) of the inputs
    and the output also decoded, as ``*_text`` (``text``)."""
    out = dict(record)
    for part in ("inputs", "output"):
        if isinstance(out.get(part), dict):
            out[part] = _decode_ids(out[part], tokenizer)
    return out


def _decode_ids(values: dict, tokenizer) -> dict:
    decoded = dict(values)
    for key, value in values.items():
        if key.endswith("_ids") and isinstance(value, list) and all(isinstance(t, int) for t in value):
            name = "text" if key == "token_ids" else key[: -len("_ids")] + "_text"
            try:
                decoded[name] = tokenizer.decode(value)
            except Exception as error:  # an id out of the vocabulary: say so in the record
                decoded[name] = f"<not decodable: {type(error).__name__}: {error}>"
    return decoded
