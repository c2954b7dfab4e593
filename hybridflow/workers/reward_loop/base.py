"""What every reward-loop manager shares: one sample decoded, the reward function called (sync or async,
under a time limit), its result parsed.

A manager is built as verl builds it, ``cls(config, tokenizer, compute_score=None,
reward_router_address=None, reward_model_tokenizer=None)`` (``config``: the whole run config), and scores
one sample with ``await run_single(data)`` (``data``: a :class:`DataProto` of one row) →
``{"reward_score": float, "reward_extra_info": dict}``.

The reward function is verl's ``compute_score(data_source, solution_str, ground_truth, extra_info,
**kwargs)``, a plain or an ``async def`` function, told apart by :func:`is_async_function`:

- ``async def``: awaited on the loop, limited by ``asyncio.wait_for``;
- plain: run off the event loop in a thread (the default executor), limited by
  :func:`~hybridflow.workers.reward_manager.timeouts.call_with_time_limit`, whose stuck-scorer bound holds
  (a thread past its limit is counted, and past ``MAX_STUCK_SCORERS`` the run ends naming them).

When a served reward model is configured (``reward_router_address`` is not None) the function also gets
``reward_router_address`` (``host:port`` of the router) and ``reward_model_tokenizer``, as in verl.
``reward_model.reward_kwargs`` reach no call, as in verl's reward loop (a scorer's own arguments go in
``custom_reward_function.reward_kwargs``); the ``dapo`` manager reads its keys there and passes
``strict_box_verify`` as verl's does.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from abc import ABC, abstractmethod
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.utils.reward_score import default_compute_score
from hybridflow.workers.reward_manager.dapo import cfg_get
from hybridflow.workers.reward_manager.naive import (
    DEFAULT_SCORE_TIMEOUT_S,
    RewardSample,
    ScoreOutcome,
    call_scorer,
    check_on_score_error,
    check_timeout,
)
from hybridflow.workers.reward_manager.timeouts import ScoreTimeout


def is_async_function(fn) -> bool:
    """Whether ``fn`` is an ``async def`` function (seen through ``functools.partial`` and a
    :class:`~hybridflow.workers.reward_manager.CustomRewardFunction`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    target = getattr(fn, "target", None)
    if callable(target) and not inspect.iscoroutinefunction(fn):  # CustomRewardFunction.target()
        fn = target()
    call = None if inspect.isroutine(fn) else type(fn).__dict__.get("__call__")  # an object's async __call__
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _row(value, key: str):
    if value is None:
        return None
    return value[0]


def decode_one(data: DataProto, tokenizer, reward_fn_key: str = "data_source") -> RewardSample:
    """The one row of ``data`` as a :class:`RewardSample`: the valid response ids (``responses`` (1, T_r);
    the response part of ``attention_mask``) decoded with ``skip_special_tokens=True``, the prompt when
    ``prompts`` is there, ``reward_model["ground_truth"]``, ``data[reward_fn_key]``, ``extra_info``
    (with ``tool_extra_fields`` merged in, as verl does)."""
    if len(data) != 1:
        raise ValueError(f"a reward-loop manager scores one sample at a time, got {len(data)} rows")
    responses = data.batch["responses"]
    t_r = responses.shape[-1]
    n = int(data.batch["attention_mask"][0, -t_r:].sum())
    response_str = tokenizer.decode(responses[0, :n].tolist(), skip_special_tokens=True)
    prompt_str = ""
    if "prompts" in data.batch.keys():
        prompts = data.batch["prompts"]
        m = int(data.batch["attention_mask"][0, : prompts.shape[-1]].sum())
        prompt_str = tokenizer.decode(prompts[0, prompts.shape[-1] - m :].tolist(), skip_special_tokens=True)
    non_tensor = data.non_tensor_batch
    reward_model = _row(non_tensor.get("reward_model"), "reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise KeyError(f"reward loop: the sample's reward_model has no 'ground_truth': {reward_model!r:.200}")
    extra_info = _row(non_tensor.get("extra_info"), "extra_info")
    extra_info = dict(extra_info) if isinstance(extra_info, dict) else {}
    tool_fields = _row(non_tensor.get("tool_extra_fields"), "tool_extra_fields")
    if isinstance(tool_fields, dict):
        extra_info.update(tool_fields)
    if "__num_turns__" in non_tensor:
        extra_info["num_turns"] = _row(non_tensor["__num_turns__"], "__num_turns__")
    source = non_tensor.get(reward_fn_key)
    return RewardSample(
        index=0,
        data_source=str(source[0]) if source is not None else "unknown",
        prompt_str=prompt_str,
        response_str=response_str,
        ground_truth=reward_model["ground_truth"],
        extra_info=extra_info,
        valid_response_length=n,
    )


class RewardManagerBase(ABC):
    """verl's reward-loop manager base (module docstring). Subclasses implement ``run_single``."""

    _class_initialized = False

    def __init__(
        self,
        config,
        tokenizer,
        compute_score=None,
        reward_router_address: str | None = None,
        reward_model_tokenizer=None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.is_async_reward_score = is_async_function(self.compute_score)
        self.reward_router_address = reward_router_address
        self.reward_model_tokenizer = reward_model_tokenizer
        rm = cfg_get(config, "reward_model") or {}
        self.reward_fn_key = cfg_get(cfg_get(config, "data"), "reward_fn_key", "data_source") or "data_source"
        self.score_timeout_s = check_timeout(
            "score_timeout_s", cfg_get(rm, "score_timeout_s", DEFAULT_SCORE_TIMEOUT_S)
        )
        self.on_score_error = check_on_score_error(cfg_get(rm, "on_score_error", "raise") or "raise")
        self.score_kwargs: dict = {}  # what this manager adds to each call (dapo: strict_box_verify)
        self.init_class(config, tokenizer)

    @classmethod
    def init_class(cls, config, tokenizer) -> None:
        """State shared by every instance of the class in this process (verl's hook)."""
        cls._class_initialized = True

    def sample(self, data: DataProto) -> RewardSample:
        return decode_one(data, self.tokenizer, self.reward_fn_key)

    def score_kwargs_for_call(self) -> dict:
        extra = {}
        if self.reward_router_address is not None:
            extra = {
                "reward_router_address": self.reward_router_address,
                "reward_model_tokenizer": self.reward_model_tokenizer,
            }
        return {**self.score_kwargs, **extra}

    async def call_score(self, sample: RewardSample, timeout_s: float | None) -> ScoreOutcome:
        """The reward function on ``sample``, at most ``timeout_s`` (None: no limit); an exception or a
        timeout (:class:`ScoreTimeout`) becomes the outcome's ``error``, never lost."""
        kwargs = self.score_kwargs_for_call()
        if not self.is_async_reward_score:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                None, call_scorer, self.compute_score, sample, kwargs, timeout_s
            )
        call = self.compute_score(
            data_source=sample.data_source,
            solution_str=sample.response_str,
            ground_truth=sample.ground_truth,
            extra_info=sample.extra_info,
            **kwargs,
        )
        try:
            return ScoreOutcome(result=await asyncio.wait_for(call, timeout_s))
        except TimeoutError:
            return ScoreOutcome(error=ScoreTimeout(f"async scorer timed out after {timeout_s:g}s"))
        except Exception as error:
            return ScoreOutcome(error=error)

    @abstractmethod
    async def run_single(self, data: DataProto) -> dict[str, Any]:
        """``{"reward_score": float, "reward_extra_info": dict}`` for the one row of ``data``."""
