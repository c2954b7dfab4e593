"""Finished rollout groups between the rollouter and the trainer, handed over oldest first.

A group is one prompt with its ``rollout.n`` responses (verl's fully-async "sample"), scored and ready
to train. The rollouter admits groups in data order and numbers them (``seq``); they may finish in any
order, but :meth:`GroupQueue.take` hands the trainer the next groups *by number*: a long group that is
still generating holds the ones behind it, so training never favours the groups that finish fast (no
bias toward short responses), and the admission bound (:mod:`.rollouter`) is what bounds staleness —
no finished group is ever dropped. The queue holds at most ``capacity`` groups; a rollouter with more
to put waits.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from hybridflow.protocol import DataProto


class RolloutStopped(RuntimeError):
    """The rollouter failed or stopped; the message says why."""


@dataclass
class RolloutGroup:
    """One prompt's responses. ``versions``: per response, ``[[parameter version, tokens], ...]`` in the
    order the tokens were generated (several spans when the group was aborted and resumed)."""

    seq: int
    batch: DataProto
    admitted_version: int
    versions: list[list[list[int]]] = field(default_factory=list)
    preempted: int = 0  # how often the group was aborted and resumed

    @property
    def oldest_version(self) -> int:
        spans = [span[0] for row in self.versions for span in row]
        return min(spans) if spans else self.admitted_version

    @property
    def version_span(self) -> int:
        """Newest minus oldest parameter version among the group's tokens."""
        spans = [span[0] for row in self.versions for span in row]
        return max(spans) - min(spans) if spans else 0


class GroupQueue:
    """Thread-safe: the rollouter (its own thread) puts, the trainer takes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._done: dict[int, RolloutGroup] = {}
        self._next = 0  # the seq the trainer takes next
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def put(self, group: RolloutGroup) -> None:
        """Hand over a finished group; waits while the queue is full."""
        with self._cond:
            while len(self._done) >= self.capacity and group.seq != self._next and self._error is None:
                self._cond.wait(0.5)
            self._done[group.seq] = group
            self._cond.notify_all()

    def take(self, count: int, timeout_s: float | None = None) -> tuple[list[RolloutGroup], float]:
        """The next ``count`` groups in admission order and the seconds waited for them; raises
        :class:`RolloutStopped` if the rollouter failed, TimeoutError after ``timeout_s``."""
        start = time.monotonic()
        wanted = range(self._next, self._next + count)
        with self._cond:
            while not all(seq in self._done for seq in wanted):
                if self._error is not None:
                    raise RolloutStopped(str(self._error)) from self._error
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"no rollout groups {list(wanted)} within {timeout_s:g}s")
                self._cond.wait(0.5)
            groups = [self._done.pop(seq) for seq in wanted]
            self._next += count
            self._cond.notify_all()
        return groups, time.monotonic() - start

    def fail(self, error: BaseException) -> None:
        """The rollouter cannot go on: the trainer's next (or current) :meth:`take` raises ``error``.
        The first failure is kept (later ones are its consequences: groups failing after it)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """The failure :meth:`fail` recorded (None while the rollouter is well)."""
        with self._cond:
            return self._error

    @property
    def taken(self) -> int:
        """Groups handed to the trainer so far."""
        return self._next

    def reset_position(self, taken: int) -> None:
        """A resumed run: the trainer has trained ``taken`` groups already."""
        with self._cond:
            self._next = int(taken)

    def size(self) -> int:
        with self._cond:
            return len(self._done)
