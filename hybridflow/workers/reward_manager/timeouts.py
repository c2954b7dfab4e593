"""Time limits for user reward functions: in the driver (``naive``, ``dapo``, ``batch``) and in the
``prime`` manager's worker processes.

``call_with_time_limit(fn, seconds, describe)`` runs ``fn()`` and raises :class:`ScoreTimeout` when it
runs past ``seconds``. How the call is stopped depends on where it runs:

- **the main thread** (the driver's fit loop, validation): a watchdog thread sends the main thread a
  private real-time signal at the deadline (``SIGRTMIN + 2``, not ``SIGALRM``: scorers such as math
  graders use ``signal.alarm`` for their own limits), whose handler raises ``ScoreTimeout`` inside the
  scorer. That stops Python loops, ``time.sleep``, blocking reads and lock waits. ``ScoreTimeout`` is a
  ``BaseException``, so a scorer's ``except Exception`` cannot swallow it.
- **code that never returns to the interpreter** (a C extension in a loop, signals blocked): nothing
  can stop it inside this process. After the deadline plus :data:`NATIVE_HANG_GRACE_S` (and a second
  signal) the watchdog ends the process with exit code :data:`EXIT_SCORER_HUNG` and one line naming the
  sample, so training never hangs forever. The ``prime`` manager runs each sample in a worker process it
  can kill, and survives such scorers.
- **any other thread** (the agent loops' scoring as samples finish, and any scorer run off the event
  loop): the call runs in a helper daemon thread and the caller stops waiting at the deadline. A
  Python thread cannot be killed, so a helper still running then is *stuck*: it is counted
  (:func:`stuck_scorers`, reported as the ``agent_loop/stuck_scorers`` metric), a warning names the
  limit and the count, and at most :data:`MAX_STUCK_SCORERS` may exist in a process — the call after
  that starts no thread and raises :class:`ScorersStuck`, which ends the run naming what is stuck
  (a scorer that hangs that often needs ``reward_model.reward_manager=prime``, whose worker processes
  are killed at the limit). A stuck helper that returns later stops counting.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

NATIVE_HANG_GRACE_S = 10.0  # after the deadline: time for the signal to land before the process ends
EXIT_SCORER_HUNG = 124  # the exit code of `timeout(1)`: a reward function could not be stopped
TIMEOUT_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else signal.SIGALRM


MAX_STUCK_SCORERS = 8  # scorer threads past their limit and still running, per process


class ScoreTimeout(BaseException):  # noqa: N818  (an interrupt, like KeyboardInterrupt)
    """A reward function ran past its time limit; ``str()`` says which limit."""


class ScorersStuck(BaseException):  # noqa: N818  (not a scorer's error: no manager may zero it)
    """:data:`MAX_STUCK_SCORERS` scorer threads are stuck past their limit in this process: no more
    are started. A ``BaseException``, so a reward manager's error handling (which scores a failed
    sample 0 with ``on_score_error=zero``) lets it through and the run ends."""


def remaining(deadline: float | None) -> float | None:
    """Seconds left until the ``time.monotonic()`` deadline (None: no deadline)."""
    return None if deadline is None else deadline - time.monotonic()


def effective_limit(per_call_s: float | None, deadline: float | None) -> tuple[float | None, bool]:
    """``(seconds, from_batch)``: the tighter of a per-call limit and the batch deadline, and whether the
    batch deadline is the one that binds."""
    left = remaining(deadline)
    if left is not None and (per_call_s is None or left < per_call_s):
        return left, True
    return per_call_s, False


class _Call:
    """The main-thread call the watchdog guards."""

    def __init__(self, seconds: float, describe: Callable[[], str], message: str, exit_on_hang: bool) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds, self.describe, self.message = seconds, describe, message
        self.exit_on_hang = exit_on_hang
        self.running = True
        self.signalled = 0  # timeout signals sent so far


class _Watchdog:
    """One daemon thread that signals the main thread when the guarded call passes its deadline."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.call: _Call | None = None
        self.thread: threading.Thread | None = None

    def arm(self, call: _Call) -> None:
        with self.cond:
            self.call = call
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="reward-timeout-watchdog", daemon=True)
                self.thread.start()
            self.cond.notify()

    def disarm(self, call: _Call) -> None:
        with self.cond:
            call.running = False
            if self.call is call:
                self.call = None
            self.cond.notify()

    def _run(self) -> None:
        with self.cond:
            while True:
                call = self.call
                if call is None:
                    self.cond.wait()
                    continue
                due = call.deadline + call.signalled * NATIVE_HANG_GRACE_S / 2
                wait = due - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                if call.signalled < 2:  # a second signal: the first may have landed in a user handler
                    call.signalled += 1
                    signal.pthread_kill(threading.main_thread().ident, TIMEOUT_SIGNAL)
                    continue
                if call.exit_on_hang:
                    _exit_hung(call)
                self.call = None  # someone else (prime's parent process) kills this process


def _reset_after_fork() -> None:
    """A forked child (prime's pool workers) starts with no watchdog thread and unlocked state."""
    global _WATCHDOG, _active
    _WATCHDOG, _active = _Watchdog(), None


_WATCHDOG = _Watchdog()
_active: _Call | None = None  # the main-thread call the timeout signal interrupts
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _exit_hung(call: _Call) -> None:
    """The scorer ignored two timeout signals: it is stuck where Python cannot reach it."""
    try:
        sample = call.describe()
    except Exception as err:  # describing must not stop the exit
        sample = f"(could not describe the sample: {err})"
    print(
        f"hybridflow: error: a reward function is stuck in native code: {call.message}, and "
        f"{NATIVE_HANG_GRACE_S:.0f}s later it still had not returned to Python, so it cannot be interrupted "
        f"in this process; ending the run (exit code {EXIT_SCORER_HUNG}). {sample}. Use "
        "reward_model.reward_manager=prime to score each sample in a worker process that can be killed.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_SCORER_HUNG)


def _on_timeout_signal(signum, frame) -> None:
    call = _active
    if call is not None and call.running:  # a late signal after the call returned is ignored
        raise ScoreTimeout(call.message)


def call_with_time_limit(
    fn: Callable[[], Any],
    seconds: float | None,
    message: str,
    describe: Callable[[], str] = lambda: "",
    exit_on_hang: bool = True,
) -> Any:
    """``fn()``, or :class:`ScoreTimeout` (``str()`` = ``message``) once it has run ``seconds``.

    ``seconds=None``: no limit; ``seconds <= 0``: the time is already up (``fn`` is not called).
    ``describe()`` names the sample in the one line printed if the process has to end (native hang);
    ``exit_on_hang=False`` leaves a native hang to whoever owns this process (prime's pool workers).
    """
    global _active
    if seconds is None:
        return fn()
    if seconds <= 0:
        raise ScoreTimeout(message)
    if threading.current_thread() is not threading.main_thread():
        return _call_in_thread(fn, seconds, message, describe)
    if _active is not None:  # a scorer that itself calls a managed scorer: the outer limit guards both
        return fn()
    call = _Call(seconds, describe, message, exit_on_hang)
    if signal.getsignal(TIMEOUT_SIGNAL) is not _on_timeout_signal:
        # installed once and kept: restoring the default action could let a signal sent just before
        # the call ended terminate the process (the default action of a real-time signal)
        signal.signal(TIMEOUT_SIGNAL, _on_timeout_signal)
    _active = call
    try:
        _WATCHDOG.arm(call)
        return fn()
    finally:
        _WATCHDOG.disarm(call)
        _active = None


_stuck_lock = threading.Lock()
_stuck: dict[threading.Thread, str] = {}  # scorer helper threads past their limit -> the limit's message


def stuck_scorers() -> int:
    """Scorer threads of this process that ran past their time limit and are still running."""
    with _stuck_lock:
        return len(_stuck)


def _call_in_thread(
    fn: Callable[[], Any], seconds: float, message: str, describe: Callable[[], str] = lambda: ""
) -> Any:
    """Off the main thread no signal can interrupt ``fn``: run it in a daemon thread, stop waiting at
    the deadline, and count the thread as stuck while it runs on (at most :data:`MAX_STUCK_SCORERS`)."""
    with _stuck_lock:
        if len(_stuck) >= MAX_STUCK_SCORERS:
            first = next(iter(_stuck.values()))
            raise ScorersStuck(
                f"{len(_stuck)} scorer threads are stuck past their time limit in this process (first: "
                f"{first}) and cannot be stopped; no more are started (at most MAX_STUCK_SCORERS="
                f"{MAX_STUCK_SCORERS}). Fix the reward function, or use reward_model.reward_manager=prime "
                "(worker processes, killed at the limit)"
            )
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # handed to the caller below
            box["error"] = err
        finally:
            with _stuck_lock:
                box["done"] = True
                _stuck.pop(threading.current_thread(), None)

    thread = threading.Thread(target=target, name="reward-scorer", daemon=True)
    thread.start()
    thread.join(seconds)
    with _stuck_lock:
        stuck = "done" not in box  # decided under the lock the thread's end takes too
        if stuck:
            _stuck[thread] = message
        count = len(_stuck)
    if stuck:
        try:
            where = describe()
        except Exception as err:  # describing must not hide the timeout
            where = f"(could not describe the sample: {err})"
        with _stuck_lock:
            if thread in _stuck and where:
                _stuck[thread] = where
    if stuck:
        logger.warning(
            "%s; the scorer's thread cannot be stopped and keeps running (%d stuck in this process, at "
            "most %d)",
            message,
            count,
            MAX_STUCK_SCORERS,
        )
        raise ScoreTimeout(message)
    if "error" in box:
        raise box["error"]
    return box.get("result")
