"""Wall-clock timing of the named phases of a training step (``timing_s/<phase>`` in the metrics).

``marked_timer`` is verl's helper: every phase of ``fit_step`` runs inside
``with marked_timer("gen", timing_raw): ...`` and the trainer turns ``timing_raw`` into
``timing_s/*`` and ``timing_per_token_ms/*`` metrics (:mod:`hybridflow.trainer.ppo.metric_utils`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Timer", "marked_timer"]


class Timer:
    """A restartable stopwatch on ``time.perf_counter``; also a context manager.

    ``last`` holds the duration of the most recent start/stop interval, ``total`` the sum of all of them.
    """

    def __init__(self) -> None:
        self.last = 0.0
        self.total = 0.0
        self._start: float | None = None

    def start(self) -> Timer:
        if self._start is not None:
            raise RuntimeError("Timer.start: already running")
        self._start = time.perf_counter()
        return self

    def stop(self) -> float:
        """Stop the running interval and return its length in seconds."""
        if self._start is None:
            raise RuntimeError("Timer.stop: not running")
        self.last = time.perf_counter() - self._start
        self.total += self.last
        self._start = None
        return self.last

    @property
    def running(self) -> bool:
        return self._start is not None

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@contextmanager
def marked_timer(name: str, timing_raw: dict[str, float]) -> Iterator[Timer]:
    """Time the ``with`` body and add the seconds to ``timing_raw[name]``.

    A name that repeats within one step (e.g. a phase run once per mini-batch) accumulates. The time is
    recorded even if the body raises, so a failing step still shows where its time went.
    """
    timer = Timer().start()
    try:
        yield timer
    finally:
        timing_raw[name] = timing_raw.get(name, 0.0) + timer.stop()
