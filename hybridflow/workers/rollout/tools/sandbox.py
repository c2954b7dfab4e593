"""Run untrusted, model-written Python in a contained child process (Linux only).

``await run_python(code, limits)`` never raises for anything the code does; it always returns a
:class:`SandboxResult`. Many runs may be awaited concurrently on one event loop. What contains the code:

* **A separate process** (``python -I -S -B``: no environment variables, user site, or site-packages)
  in its own session/process group, in a fresh temporary working directory (``HOME`` and ``TMPDIR``
  too) that is deleted afterwards, with a minimal environment and stdin from /dev/null.
* **Resource limits** set in the child before the code runs: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
  RLIMIT_NOFILE, RLIMIT_NPROC, RLIMIT_CORE=0, plus a wall-clock timeout enforced by the parent.
* **Cleanup of every process**: after the main process exits or times out, the parent SIGKILLs its
  process group and, when the child runs under its own uid, every process of that uid, until none is left.
* **No network**: a new network namespace holding only a downed loopback (``unshare(CLONE_NEWNET)`` as
  root, ``CLONE_NEWUSER | CLONE_NEWNET`` otherwise). Only if that fails are the ``socket`` constructors
  replaced by stubs raising PermissionError, which ctypes could get around. ``result.isolation["network"]``
  says which held ("netns" or "python-guard").

What holds depends on who runs the parent:

* **Root** (``drop_privileges=True``, the default): the child switches to a fresh uid/gid, different for
  every concurrent run, after entering the namespace, with ``no_new_privs`` set. The kernel then refuses
  writes anywhere but the working directory and world-writable places (/tmp, /var/tmp, /dev/shm, where
  only the Python guard stands in the way), refuses raising the limits back, enforces RLIMIT_NPROC
  (counted for that uid alone, so ``max_processes`` is exact), and keeps the run from signalling other
  processes; set-uid binaries grant nothing. If the interpreter's
  files are unreadable to other users (a Python under a 0700 /root), CAP_DAC_READ_SEARCH is kept so that
  imports work: the code can then *read* any file, but writing is still checked as the unprivileged uid.
* **Root without the uid switch**: the kernel ignores RLIMIT_NPROC for root and root may raise its
  limits again; only the process-group kill, the wall timeout and the Python guards remain.
* **Not root**: RLIMIT_NPROC counts all processes of the user, so the child allows the user's current
  count plus ``max_processes``, shared with everything else that user runs; writes are limited by file
  permissions (anything the user may write stays writable to ctypes/``_io`` code), and cleanup finds
  processes by process group only (one that leaves it through ctypes ``setsid()`` survives).

The write guard on ``open``/``os.open``/``os.remove``/... and the ban on ``os.setsid`` are Python-level
monkey-patches, **not a security boundary**: they turn ordinary mistakes into clear PermissionErrors. The
boundaries are the process, the limits, the uid switch and the namespace. Total disk use is bounded only
by ``max_file_bytes`` per file and the wall time; put ``work_root`` on a small filesystem if that matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
SETUP_FAILED_EXIT_CODE = 125  # the child's exit code when it could not contain itself
SANDBOX_UID_FIRST, SANDBOX_UID_COUNT = 1_800_000_000, 1 << 24  # fresh uids for runs started as root
STDERR_TAIL_BYTES = 2048  # the end of stderr, kept apart from the truncated copy to classify errors
_uids_in_use: set[int] = set()
_uids_lock = threading.Lock()


@dataclass
class SandboxLimits:
    """Limits for one run; sizes in bytes unless the name says otherwise."""

    wall_timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_mb: int = 512  # RLIMIT_AS: address space, so threads and mmaps count too
    max_processes: int = 32  # RLIMIT_NPROC, see the module docstring for root vs non-root
    max_output_bytes: int = 4096  # per stream
    max_file_bytes: int = 1024 * 1024  # RLIMIT_FSIZE
    max_open_files: int = 256
    use_network_namespace: bool = True  # False: only the Python-level socket stubs
    drop_privileges: bool = True  # as root, run the code under a fresh unprivileged uid
    import_site_packages: bool = False  # let the code import the interpreter's installed packages


@dataclass
class SandboxResult:
    """What a run produced. ``exit_code`` is negative for a signal (``-9``), None if nothing ran."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    killed_reason: str | None = None  # "wall timeout", "cpu limit", "memory limit", ...
    duration_s: float = 0.0
    isolation: dict[str, Any] = field(default_factory=dict)  # which mechanisms held, see the module doc


class _CaptureProtocol(asyncio.SubprocessProtocol):
    """Keeps the first ``limit`` bytes of stdout/stderr (and the tail of stderr), counting the rest."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        self.limit = limit
        self.kept = {1: bytearray(), 2: bytearray()}
        self.total = {1: 0, 2: 0}
        self.stderr_tail = bytearray()
        self.exited = loop.create_future()  # the main process ended (its children may live on)
        self.closed = loop.create_future()  # the process ended and both pipes reached EOF

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        kept = self.kept[fd]
        self.total[fd] += len(data)
        if len(kept) < self.limit:
            kept += data[: self.limit - len(kept)]
        if fd == 2:
            self.stderr_tail = (self.stderr_tail + data)[-STDERR_TAIL_BYTES:]

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.process_exited()
        if not self.closed.done():
            self.closed.set_result(None)

    def text(self, fd: int) -> str:
        text = self.kept[fd].decode("utf-8", errors="replace")
        dropped = self.total[fd] - len(self.kept[fd])
        return text + (f"\n[... truncated {dropped} bytes]" if dropped > 0 else "")


async def run_python(
    code: str, limits: SandboxLimits | None = None, *, work_root: str | None = None
) -> SandboxResult:
    """Run ``code`` as a script in the sandbox; ``work_root`` is where its temporary directory goes."""
    limits = limits or SandboxLimits()
    started = time.monotonic()
    try:
        result = await _run_contained(code, limits, work_root)
    except Exception as error:  # a sandbox failure is a result, never an exception
        result = SandboxResult("", f"sandbox error: {type(error).__name__}: {error}", None)
        result.killed_reason = "sandbox error"
    result.duration_s = time.monotonic() - started
    return result


async def _run_contained(code: str, limits: SandboxLimits, work_root: str | None) -> SandboxResult:
    loop = asyncio.get_running_loop()
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-", dir=work_root))
    uid = _allocate_uid() if limits.drop_privileges and os.geteuid() == 0 else None
    status_read = status_write = transport = pgid = None
    swept = all_killed = False
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as source_file:
            source_file.write(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
        status_read, status_write = os.pipe()
        transport, capture = await loop.subprocess_exec(
            lambda: _CaptureProtocol(limits.max_output_bytes, loop),
            *_child_command(limits, uid, status_write),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=_minimal_environment(workdir),
            start_new_session=True,
            pass_fds=(status_write,),
        )
        pgid = transport.get_pid()  # start_new_session: the child leads its own group
        os.close(status_write)
        status_write = None
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(capture.exited), timeout=limits.wall_timeout_s)
        except TimeoutError:
            timed_out = True
            _kill_group(pgid)
            transport.kill()  # in case the main process itself left the group
            await capture.exited
        all_killed, swept = await asyncio.to_thread(_kill_leftovers, pgid, uid), True
        with contextlib.suppress(TimeoutError):  # pipes may still be flushing
            await asyncio.wait_for(asyncio.shield(capture.closed), timeout=1.0)
        isolation = {**_read_status(status_read), "process_group": pgid, "leftovers_killed": all_killed}
        return _build_result(capture, transport.get_returncode(), timed_out, isolation)
    finally:
        if transport is not None:
            transport.close()  # kills the main process if it still runs
        if pgid is not None and not swept:  # cancelled or failed half-way: clean up synchronously
            all_killed = _kill_leftovers(pgid, uid)
        for fd in (status_read, status_write):
            if fd is not None:
                os.close(fd)
        if uid is not None and (pgid is None or all_killed):
            with _uids_lock:
                _uids_in_use.discard(uid)  # a uid with survivors is never handed out again
        await asyncio.shield(asyncio.to_thread(_remove_tree, workdir))


def _child_command(limits: SandboxLimits, uid: int | None, status_fd: int) -> list[str]:
    config = {
        "source": "main.py",
        "uid": uid,
        "status_fd": status_fd,
        "network_namespace": limits.use_network_namespace,
        "cpu_time_s": max(1, int(limits.cpu_time_s)),
        "memory_mb": int(limits.memory_mb),
        "max_processes": int(limits.max_processes),
        "max_file_bytes": int(limits.max_file_bytes),
        "max_open_files": int(limits.max_open_files),
    }
    flags = ["-I", "-B", "-X", "utf8"] + ([] if limits.import_site_packages else ["-S"])
    return [sys.executable, *flags, CHILD_SCRIPT, json.dumps(config)]


def _minimal_environment(workdir: str) -> dict[str, str]:
    locale = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", **locale, "HOME": workdir, "TMPDIR": workdir}


def _allocate_uid() -> int:
    with _uids_lock:
        while (uid := SANDBOX_UID_FIRST + secrets.randbelow(SANDBOX_UID_COUNT)) in _uids_in_use:
            pass
        _uids_in_use.add(uid)
        return uid


def _read_status(status_fd: int) -> dict[str, Any]:
    """The child's JSON report of which mechanisms it set up (empty if it died before reporting)."""
    os.set_blocking(status_fd, False)
    try:
        return json.loads(os.read(status_fd, 65536) or b"{}")
    except (OSError, ValueError):
        return {}


def _build_result(
    capture: _CaptureProtocol, exit_code: int | None, timed_out: bool, isolation: dict
) -> SandboxResult:
    tail = capture.stderr_tail.decode("utf-8", errors="replace")
    if "error" in isolation or (not isolation and exit_code == SETUP_FAILED_EXIT_CODE):
        reason = "sandbox setup failed"
    elif timed_out:
        reason = "wall timeout"
    elif exit_code == -signal.SIGXCPU:
        reason = "cpu limit"
    elif exit_code == -signal.SIGXFSZ or (exit_code and "File too large" in tail):
        reason = "file size limit"
    elif exit_code and "MemoryError" in tail:
        reason = "memory limit"
    elif exit_code is not None and exit_code < 0:
        reason = f"killed by {_signal_name(-exit_code)}"
    else:
        reason = None
    return SandboxResult(capture.text(1), capture.text(2), exit_code, timed_out, reason, isolation=isolation)


def _signal_name(number: int) -> str:
    return signal.Signals(number).name if number in set(signal.Signals) else f"signal {number}"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def _belongs_to_run(pid: str, pgid: int, uid: int | None) -> bool:
    """Whether ``pid`` is alive (not a zombie) and in the run's process group or owned by its uid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return False
        if int(fields[2]) == pgid:
            return True
        if uid is None:
            return False
        with open(f"/proc/{pid}/status", "rb") as status_file:
            uid_line = next(line for line in status_file if line.startswith(b"Uid:"))
        return int(uid_line.split()[1]) == uid
    except (OSError, StopIteration, IndexError, ValueError):
        return False


def live_processes_of_run(pgid: int, uid: int | None) -> list[int]:
    """Live processes left by a run: its process group, or anything running as its uid."""
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _belongs_to_run(pid, pgid, uid)]


def _kill_leftovers(pgid: int, uid: int | None, timeout_s: float = 3.0) -> bool:
    """SIGKILL the group and the uid's processes until none is alive; returns whether that happened."""
    deadline = time.monotonic() + timeout_s
    while True:
        _kill_group(pgid)
        survivors = live_processes_of_run(pgid, uid)
        if not survivors:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in survivors:
            try:  # a pidfd pins the process, so a recycled pid is never hit
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _belongs_to_run(str(pid), pgid, uid):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.01)


def _remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
    except OSError:  # the code may have removed permissions from its own directories
        for root, directories, _ in os.walk(path):
            for name in directories:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(root, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)
