"""A watchdog process that kills what a driver started once the driver is gone, however it ended.

Why: when the driver that started a local Ray instance is killed (SIGKILL, the OOM killer), Ray's
GCS and raylet die with it (Ray gives them ``PR_SET_PDEATHSIG``), but the raylet's own children, the
dashboard agent and the runtime-env agent, only notice about a minute later: each sees its raylet
gone within ~2 s, then blocks up to 60 s reporting the death to the GCS that died too. The driver
cannot clean up after itself when it is killed, so a small separate process does.

``Reaper.start()`` spawns ``python -m hybridflow.utils.process_reaper <driver pid>`` holding the read
end of a pipe whose write end only the driver holds. The reaper records the driver's descendants
(``/proc``; every :data:`SCAN_INTERVAL_S` seconds), ignores SIGINT/SIGTERM (a Ctrl-C to the terminal's
process group must not take it down first), and when the pipe closes it SIGKILLs every recorded
process that is still alive (matched by start time, so a reused pid is never hit) but no longer below
the driver: after the driver died, all of them; after :meth:`Reaper.close` from a live driver (once
``ray.shutdown()`` returned), only the orphans that outlived their parent, never a child the driver
still owns. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

SCAN_INTERVAL_S = 2.0
# PF_EXITING in /proc/<pid>/stat's flags: set as a task starts to exit, before its open files are
# closed (which is what wakes the reaper) and before its children are re-parented
PF_EXITING = 0x4


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of ``pid``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def exiting_or_gone(pid: int) -> bool:
    """Whether ``pid`` has started to exit (or is a zombie, or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & PF_EXITING)


def descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of every process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = _stat(int(name))
            if info is not None:
                children.setdefault(info[0], []).append(int(name))
                starts[int(name)] = info[1]
    found, stack = {}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found[child] = starts[child]
                stack.append(child)
    return found


def kill_recorded(recorded: dict[int, int], spare: int) -> list[int]:
    """SIGKILL each recorded process that still runs with the same start time; returns the pids."""
    killed = []
    for pid, start in recorded.items():
        info = _stat(pid)
        if pid != spare and info is not None and info[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed


def watch(driver: int, pipe_fd: int) -> None:
    """The reaper's loop: record ``driver``'s descendants until ``pipe_fd`` reaches EOF, then kill them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    me = os.getpid()
    recorded: dict[int, int] = {}
    while True:
        recorded.update(descendants(driver))
        ready, _, _ = select.select([pipe_fd], [], [], SCAN_INTERVAL_S)
        if ready and not os.read(pipe_fd, 1024):
            break
    # A killed driver's pipe closes while it is still exiting: its children are not re-parented yet
    # and would look owned. Once it has started to exit, nothing is owned.
    owned = {} if exiting_or_gone(driver) else descendants(driver)
    kill_recorded({pid: start for pid, start in recorded.items() if owned.get(pid) != start}, spare=me)


class Reaper:
    """The driver's handle: ``start()`` after starting Ray, ``close()`` after shutting it down."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self._write_fd: int | None = None

    def start(self) -> Reaper:
        if not os.path.isdir("/proc") or self.process is not None:
            return self
        read_fd, write_fd = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hybridflow.utils.process_reaper", str(os.getpid()), str(read_fd)],
            pass_fds=(read_fd,),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # out of the terminal's process group: Ctrl-C does not reach it
        )
        os.close(read_fd)
        self._write_fd = write_fd  # not inherited by exec'd children (os.pipe is close-on-exec)
        if hasattr(os, "register_at_fork"):  # nor by forked ones (prime's reward workers)
            os.register_at_fork(after_in_child=self._forget_in_child)
        return self

    def _forget_in_child(self) -> None:
        if self._write_fd is not None:
            try:
                os.close(self._write_fd)
            except OSError:
                pass
            self._write_fd, self.process = None, None

    def close(self, timeout_s: float = 10.0) -> None:
        """After ``ray.shutdown()``: have the reaper kill the processes that outlived their parent
        (Ray's agents) and wait for it."""
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        if self.process is not None:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
            self.process = None


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
