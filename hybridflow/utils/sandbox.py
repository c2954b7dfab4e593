"""Run untrusted, model-written Python in a contained child process (Linux only).

``await run_python(code, limits)`` never raises for anything the code does; it always returns a
:class:`SandboxResult`. Many runs may be awaited concurrently on one event loop. The mechanism is Linux
namespaces set up directly by :mod:`._sandbox_child` (``unshare``/``mount``/``pivot_root``/``capset``
through ctypes), so nothing beyond the kernel and the running interpreter is needed. What contains the
code (``result.isolation`` reports what held):

* **Its own filesystem.** A new mount namespace whose root is a read-only tmpfs holding only read-only,
  nosuid binds of /usr (/bin, /lib... as on the host), of the interpreter's prefix and of the
  directories of the libraries it has loaded, a generated /etc (passwd, group, hosts, ld.so.cache,
  localtime), /dev/{null,zero,full,random,urandom}, its own read-only /proc, and one tmpfs of
  ``max_disk_mb`` private to the run behind /sandbox (working directory, HOME), /tmp, /var/tmp and
  /dev/shm. The host's tree is detached (``pivot_root``): /root, /home, /etc/shadow, /run, /sys, the
  host's /tmp and /dev/shm, Ray's session directory and every unix socket of the host do not exist
  there. Files written by the code are gone when the run ends; nothing is written on the host.
* **Its own processes.** A new pid namespace: the code sees only its own processes (its /proc shows
  nothing else), cannot signal or ptrace anything outside, and everything it started is killed by the
  kernel when its main process ends. New IPC, UTS (hostname ``sandbox``) and cgroup namespaces too.
* **No network** (unless ``use_network_namespace=False``): a new network namespace holding only a
  downed loopback, which also hides the host's abstract unix sockets. With the option off, only
  Python-level ``socket`` stubs stand in the way, which ctypes gets around.
* **No privileges.** Every capability set is emptied (bounding set included) and ``no_new_privs`` is
  set, so set-uid binaries and file capabilities grant nothing, also when the parent is root. As root
  (``drop_privileges=True``, the default) the code runs under a fresh uid/gid, different for every
  concurrent run, with no supplementary groups: it owns no file of the host. Not root, the same holds
  inside a user namespace mapping only the caller's uid (needs unprivileged user namespaces).
* **Resource limits** set before the code runs: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE,
  RLIMIT_NPROC (exact per run under the fresh uid), RLIMIT_CORE=0, a wall-clock timeout enforced by the
  parent, and the tmpfs size for all files together.
* **Cleanup of every process**: after the main process exits or times out, the parent SIGKILLs the
  run's process group and every process of the run's uid until none is left (the pid namespace
  already took care of all of them when its init ended).

What it does not do: no seccomp filter, so the whole kernel system-call surface stays reachable
(a kernel bug is an escape); the read-only views of /usr and the interpreter are readable (nothing
secret should live there); /proc still shows host-wide information such as the CPU, memory and kernel
command line; memory and CPU are per-process limits, not a cgroup for the run. If the namespaces cannot
be created (not root and user namespaces disabled, or a container without CAP_SYS_ADMIN) the run fails
closed with ``killed_reason="sandbox setup failed"`` and a message saying why; nothing runs
half-contained. ``drop_privileges=False`` (root only) runs the code as uid 0 without capabilities:
RLIMIT_NPROC then does not apply (a Python-level process count stands in) and files of root on the
read-only views stay readable to it.
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
LOST_STATUS_EXIT_CODE = 255  # what asyncio's child watcher reports for a child reaped by someone else
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
    max_disk_mb: int = 64  # all files the code writes (/sandbox, /tmp, /var/tmp, /dev/shm), in memory
    use_network_namespace: bool = True  # False: only the Python-level socket stubs
    drop_privileges: bool = True  # as root, run the code under a fresh unprivileged uid
    import_site_packages: bool = False  # let the code import (and read) the interpreter's import path


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
    source = code.encode("utf-8")  # a lone surrogate raises here: a sandbox error, nothing runs
    if len(source) > limits.max_file_bytes:
        raise ValueError(f"the code is {len(source)} bytes, more than max_file_bytes={limits.max_file_bytes}")
    # The host directory only carries main.py and the two mount points; the code never sees it.
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-", dir=work_root))
    uid = _allocate_uid() if limits.drop_privileges and os.geteuid() == 0 else None
    status_read = status_write = transport = pgid = None
    swept = all_killed = False
    try:
        with open(os.path.join(workdir, "main.py"), "wb") as source_file:
            source_file.write(source)
        for mount_point in ("root", "scratch"):
            os.mkdir(os.path.join(workdir, mount_point), 0o700)
        status_read, status_write = os.pipe()
        transport, capture = await loop.subprocess_exec(
            lambda: _CaptureProtocol(limits.max_output_bytes, loop),
            *_child_command(limits, workdir, uid, status_write),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=_minimal_environment(),
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
        return _build_result(capture, _exit_code(transport.get_returncode(), timed_out), timed_out, isolation)
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


def _exit_code(returncode: int | None, timed_out: bool) -> int | None:
    """The run's exit code; after our SIGKILL, the kill even when the status was lost.

    asyncio's child watcher reports 255 ("Unknown child process pid") when something else in the host
    process reaped the child first (seen once in CI under pytest-xdist); a run we killed at its wall
    timeout ended by that SIGKILL whatever the watcher could still read.
    """
    if timed_out and returncode == LOST_STATUS_EXIT_CODE:
        return -signal.SIGKILL
    return returncode


def _child_command(limits: SandboxLimits, workdir: str, uid: int | None, status_fd: int) -> list[str]:
    config = {
        "source": "main.py",
        "host_dir": workdir,
        "uid": uid,
        "status_fd": status_fd,
        "network_namespace": limits.use_network_namespace,
        "cpu_time_s": max(1, int(limits.cpu_time_s)),
        "memory_mb": int(limits.memory_mb),
        "max_processes": int(limits.max_processes),
        "max_file_bytes": int(limits.max_file_bytes),
        "max_open_files": int(limits.max_open_files),
        "disk_mb": max(1, int(limits.max_disk_mb)),
        "site_packages": bool(limits.import_site_packages),
    }
    flags = ["-I", "-B", "-X", "utf8"] + ([] if limits.import_site_packages else ["-S"])
    return [sys.executable, *flags, CHILD_SCRIPT, json.dumps(config)]


def _minimal_environment() -> dict[str, str]:
    """The code's environment; the paths are inside the sandbox's own filesystem."""
    locale = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", **locale, "HOME": "/sandbox", "TMPDIR": "/tmp"}


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
