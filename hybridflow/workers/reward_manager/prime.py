"""The PRIME reward manager: samples scored in parallel worker processes, each with a timeout.

Slow or hanging verifiers (sympy, code execution) must not stall training. Each sample runs in a
``concurrent.futures.ProcessPoolExecutor`` worker, limited to ``score_timeout_s`` by the same timeout
signal as the in-process managers (:mod:`.timeouts`), which interrupts a scorer stuck in Python code.
As a backstop for scorers stuck in C code (which no signal reaches), the whole batch gets
``score_timeout_s * ceil(B / num_processes) + BACKSTOP_GRACE_S``, or ``batch_timeout_s`` if that is
shorter; samples still pending then also time out, and the pool's processes are killed. A timed-out
sample is a scoring error like any other: ``RewardScoreError`` naming it, or 0 with
``on_score_error=zero`` (extra info ``timed_out`` marks it).

``compute_score`` must be picklable: a module-level function, or a custom reward function from
``custom_reward_function.path`` (:class:`~.custom.CustomRewardFunction` travels as its file path and
name, and each worker imports the file itself).

verl's module-level helpers are here too, with verl's behaviour: :func:`parallel_compute_score_async`
(and :func:`run_reward_scoring`, its synchronous wrapper) scores rows in a process pool, a row that
raises or outlives ``timeout`` (verl's 300 s) scoring 0.0, every worker process ended afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import pickle
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, wait
from functools import partial
from typing import Any

from hybridflow.workers.reward_manager.naive import (
    RewardManagerBase,
    RewardSample,
    ScoreOutcome,
    timeout_message,
)
from hybridflow.workers.reward_manager.registry import register_reward_manager
from hybridflow.workers.reward_manager.timeouts import ScoreTimeout, call_with_time_limit

logger = logging.getLogger(__name__)

BACKSTOP_GRACE_S = 10.0  # worker start-up and pickling on top of the per-sample budget
VERL_ROW_TIMEOUT_S = 300.0  # verl's per-row limit in parallel_compute_score_async


async def single_compute_score(
    evaluation_func, completion, reference, task, task_extra_info, executor, timeout=VERL_ROW_TIMEOUT_S
):
    """verl's: ``evaluation_func(task, completion, reference, task_extra_info)`` in ``executor``; None
    when it raises or runs past ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    call = partial(evaluation_func, task, completion, reference, task_extra_info)
    try:
        return await asyncio.wait_for(loop.run_in_executor(executor, call), timeout=timeout)
    except TimeoutError:
        logger.warning("prime: a row timed out after %s s: %.80r", timeout, completion)
    except Exception as exc:
        logger.warning("prime: a row failed (%s: %s): %.80r", type(exc).__name__, exc, completion)
    return None


async def parallel_compute_score_async(
    evaluation_func: Callable,
    completions: list[str],
    references: list[Any],
    tasks: list[str],
    extra_info: list | None = None,
    num_processes: int = 64,
    timeout: float = VERL_ROW_TIMEOUT_S,
) -> list[float]:
    """verl's: score every row in a pool of ``num_processes`` processes; a failed or timed-out row is
    0.0, a tuple result its first item, a dict its ``"score"``; the pool's processes are ended
    afterwards (stuck ones too)."""
    extra_info = [None] * len(tasks) if extra_info is None else extra_info
    executor = ProcessPoolExecutor(max_workers=num_processes)
    try:
        rows = zip(completions, references, tasks, extra_info, strict=True)
        results = await asyncio.gather(
            *(single_compute_score(evaluation_func, c, r, t, e, executor, timeout) for c, r, t, e in rows)
        )
    finally:
        _shutdown(executor, kill=True)
    return [_row_score(result) for result in results]


def _row_score(result: Any) -> float:
    if result is None or isinstance(result, Exception):
        return 0.0
    if isinstance(result, int | float | bool):
        return float(result)
    if isinstance(result, dict):  # verl indexes [0] and fails on dict results; their score is meant
        return float(result["score"])
    return float(result[0])


def run_reward_scoring(
    evaluation_func, completions, references, tasks, extra_info=None, num_processes=64
) -> list[float]:
    """verl's synchronous wrapper: :func:`parallel_compute_score_async` on a new event loop."""
    scoring = parallel_compute_score_async(
        evaluation_func, completions, references, tasks, extra_info, num_processes
    )
    return asyncio.run(scoring)


def _score_in_worker(compute_score, kwargs: dict, timeout_s: float | None) -> tuple[bool, Any]:
    """Runs in a worker: ``(timed_out, result)``; scorer exceptions propagate to the future."""
    try:
        return False, call_with_time_limit(
            lambda: compute_score(**kwargs), timeout_s, "timed out", exit_on_hang=False
        )
    except ScoreTimeout:  # pickled back as a flag: the parent words the message
        return True, None


@register_reward_manager("prime")
class PrimeRewardManager(RewardManagerBase):
    """Parallel per-sample scoring with ``num_processes`` workers and a per-sample ``score_timeout_s``."""

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score=None,
        reward_fn_key: str = "data_source",
        on_score_error: str = "raise",
        num_processes: int = 4,
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
                "prime reward manager: compute_score must be picklable (a module-level function or "
                f"custom_reward_function.path) to run in worker processes; got {self.compute_score!r}"
            ) from exc
        self.num_processes = num_processes
        self.mp_context = mp_context  # None: the platform default start method

    def _job(self, sample: RewardSample) -> dict:
        return dict(
            data_source=sample.data_source,
            solution_str=sample.response_str,
            ground_truth=sample.ground_truth,
            extra_info=sample.extra_info,
            **self.score_kwargs,
        )

    def _backstop_s(self, n: int, workers: int) -> tuple[float | None, bool]:
        """``(seconds, from_batch)``: how long to wait for the whole batch, and whether that is
        ``batch_timeout_s`` (rather than the per-sample budget times the rounds of work)."""
        per_sample = None
        if self.score_timeout_s is not None:
            per_sample = self.score_timeout_s * math.ceil(n / workers) + BACKSTOP_GRACE_S
        if self.batch_timeout_s is not None and (per_sample is None or self.batch_timeout_s < per_sample):
            return self.batch_timeout_s, True
        return per_sample, False

    def score_samples(self, samples: list[RewardSample]) -> tuple[list[ScoreOutcome], dict[str, list]]:
        if not samples:
            return [], {}
        workers = min(self.num_processes, len(samples))
        context = multiprocessing.get_context(self.mp_context)
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=context)
        pending: set[Future] = set()
        backstop_s, from_batch = self._backstop_s(len(samples), workers)
        late = timeout_message(self.score_timeout_s, from_batch, self.batch_timeout_s)
        if not from_batch:
            late += " (stuck where no signal reaches it: its worker process was killed)"
        try:
            futures = [
                pool.submit(_score_in_worker, self.compute_score, self._job(s), self.score_timeout_s)
                for s in samples
            ]
            _, pending = wait(futures, timeout=backstop_s)
            outcomes = [self._collect(f, late if f in pending else None) for f in futures]
        finally:
            _shutdown(pool, kill=bool(pending))
        n_late = sum(isinstance(o.error, ScoreTimeout) for o in outcomes)
        if n_late:
            logger.warning("prime: %d of %d samples timed out", n_late, len(samples))
        return outcomes, {}

    def _collect(self, future: Future, late: str | None) -> ScoreOutcome:
        """The outcome of one future; ``late``: the timeout message for a future still pending."""
        if late is not None:
            return ScoreOutcome(error=ScoreTimeout(late))
        try:
            was_timeout, result = future.result()
        except Exception as exc:  # the scorer raised, or its worker died (BrokenProcessPool)
            return ScoreOutcome(error=exc)
        if was_timeout:
            return ScoreOutcome(error=ScoreTimeout(timeout_message(self.score_timeout_s, False, None)))
        return ScoreOutcome(result=result)


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
