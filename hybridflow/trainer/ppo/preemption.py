"""Stopping cleanly on SIGTERM / SIGINT (what a scheduler sends before it kills a job; Ctrl-C).

The first signal asks the driver to stop: the step in progress finishes (validation due at it is
skipped), a checkpoint of it is written when ``trainer.save_on_preempt`` (the default), the workers
and Ray are shut down, and the process exits with ``128 + signal`` (143 for SIGTERM, 130 for SIGINT),
the code a shell reports for a process stopped by that signal. A second signal abandons the step at
once: nothing more is saved, and the last complete checkpoint stays the one a resume finds. A rerun
with ``trainer.resume_mode=auto`` continues after the saved step.

Allow the scheduler's grace period a step plus a save; past it the scheduler's SIGKILL ends the run
and the previous checkpoint is kept.
"""

from __future__ import annotations

import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingPreempted(BaseException):  # noqa: N818  (an interrupt, like KeyboardInterrupt)
    """The run stopped on a signal; ``exit_code`` is ``128 + signum``. A BaseException, so no
    ``except Exception`` on the way (a scorer, a save) can swallow it."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, abandoned: bool) -> None:
        self.signum, self.step, self.checkpoint, self.abandoned = signum, step, checkpoint, abandoned
        super().__init__(self.message())

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)

    def message(self) -> str:
        name = signal.Signals(self.signum).name
        how = "abandoned the step in progress" if self.abandoned else f"stopped after step {self.step}"
        kept = f"the checkpoint a resume finds is {self.checkpoint}" if self.checkpoint else "no checkpoint"
        return f"{name}: {how}; {kept}; rerun with trainer.resume_mode=auto to continue"


class StopRequest:
    """While entered (in the main thread), SIGTERM/SIGINT set :attr:`signum` instead of killing the
    process; a second one raises :class:`TrainingPreempted` wherever the driver is."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._shielded = False

    def shield(self) -> None:
        """From now on signals are only noted: the driver is already cleaning up to exit."""
        self._shielded = True

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if self._shielded:
            self.signum = self.signum or signum
            print(f"hybridflow: {signal.Signals(signum).name}: already shutting down", file=sys.stderr)
            return
        if self.signum is None:
            self.signum = signum
            print(
                f"hybridflow: {signal.Signals(signum).name} received: finishing the current step, then "
                "stopping (with a checkpoint unless trainer.save_on_preempt=false); send it again to stop "
                "at once",
                file=sys.stderr,
                flush=True,
            )
            return
        raise TrainingPreempted(signum, step=-1, checkpoint=None, abandoned=True)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # handlers live in the main thread
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
