"""The PRIME reward manager: samples scored in parallel worker processes, each with a timeout.

Slow or hanging verifiers (sympy, code execution) must not stall training. Each sample runs in a
``concurrent.futures.ProcessPoolExecutor`` worker under a ``SIGALRM`` timer of ``timeout_s``
seconds, which interrupts a scorer stuck in Python code; a sample that times out scores 0 and is
counted in extra info ``timed_out`` (1/0 per sample). As a backstop for scorers stuck in C code,
the whole batch gets ``timeout_s * ceil(B / num_processes) + BACKSTOP_GRACE_S``; samples still
pending then also count as timed out, and the pool's processes are killed.

``compute_score`` must be picklable (a module-level function) to reach the workers.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import pickle
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor, wait
from typing import Any

from hybridflow.workers.reward_manager.naive import RewardManagerBase, RewardSample, ScoreOutcome
from hybridflow.workers.reward_manager.registry import register_reward_manager

logger = logging.getLogger(__name__)

BACKSTOP_GRACE_S = 10.0  # worker start-up and pickling on top of the per-sample budget


class _SampleTimeout(Exception):
    """Raised inside a worker by the SIGALRM handler."""


def _raise_timeout(signum, frame) -> None:
    raise _SampleTimeout


def _score_in_worker(compute_score, kwargs: dict, timeout_s: float | None) -> tuple[bool, Any]:
    """Runs in a worker: ``(timed_out, result)``; scorer exceptions propagate to the future."""
    use_alarm = (
        timeout_s is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not use_alarm:
        return False, compute_score(**kwargs)
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            return False, compute_score(**kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    except _SampleTimeout:  # also catches an alarm landing between the return and the timer reset
        return True, None


@register_reward_manager("prime")
class PrimeRewardManager(RewardManagerBase):
    """Parallel per-sample scoring with ``num_processes`` workers and a per-sample ``timeout_s``."""

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score=None,
        reward_fn_key: str = "data_source",
        on_score_error: str = "raise",
        num_processes: int = 4,
        timeout_s: float | None = 300.0,
        mp_context: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, on_score_error, **kwargs)
        if num_processes < 1:
            raise ValueError(f"prime reward manager: num_processes must be >= 1, got {num_processes}")
        try:
            pickle.dumps(self.compute_score)
        except Exception as exc:
            raise TypeError(
                "prime reward manager: compute_score must be picklable (a module-level function) to run "
                f"in worker processes; got {self.compute_score!r}"
            ) from exc
        self.num_processes = num_processes
        self.timeout_s = timeout_s
        self.mp_context = mp_context  # None: the platform default start method

    def _job(self, sample: RewardSample) -> dict:
        return dict(
            data_source=sample.data_source,
            solution_str=sample.response_str,
            ground_truth=sample.ground_truth,
            extra_info=sample.extra_info,
            **self.score_kwargs,
        )

    def _backstop_s(self, n: int, workers: int) -> float | None:
        if self.timeout_s is None:
            return None
        return self.timeout_s * math.ceil(n / workers) + BACKSTOP_GRACE_S

    def score_samples(self, samples: list[RewardSample]) -> tuple[list[ScoreOutcome], dict[str, list]]:
        if not samples:
            return [], {"timed_out": []}
        workers = min(self.num_processes, len(samples))
        context = multiprocessing.get_context(self.mp_context)
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=context)
        pending: set[Future] = set()
        try:
            futures = [
                pool.submit(_score_in_worker, self.compute_score, self._job(s), self.timeout_s)
                for s in samples
            ]
            _, pending = wait(futures, timeout=self._backstop_s(len(samples), workers))
            outcomes, timed_out = zip(*(_collect(f, f in pending) for f in futures), strict=True)
        finally:
            _shutdown(pool, kill=bool(pending))
        if any(timed_out):
            n_late = sum(timed_out)
            logger.warning(
                "prime: %d of %d samples timed out after %ss, scored 0", n_late, len(samples), self.timeout_s
            )
        return list(outcomes), {"timed_out": list(timed_out)}


def _collect(future: Future, pending: bool) -> tuple[ScoreOutcome, int]:
    """``(outcome, timed_out)`` for one future; a timeout scores 0 and is not a scoring error."""
    if pending:
        return ScoreOutcome(result=0.0), 1
    try:
        was_timeout, result = future.result()
    except Exception as exc:  # the scorer raised, or its worker died (BrokenProcessPool)
        return ScoreOutcome(error=exc), 0
    return (ScoreOutcome(result=0.0), 1) if was_timeout else (ScoreOutcome(result=result), 0)


def _shutdown(pool: ProcessPoolExecutor, kill: bool) -> None:
    """Close the pool; with ``kill``, terminate workers still stuck in a scorer."""
    if not kill:
        pool.shutdown(wait=True)
        return
    processes = list(getattr(pool, "_processes", {}).values())  # private, but the only handle on workers
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()
    for process in processes:
        process.join(timeout=5)
