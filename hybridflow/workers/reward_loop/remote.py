"""``remote``: verl's reward-loop manager for CPU-heavy synchronous scorers, each call in a Ray worker
process (verl's ``RewardComputeWorker``): a scorer that holds the GIL (math-verify, a sympy check) or is
not thread-safe runs beside the others instead of in the loop's threads.

- ``reward_model.num_workers`` processes per manager (verl's key); a process scores one call at a time,
  and a call waits here, not in Ray's queue, until one is free (the first free one takes it);
- each call limited to ``reward_model.score_timeout_s`` from the moment a process takes it: neither the
  wait for a free process nor a process's start is counted (verl's own manager has no limit at all; with
  the limit started at submission, the 300th of 512 one-second samples on one process timed out). A
  process past the limit is killed (a process, unlike a thread, can be) and replaced, and the sample's
  outcome is a timeout; no other call was queued on it, so none fails with it;
- outcomes as ``naive``'s (:func:`~.naive.resolve_one`): a float is the score and ``acc``, a dict gives
  ``score`` and extras; a failure raises naming the sample, or with ``on_score_error=zero`` scores 0;
- ``async def`` reward functions are refused (verl asserts the same): they belong on the loop
  (``naive``/``limited``).

The workers hold no accelerator and ask Ray for no CPU (``num_cpus=0``, as the agent-loop workers here):
on a small machine the trainer's workers hold the logical CPUs.
"""

from __future__ import annotations

import asyncio

from hybridflow.protocol import DataProto
from hybridflow.workers.reward_loop.base import RewardManagerBase
from hybridflow.workers.reward_loop.naive import resolve_one
from hybridflow.workers.reward_loop.registry import register
from hybridflow.workers.reward_manager.dapo import cfg_get
from hybridflow.workers.reward_manager.naive import ScoreOutcome
from hybridflow.workers.reward_manager.timeouts import ScoreTimeout

START_TIMEOUT_S = 120.0  # a scoring process's start (not counted in score_timeout_s)


class RewardComputeWorker:
    """One scoring process (a Ray actor): ``compute_score`` called with verl's keyword arguments."""

    def __init__(self, compute_score) -> None:
        self.compute_score = compute_score

    def ready(self) -> bool:
        return True

    def score(self, **kwargs):
        import os

        result = self.compute_score(**kwargs)
        return result, os.getpid()


@register("remote")
class RemoteRewardManager(RewardManagerBase):
    """Scoring in Ray worker processes (module docstring)."""

    def __init__(
        self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None
    ):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        if self.is_async_reward_score:
            raise ValueError(
                "reward_model.reward_manager=remote runs synchronous reward functions in worker processes; "
                "an async compute_score is not supported there (verl's rule): use naive or limited"
            )
        self.num_workers = int(cfg_get(cfg_get(config, "reward_model") or {}, "num_workers", 1) or 1)
        self.workers = [self._new_worker() for _ in range(self.num_workers)]
        self._started = [False] * self.num_workers  # a process's start is not counted in a call's limit
        self._free: asyncio.Queue | None = None  # indices of the idle processes, on the loop that uses them
        self._free_loop: asyncio.AbstractEventLoop | None = None
        self.pids: set[int] = set()  # the processes that scored (what a test checks)

    def _new_worker(self):
        import ray

        actor = ray.remote(num_cpus=0)(RewardComputeWorker)
        return actor.remote(self.compute_score)

    async def _take_worker(self) -> int:
        """The index of an idle process, waiting for one (the queue follows the event loop using it)."""
        loop = asyncio.get_running_loop()
        if self._free is None or self._free_loop is not loop:
            self._free, self._free_loop = asyncio.Queue(), loop
            for index in range(self.num_workers):
                self._free.put_nowait(index)
        return await self._free.get()

    async def _call(self, kwargs: dict) -> ScoreOutcome:
        index = await self._take_worker()
        try:
            return await self._call_on(index, kwargs)
        finally:
            self._free.put_nowait(index)

    async def _call_on(self, index: int, kwargs: dict) -> ScoreOutcome:
        import ray

        if not self._started[index]:
            ping = self.workers[index].ready.remote()
            try:
                await asyncio.wait_for(asyncio.wrap_future(ping.future()), START_TIMEOUT_S)
            except (TimeoutError, ray.exceptions.RayError) as error:
                return ScoreOutcome(
                    error=RuntimeError(f"remote scoring process {index} did not start: {error!r}")
                )
            self._started[index] = True
        ref = self.workers[index].score.remote(**kwargs)
        try:
            result, pid = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.score_timeout_s)
        except TimeoutError:
            ray.kill(self.workers[index])  # the hung process goes; its turn gets a fresh one
            self.workers[index], self._started[index] = self._new_worker(), False
            return ScoreOutcome(
                error=ScoreTimeout(f"remote scorer timed out after {self.score_timeout_s:g}s")
            )
        except ray.exceptions.RayTaskError as error:  # the scorer raised: its own exception
            return ScoreOutcome(error=error.cause if isinstance(error.cause, Exception) else error)
        except ray.exceptions.RayError as error:  # the process died: a fresh one for the next call
            self.workers[index], self._started[index] = self._new_worker(), False
            return ScoreOutcome(error=error)
        self.pids.add(pid)
        return ScoreOutcome(result=result)

    async def run_single(self, data: DataProto) -> dict:
        sample = self.sample(data)
        kwargs = {
            "data_source": sample.data_source,
            "solution_str": sample.response_str,
            "ground_truth": sample.ground_truth,
            "extra_info": sample.extra_info,
            **self.score_kwargs_for_call(),
        }
        outcome = await self._call(kwargs)
        score, extras = resolve_one(sample, outcome, self.on_score_error)
        return {"reward_score": score, "reward_extra_info": extras}
