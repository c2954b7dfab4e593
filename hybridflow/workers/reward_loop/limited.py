"""``rate_limited`` (alias ``limited``): verl's rate-limited reward-loop manager, for judges behind an API.

Three limits, shared by every instance in the process (class-level, as verl's):

- ``reward_model.max_concurrent`` (default 1): scorer calls running at once (an ``asyncio.Semaphore``);
- ``reward_model.max_rpm``: requests per minute, an :class:`AsyncTokenBucket` of ``max_rpm / 60`` per s;
- ``reward_model.max_tpm`` with ``estimated_tokens_per_request`` (2000): tokens per minute, each request
  taking its estimate from a bucket of ``max_tpm / 60`` per s.

The buckets are passed before the semaphore is taken. They are per event loop: used from another loop
(the validation RewardLoop's, a second run's) they are made anew for it. Each call is limited to
``reward_model.timeout`` seconds (300). As verl: a timeout scores 0.0 with ``timeout=True`` and
``acc=0.0``, an exception 0.0 with ``error=<message>``, and the batch goes on. Ours besides:
``reward_model.max_retries`` (default 0, verl's behaviour) re-runs a failed call that many times; the
first failure of each kind is logged with the sample; :attr:`failures` counts failures by kind
(``timeout``, ``error``) and :attr:`retries` the retries, which the reward loop reports as metrics.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter

from hybridflow.protocol import DataProto
from hybridflow.workers.reward_loop.base import RewardManagerBase
from hybridflow.workers.reward_loop.registry import register
from hybridflow.workers.reward_loop.token_bucket import AsyncTokenBucket
from hybridflow.workers.reward_manager.dapo import cfg_get
from hybridflow.workers.reward_manager.naive import _parse
from hybridflow.workers.reward_manager.timeouts import ScoreTimeout

logger = logging.getLogger(__name__)


def _rm(config) -> dict:
    return cfg_get(config, "reward_model") or {}


@register("rate_limited", "limited")
class RateLimitedRewardManager(RewardManagerBase):
    """Rate-limited scoring (module docstring)."""

    _semaphore: asyncio.Semaphore | None = None
    _max_concurrent: int | None = None
    _rpm_limiter: AsyncTokenBucket | None = None
    _max_rpm: float | None = None
    _tpm_limiter: AsyncTokenBucket | None = None
    _max_tpm: float | None = None
    _estimated_tokens_per_request: int | None = None
    _class_initialized = False
    _loop_ref = None  # weakref to the event loop the limiters belong to
    failures: Counter = Counter()  # class-level: kind -> samples scored 0 after failing
    retries: int = 0
    _logged_kinds: set = set()

    @classmethod
    def init_class(cls, config, tokenizer) -> None:
        rm = _rm(config)
        if cls._class_initialized:
            incoming = (cfg_get(rm, "max_rpm"), cfg_get(rm, "max_tpm"))
            if incoming != (cls._max_rpm, cls._max_tpm) and any(
                v is not None for v in (*incoming, cls._max_rpm, cls._max_tpm)
            ):
                logger.warning(
                    "RateLimitedRewardManager has already been initialized and its rate limiters are shared "
                    "globally across instances. The incoming (max_rpm/max_tpm) settings will be ignored. "
                    f"Existing: max_rpm={cls._max_rpm}, max_tpm={cls._max_tpm}. "
                    f"Incoming: max_rpm={incoming[0]}, max_tpm={incoming[1]}."
                )
            return
        cls._max_concurrent = int(cfg_get(rm, "max_concurrent", 1) or 1)
        if cls._max_concurrent < 1:
            raise ValueError(f"reward_model.max_concurrent must be >= 1, got {cls._max_concurrent}")
        cls._semaphore = asyncio.Semaphore(cls._max_concurrent)
        cls._max_rpm = cfg_get(rm, "max_rpm")
        cls._rpm_limiter = AsyncTokenBucket(cls._max_rpm / 60.0) if cls._max_rpm is not None else None
        cls._max_tpm = cfg_get(rm, "max_tpm")
        cls._estimated_tokens_per_request = int(cfg_get(rm, "estimated_tokens_per_request", 2000) or 2000)
        cls._tpm_limiter = AsyncTokenBucket(cls._max_tpm / 60.0) if cls._max_tpm is not None else None
        cls.failures, cls.retries, cls._logged_kinds = Counter(), 0, set()
        logger.info(
            "reward loop rate limits: %d at once, %s rpm, %s tpm (%d tokens a request)",
            cls._max_concurrent, cls._max_rpm, cls._max_tpm, cls._estimated_tokens_per_request,
        )  # fmt: skip
        cls._class_initialized = True

    @classmethod
    def reset_class(cls) -> None:
        """Forget the shared limiters (a new run in the same process, or a new event loop)."""
        cls._class_initialized = False
        cls._semaphore = cls._rpm_limiter = cls._tpm_limiter = None
        cls._loop_ref = None

    def __init__(
        self,
        config=None,
        tokenizer=None,
        compute_score=None,
        reward_router_address=None,
        reward_model_tokenizer=None,
        num_examine: int | None = None,  # verl's legacy batch-manager signature: accepted, unused
        reward_fn_key: str | None = None,
        **kwargs,
    ) -> None:
        if config is None:
            config = {"reward_model": {}}
        if tokenizer is None:
            raise TypeError("RateLimitedRewardManager requires `tokenizer`.")
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)
        rm = _rm(config)
        self.timeout = float(cfg_get(rm, "timeout", 300.0) or 300.0)
        self.max_retries = int(cfg_get(rm, "max_retries", 0) or 0)

    @classmethod
    def _bind_to_running_loop(cls) -> None:
        """asyncio's semaphore and locks belong to one event loop: used from another (the validation
        RewardLoop's, or a second run's in the same process) the limiters are made anew for it."""
        loop = asyncio.get_running_loop()
        bound = cls._loop_ref() if cls._loop_ref is not None else None
        if bound is not None and bound is not loop:
            cls._semaphore = asyncio.Semaphore(cls._max_concurrent)
            cls._rpm_limiter = AsyncTokenBucket(cls._max_rpm / 60.0) if cls._max_rpm is not None else None
            cls._tpm_limiter = AsyncTokenBucket(cls._max_tpm / 60.0) if cls._max_tpm is not None else None
        cls._loop_ref = weakref.ref(loop)

    async def _limited_call(self, sample):
        self._bind_to_running_loop()
        if self._rpm_limiter is not None:
            await self._rpm_limiter.acquire(1.0)
        if self._tpm_limiter is not None:
            await self._tpm_limiter.acquire(float(self._estimated_tokens_per_request))
        async with self._semaphore:
            return await self.call_score(sample, self.timeout)

    async def run_single(self, data: DataProto) -> dict:
        sample = self.sample(data)
        for attempt in range(self.max_retries + 1):
            outcome = await self._limited_call(sample)
            score, extras, problem = _parse(outcome)
            if problem is None:
                extras = {**outcome.result} if isinstance(outcome.result, dict) else {"acc": score}  # verl's
                return {"reward_score": score, "reward_extra_info": extras}
            if attempt < self.max_retries:
                type(self).retries += 1
        kind = "timeout" if isinstance(outcome.error, ScoreTimeout) else "error"
        type(self).failures[kind] += 1
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            logger.warning(
                "reward computation %s for data_source=%s (scored 0.0; later %ss are counted, not logged): "
                "%s; response[:100]=%r",
                "timed out" if kind == "timeout" else "failed", sample.data_source, kind, problem,
                sample.response_str[:100],
            )  # fmt: skip
        extras = {"timeout": True} if kind == "timeout" else {"error": problem}
        return {"reward_score": 0.0, "reward_extra_info": {**extras, "acc": 0.0}}
