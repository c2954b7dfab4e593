"""The reward loop: each sample scored on its own, as soon as it is handed in, many at once.

:class:`RewardLoop` wraps a reward-loop manager (``reward_model.reward_manager``, or verl's top-level
``reward_manager`` section: ``source=register`` by ``name``, or ``source=importlib``, the class ``name``
from the file ``module.path``; or verl's reward-loop keys ``reward_model.reward_loop_source=importlib``
with ``reward_loop_module_path``/``reward_loop_class_name``: :func:`manager_class`) and the reward
sources behind it:

- ``custom_reward_function`` (sync or ``async def``; rule, GenRM through ``reward_router_address``, or a
  hybrid) — it takes precedence over a DisRM, as in verl's ``RewardLoopWorker``;
- a DisRM (``disrm``, :mod:`.disrm`) when a reward model is enabled without a custom function;
- the rule scorer of the sample's ``data_source`` otherwise.

Callers: the agent loops await :meth:`score_sample` as each sample finishes (standalone scoring, during
the rollout), and the trainer's reward phase calls the loop on the whole batch (``loop(data,
return_dict=True)``, the batch managers' contract): every row becomes one task, scored concurrently on the
loop's own event-loop thread.

A served reward model (``reward_model.enable`` with the loop on; main_ppo starts it and writes its router
into ``reward_kwargs.reward_router_address``): the function gets that address and the RM's tokenizer
(loaded from ``reward_model.model.path``); a classifier there with no custom function is a DisRM. Given
``judge`` (colocated: :class:`~.servers.RewardModelServers`), a batch call wakes it first and, with
``reward_model.rollout.free_cache_engine``, puts it to sleep after (its KV cache released).

Metrics (:meth:`pop_metrics`): ``reward/<source>/mean`` per source (``rule``, ``genrm``, ``disrm``),
``reward/judge_latency_p50_s``/``p95_s`` (each answered HTTP request to a served model), ``reward/retries``,
``reward/failures/<kind>`` (samples scored 0 after a ``timeout`` or an ``error``; ``sandbox_error``: samples
a SandboxFusion server gave no verdict on, at least in part), ``reward/samples``;
colocated, ``reward/judge_wake_s``, ``reward/judge_freed_kv_gb`` and ``reward/judge_rss_freed_gb`` (what
the judge's sleep released: its KV tensors, and its processes' resident set).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.utils.served_client import CallStats, recording
from hybridflow.workers.reward_loop.registry import get_reward_manager_cls
from hybridflow.workers.reward_manager.dapo import cfg_get
from hybridflow.workers.reward_manager.naive import score_positions

# a sample's extras counted in reward/failures/<kind>: a limited manager's timeout or error, and the
# SandboxFusion scorer's sandbox_error (a server that gave no verdict on some of its test cases)
FAILURE_KINDS = ("timeout", "error", "sandbox_error")


def manager_class(config) -> type:
    """The manager class the config names, in verl's order:

    - ``reward_model.reward_loop_source: importlib`` (verl's reward loop): the class
      ``reward_model.reward_loop_class_name`` from the file ``reward_model.reward_loop_module_path``;
    - verl's top-level ``reward_manager`` section at ``source: importlib``: the class ``reward_manager.name``
      from ``reward_manager.module.path`` (verl's ``load_reward_manager``);
    - otherwise the registered manager ``reward_manager.name`` / ``reward_model.reward_manager``
      (default ``naive``)."""
    from hybridflow.workers.reward_manager.custom import imported_manager_class, load_class_from_file

    rm = cfg_get(config, "reward_model") or {}
    loop_source = cfg_get(rm, "reward_loop_source", "register") or "register"
    if loop_source == "importlib":
        path, name = cfg_get(rm, "reward_loop_module_path"), cfg_get(rm, "reward_loop_class_name")
        if not path:
            raise ValueError(
                "reward_model.reward_loop_source=importlib needs reward_model.reward_loop_module_path"
            )
        return load_class_from_file(path, name, "reward_model.reward_loop_class_name")
    if loop_source != "register":
        raise ValueError(f"reward_model.reward_loop_source={loop_source!r}: choose register or importlib")
    section = cfg_get(config, "reward_manager")
    rm_name = cfg_get(rm, "reward_manager", "naive") or "naive"
    if section is None or isinstance(section, str):
        return get_reward_manager_cls(section or rm_name)
    source = cfg_get(section, "source", "register")
    if source == "register":
        return get_reward_manager_cls(cfg_get(section, "name") or rm_name)
    if source == "importlib":
        return imported_manager_class(section)
    raise ValueError(f"reward_manager.source={source!r}; choose register or importlib")


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


class RewardLoop:
    """Per-sample scoring (module docstring). ``config``: the whole run config; ``tokenizer``: the
    policy's; ``reward_router_address``/``reward_model_tokenizer``: the served RM's (GenRM), or None;
    ``disrm``: an object with ``async score(data) -> float`` (a DisRM), or None."""

    def __init__(
        self,
        config,
        tokenizer,
        reward_router_address=None,
        reward_model_tokenizer=None,
        disrm=None,
        judge=None,
    ):
        from hybridflow.workers.reward_manager.custom import _custom_compute_score

        self.config = config
        custom = _custom_compute_score(cfg_get(config, "custom_reward_function"))
        self.has_custom = custom is not None
        rm = cfg_get(config, "reward_model") or {}
        if reward_router_address is None:  # main_ppo's served RM, or a judge served apart: reward_kwargs
            reward_router_address = cfg_get(cfg_get(rm, "reward_kwargs") or {}, "reward_router_address")
        served = bool(cfg_get(rm, "enable", False)) and bool(cfg_get(rm, "use_reward_loop", False))
        if served and reward_router_address is None:
            raise RuntimeError(
                "reward_model.enable=true with the reward loop: the served reward model's address is missing "
                "(main_ppo starts it and sets reward_model.reward_kwargs.reward_router_address)"
            )
        if served and reward_model_tokenizer is None:  # verl hands the RM's tokenizer to the function
            from hybridflow.models.loading import is_sequence_classifier, load_tokenizer

            path = os.path.expanduser(str(cfg_get(cfg_get(rm, "model"), "path")))
            reward_model_tokenizer = load_tokenizer(path)
            if disrm is None and not self.has_custom and is_sequence_classifier(path):  # a served DisRM
                from hybridflow.workers.reward_loop.disrm import ServedDisRM

                disrm = ServedDisRM(reward_router_address, path, tokenizer, reward_model_tokenizer)
        self.disrm = None if self.has_custom else disrm  # a custom function takes precedence (verl)
        self.source = "disrm" if self.disrm is not None else ("genrm" if reward_router_address else "rule")
        # colocated: the served RM (RewardModelServers) woken for each batch call, asleep after it
        self.judge = judge
        self.free_cache = bool(cfg_get(cfg_get(rm, "rollout") or {}, "free_cache_engine", True))
        self._judge_metrics: dict[str, float] = {}
        cls = manager_class(config)
        self.manager = cls(config, tokenizer, custom, reward_router_address, reward_model_tokenizer)
        self._calls = CallStats()
        self._scores: dict[str, list[float]] = {}
        self._failures: Counter = Counter()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._manager_retries = int(getattr(type(self.manager), "retries", 0) or 0)

    # ------------------------------------------------------------------ one sample
    async def score_sample(self, data: DataProto) -> dict[str, Any]:
        """``{"reward_score", "reward_extra_info"}`` for the one row of ``data`` (counted in metrics)."""
        calls = CallStats()
        with recording(calls):
            if self.disrm is not None:
                score = float(await self.disrm.score(data))
                result = {"reward_score": score, "reward_extra_info": {"acc": score}}
            else:
                result = await self.manager.run_single(data)
        extras = result.get("reward_extra_info") or {}
        with self._lock:
            self._calls.merge(calls)
            self._scores.setdefault(self.source, []).append(float(result["reward_score"]))
            for kind in FAILURE_KINDS:
                if extras.get(kind):
                    self._failures[kind] += 1
        return result

    # ------------------------------------------------------------------ a batch
    async def score_batch(self, data: DataProto) -> tuple[torch.Tensor, dict[str, list]]:
        """``(reward_tensor (B, T_r) float32, extras)``: every row one task, all at once; each score on the
        row's last generated token."""
        results = await asyncio.gather(*(self.score_sample(data[i : i + 1]) for i in range(len(data))))
        reward = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        positions = score_positions(data).tolist()
        extras: dict[str, list] = {}
        for row, result in enumerate(results):
            reward[row, positions[row]] = float(result["reward_score"])
            for key, value in (result.get("reward_extra_info") or {}).items():
                if key == "score":  # the reward tensor holds it (after any shaping)
                    continue
                extras.setdefault(key, [None] * len(data))[row] = value
        return reward, extras

    def __call__(self, data: DataProto, return_dict: bool = False):
        """The batch managers' contract, on the loop's own event-loop thread (safe from any thread)."""
        if "rm_scores" in data.batch.keys():
            rm = data.batch["rm_scores"]
            return {"reward_tensor": rm, "reward_extra_info": {}} if return_dict else rm
        if self.judge is not None and self.free_cache:
            self._judge_metrics["reward/judge_wake_s"] = _timed(self.judge.wake_up)
        try:
            reward, extras = asyncio.run_coroutine_threadsafe(
                self.score_batch(data), self._event_loop()
            ).result()
        finally:
            if self.judge is not None:
                self.judge.check_alive()  # a dead replica is named, not left to fail every request
                if self.free_cache:
                    freed = self.judge.sleep()
                    self._judge_metrics["reward/judge_freed_kv_gb"] = freed["freed_kv_gb"]
                    self._judge_metrics["reward/judge_rss_freed_gb"] = freed["rss_freed_gb"]
        return {"reward_tensor": reward, "reward_extra_info": extras} if return_dict else reward

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """One event loop per RewardLoop, in a daemon thread: the managers' shared limiters and the
        served-model connections stay bound to it from batch to batch."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="reward-loop", daemon=True).start()
        return self._loop

    # ------------------------------------------------------------------ metrics
    def pop_metrics(self) -> dict[str, float]:
        """What was scored since the last call (module docstring for the names)."""
        with self._lock:
            calls, scores, failures = self._calls, self._scores, self._failures
            self._calls, self._scores, self._failures = CallStats(), {}, Counter()
        manager_retries = int(getattr(type(self.manager), "retries", 0) or 0)  # the class's running count
        retries = calls.retries + manager_retries - self._manager_retries
        self._manager_retries = manager_retries
        metrics = {f"reward/{source}/mean": float(np.mean(values)) for source, values in scores.items()}
        metrics.update(self._judge_metrics)
        self._judge_metrics = {}
        metrics["reward/samples"] = float(sum(len(v) for v in scores.values()))
        metrics["reward/retries"] = float(retries)
        for kind in FAILURE_KINDS:
            metrics[f"reward/failures/{kind}"] = float(failures.get(kind, 0))
        if calls.latencies_s:
            metrics["reward/judge_latency_p50_s"] = percentile(calls.latencies_s, 50)
            metrics["reward/judge_latency_p95_s"] = percentile(calls.latencies_s, 95)
        return metrics


def merge_worker_metrics(
    per_worker: list[dict[str, float]], clocks: list[dict[str, float]]
) -> dict[str, float]:
    """The reward-loop metrics of several agent-loop workers as one: counts summed; means and the p50
    latency averaged over the workers that report them, each weighted by its ``reward/samples`` (a
    worker that scored 3 samples counts 3 times as much as one that scored 1); the p95 latency the
    largest worker's (an upper bound: percentiles do not average); ``reward/exposed_s``: seconds from the
    last sample's generation end to the last score (the scoring left after the rollout), from each
    worker's wall clock."""
    merged: dict[str, list[tuple[float, float]]] = {}
    for metrics in per_worker:
        weight = float(metrics.get("reward/samples", 1.0))
        for key, value in metrics.items():
            merged.setdefault(key, []).append((float(value), weight))
    out = {}
    for key, pairs in merged.items():
        values = [v for v, _ in pairs]
        summed = key in ("reward/samples", "reward/retries") or key.startswith("reward/failures/")
        if summed:
            out[key] = float(np.sum(values))
        elif key.endswith("_p95_s"):
            out[key] = float(np.max(values))
        else:
            weights = [w for _, w in pairs]
            out[key] = (
                float(np.average(values, weights=weights)) if sum(weights) > 0 else float(np.mean(values))
            )
    generated = max((c.get("generated", 0.0) for c in clocks), default=0.0)
    scored = max((c.get("scored", 0.0) for c in clocks), default=0.0)
    if scored > 0:
        out["reward/exposed_s"] = max(scored - generated, 0.0)
    return out
