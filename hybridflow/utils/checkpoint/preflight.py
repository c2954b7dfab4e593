"""Checks made before any training step that the checkpoint directory can take a checkpoint, and the one
line a failed save is reported in.

``probe_checkpoint_dir`` creates the directory, writes, fsyncs and deletes a probe file in it, and
compares its free space with the expected size of one checkpoint, so a file in the way, a read-only
mount or a full disk is an error before any step is spent (not at the first save, ``save_freq`` steps
later). ``root_cause`` digs the OS error out of what a failed save raised on a worker (Ray's wrapper,
``torch.distributed.checkpoint``'s per-rank ``CheckpointException``).
"""

from __future__ import annotations

import errno
import os
import re
import shutil

PROBE_BYTES = 64 * 1024  # written and fsynced: a full or read-only filesystem refuses it
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its remote error headers
# Exceptions that only carry another: Ray's remote-error wrapper, DCP's per-rank collection.
_WRAPPERS = ("RayTaskError", "CheckpointException")


class CheckpointDirError(RuntimeError):
    """The checkpoint directory cannot take a checkpoint (one line: what, where, what to do)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed mid-run (one line: which step, where, the OS error)."""


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _nearest_existing(path: str) -> str:
    """``path`` or its closest existing ancestor (what a later ``makedirs`` would write into)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def probe_checkpoint_dir(root: str, need_bytes: int | None, key: str = "trainer.default_local_dir") -> int:
    """Create ``root``, prove it writable and (with ``need_bytes``) roomy enough; returns its free bytes.

    Raises :class:`CheckpointDirError` with one line naming ``key``, the path and the fix."""
    blocker = _nearest_existing(root)
    if not os.path.isdir(blocker):
        raise CheckpointDirError(
            f"{key}={root}: {blocker} is a file, not a directory, so no checkpoint can be written there; "
            f"move it away or point {key} elsewhere"
        )
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise CheckpointDirError(f"{key}={root}: cannot create the directory: {_os_error(err)}") from None
    _probe_write(root, key)
    free = shutil.disk_usage(root).free
    if need_bytes is not None and free < need_bytes:
        raise CheckpointDirError(
            f"{key}={root}: {_mib(free)} free, but one checkpoint needs about {_mib(need_bytes)}; free "
            f"space, point {key} at a larger disk, or train without saving (trainer.save_freq=-1 "
            "trainer.save_on_preempt=false)"
        )
    return free


def _probe_write(root: str, key: str) -> None:
    probe = os.path.join(root, f".hybridflow_write_probe_{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        hint = "free space" if err.errno in (errno.ENOSPC, errno.EDQUOT) else f"point {key} elsewhere"
        raise CheckpointDirError(f"{key}={root}: not writable: {_os_error(err)}; {hint}") from None
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


def _os_error(err: OSError) -> str:
    name = errno.errorcode.get(err.errno or 0, "")
    text = err.strerror or str(err)
    return f"{text} ({name})" if name else text


def _causes(err: BaseException) -> list[BaseException]:
    """``err`` and everything it wraps, breadth first: ``cause`` (Ray), ``__cause__``/``__context__``,
    ``failures`` (torch.distributed.checkpoint's rank -> exception) and ``exc`` (its wrapper)."""
    seen, queue, out = set(), [err], []
    while queue:
        current = queue.pop(0)
        if current is None or id(current) in seen or not isinstance(current, BaseException):
            continue
        seen.add(id(current))
        out.append(current)
        queue += [getattr(current, "cause", None), current.__cause__, current.__context__]
        queue += [getattr(current, "exc", None)]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # rank -> (exception, traceback) or a wrapper with .exc
            queue += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return out


def root_cause(err: BaseException) -> str:
    """One line for what a save raised: the innermost OS error (``No space left on device (ENOSPC):
    '/ckpt/...'``) when there is one, else the first exception that is more than a wrapper, as type and
    first line (a torch.save cut short by a full disk reports only ``RuntimeError: [enforce fail at
    inline_container.cc...]``; a dead worker ``WorkerDiedError: worker group ... rank 1 ...``)."""
    causes = _causes(err)
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno:
            where = f": {cause.filename!r}" if cause.filename else ""
            return f"{_os_error(cause)}{where}"
    # the first exception that is not a bare wrapper (a WorkerDiedError names the worker; its cause,
    # Ray's ActorDiedError, does not); the innermost if all are wrappers
    named = [c for c in causes if not type(c).__name__.startswith(_WRAPPERS)]
    inner = named[0] if named else causes[-1]
    lines = _ANSI.sub("", str(inner)).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"[:300]


def remove_partial(path: str) -> None:
    """Delete a partially written file or directory, never raising (the disk may be full or read-only)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            os.remove(path)
        except OSError:
            pass
