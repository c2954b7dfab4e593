"""Per-step PPO diagnostics under verl's metric names (pure torch/numpy; no Ray).

- ``compute_data_metrics``: scores, rewards, advantages, returns, values, explained variance, lengths;
- ``compute_timing_metrics``: ``timing_s/<phase>`` and ``timing_per_token_ms/<phase>``;
- ``compute_throughput_metrics``: ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput``;
- ``process_validation_metrics``: ``{source: {var: {"mean@N", "best@n/mean", "maj@n/std", ...}}}``, and
  ``flatten_validation_metrics``: the trainer's ``val-core/<source>/<var>/<metric>`` keys;
- ``compute_rollout_probs_diff``: rollout-engine vs trainer probability mismatch.

Shapes follow :mod:`hybridflow.keys`: ``prompts (B, T_p)``, ``responses (B, T_r)``,
``attention_mask (B, T_p + T_r)``, per-token fields ``(B, T_r)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from hybridflow import keys as K
from hybridflow.protocol import DataProto
from hybridflow.utils.metric import reduce_metrics  # noqa: F401  (verl imports it from here too)
from hybridflow.utils.rollout_parity import compute_rollout_probs_diff, rollout_parity_metrics  # noqa: F401
from hybridflow.utils.torch_functional import masked_var

__all__ = [
    "compute_data_metrics",
    "compute_timing_metrics",
    "compute_throughput_metrics",
    "compute_throughout_metrics",
    "reduce_metrics",
    "bootstrap_metric",
    "calc_maj_val",
    "process_validation_metrics",
    "flatten_validation_metrics",
    "compute_rollout_probs_diff",
]

# Phases normalised by response tokens only (generation) vs by all tokens (every forward/backward pass).
_RESPONSE_TOKEN_PHASES = ("gen",)
_ALL_TOKEN_PHASES = ("ref", "values", "adv", "update_critic", "update_actor", "old_log_prob")


def _lengths(batch: DataProto) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(prompt_length (B,), response_length (B,), T_p, T_r)`` counted from ``attention_mask``."""
    t_r = batch.batch[K.RESPONSES].shape[-1]
    attention_mask = batch.batch[K.ATTENTION_MASK]
    prompt_length = attention_mask[:, :-t_r].sum(-1).float()
    response_length = attention_mask[:, -t_r:].sum(-1).float()
    return prompt_length, response_length, attention_mask.shape[-1] - t_r, t_r


def _response_mask(batch: DataProto) -> torch.Tensor:
    if K.RESPONSE_MASK in batch.batch.keys():
        return batch.batch[K.RESPONSE_MASK].bool()
    t_r = batch.batch[K.RESPONSES].shape[-1]
    return batch.batch[K.ATTENTION_MASK][:, -t_r:].bool()


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """``{prefix}/mean``, ``/max``, ``/min`` of a 1-D tensor (all 0 when it is empty)."""
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    values = values.float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _length_stats(prefix: str, lengths: torch.Tensor, max_length: int) -> dict[str, float]:
    """Length statistics plus ``clip_ratio``: the share of rows that hit ``max_length``."""
    clip = (lengths == max_length).float().mean().item() if lengths.numel() else 0.0
    return {**_stats(prefix, lengths), f"{prefix}/clip_ratio": clip}


def compute_data_metrics(batch: DataProto, use_critic: bool = True) -> dict[str, float]:
    """Reward, advantage, value and length statistics of a rollout batch (verl's names).

    Sequence score/reward = sum over the response of ``token_level_scores``/``token_level_rewards``,
    taken over non-aborted rows (response length > 0) as verl does, or all rows if every one aborted.
    Advantages, returns and values are over valid response tokens. ``meta_info["max_prompt_length"]``,
    when present, is the limit ``prompt_length/clip_ratio`` counts against (else the prompt width).
    ``critic/vf_explained_var`` is ``1 - Var(returns - values) / (Var(returns) + 1e-5)`` with unbiased
    variances.
    """
    data = batch.batch
    prompt_length, response_length, t_p, t_r = _lengths(batch)
    mask = _response_mask(batch)
    aborted = response_length == 0
    kept = ~aborted if bool((~aborted).any()) else torch.ones_like(aborted)

    metrics = {
        **_stats("critic/score", data[K.TOKEN_LEVEL_SCORES].sum(-1)[kept]),
        **_stats("critic/rewards", data[K.TOKEN_LEVEL_REWARDS].sum(-1)[kept]),
        **_stats("critic/advantages", torch.masked_select(data[K.ADVANTAGES], mask)),
        **_stats("critic/returns", torch.masked_select(data[K.RETURNS], mask)),
    }
    if use_critic:
        returns, values = data[K.RETURNS].float(), data[K.VALUES].float()
        metrics.update(_stats("critic/values", torch.masked_select(values, mask)))
        residual_var = masked_var(returns - values, mask)
        metrics["critic/vf_explained_var"] = (1.0 - residual_var / (masked_var(returns, mask) + 1e-5)).item()
    metrics.update(_length_stats("response_length", response_length, t_r))
    metrics.update(_length_stats("response_length_non_aborted", response_length[~aborted], t_r))
    metrics["response/aborted_ratio"] = aborted.float().mean().item()
    # Prompts may be narrower than max_prompt_length (shared padding is trimmed): clip against the limit.
    max_prompt_length = int(batch.meta_info.get("max_prompt_length", t_p))
    metrics.update(_length_stats("prompt_length", prompt_length, max_prompt_length))
    if "__num_turns__" in batch.non_tensor_batch:
        num_turns = batch.non_tensor_batch["__num_turns__"].astype(float)
        metrics.update(_stats("num_turns", torch.as_tensor(num_turns)))
    for column in ("tool_calls", "tool_failures", "tool_rewards"):  # multi-turn rollouts, per sample
        if column in batch.non_tensor_batch:
            metrics.update(_stats(column, torch.as_tensor(batch.non_tensor_batch[column].astype(float))))
    return metrics


def _compute_response_info(batch: DataProto) -> dict[str, torch.Tensor]:
    """verl's helper, kept under its name (tests patch it): ``prompt_length (B,)`` and
    ``response_length (B,)`` float token counts, and ``response_mask (B, T_r)`` (the response part of
    ``attention_mask``)."""
    t_r = batch.batch[K.RESPONSES].shape[-1]
    attention_mask = batch.batch[K.ATTENTION_MASK]
    response_mask = attention_mask[:, -t_r:]
    return {
        "prompt_length": attention_mask[:, :-t_r].sum(-1).float(),
        "response_length": response_mask.sum(-1).float(),
        "response_mask": response_mask,
    }


def compute_timing_metrics(batch: DataProto, timing_raw: dict[str, float]) -> dict[str, float]:
    """``timing_s/<name>`` for every entry; ``timing_per_token_ms/<name>`` for the known phases.

    Generation is normalised by response tokens, the training-side passes by prompt + response tokens.
    """
    info = _compute_response_info(batch)
    n_response = info["response_length"].sum().item()
    n_all = info["prompt_length"].sum().item() + n_response
    tokens = {
        **{name: n_response for name in _RESPONSE_TOKEN_PHASES},
        **{name: n_all for name in _ALL_TOKEN_PHASES},
    }
    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timing_raw.items()}
    for name, seconds in timing_raw.items():
        if name in tokens:
            metrics[f"timing_per_token_ms/{name}"] = seconds * 1000 / max(tokens[name], 1)
    return metrics


def compute_throughput_metrics(
    batch: DataProto, timing_raw: dict[str, float], n_workers: int
) -> dict[str, float]:
    """Tokens per second per worker over the whole step (``timing_raw["step"]``).

    The token count is ``meta_info["global_token_num"]`` (per-sequence counts, summed) when present,
    else the attention-mask sum. E.g. 600 tokens in a 2 s step on 2 workers: 150 tokens/s each.
    """
    token_num = batch.meta_info.get("global_token_num")
    if token_num is None:
        total = int(batch.batch[K.ATTENTION_MASK].sum().item())
    else:
        total = int(np.sum(token_num))
    seconds = float(timing_raw["step"])
    return {
        "perf/total_num_tokens": total,
        "perf/time_per_step": seconds,
        "perf/throughput": total / (seconds * n_workers),
    }


def compute_throughout_metrics(
    batch: DataProto, timing_raw: dict[str, float], n_gpus: int
) -> dict[str, float]:
    """verl's spelling and signature of :func:`compute_throughput_metrics` (``n_gpus`` workers)."""
    return compute_throughput_metrics(batch, timing_raw, n_gpus)


def compute_overhead_metrics(timing_raw: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """What the single controller costs on top of the workers' own compute, as shares of the step:

    - ``perf/dispatch_overhead_s`` / ``_frac``: for the rollout and the actor update, the driver's wall
      for the call minus the slowest worker's own time (``generate_sequences`` + ``update_weights``;
      ``update_actor_worker``) — serialisation, Ray round trips and stragglers' idle time;
    - ``perf/weight_sync_frac``: the hybrid engine's weight sync (``update_weights``) over the step.
    """
    step = float(timing_raw.get("step", 0.0)) or float("nan")
    overhead = 0.0
    if "generate_call" in timing_raw and "generate_sequences" in timing_raw:
        worker = timing_raw["generate_sequences"] + timing_raw.get("update_weights", 0.0)
        overhead += max(0.0, timing_raw["generate_call"] - worker)
    if "update_actor" in timing_raw and "timing_s/update_actor_worker" in metrics:
        overhead += max(0.0, timing_raw["update_actor"] - metrics["timing_s/update_actor_worker"])
    return {
        "perf/dispatch_overhead_s": overhead,
        "perf/dispatch_overhead_frac": overhead / step,
        "perf/weight_sync_frac": timing_raw.get("update_weights", 0.0) / step,
    }


def _bootstrap_indices(n: int, subset_size: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """``(n_bootstrap, subset_size)`` indices drawn with replacement: the very draws verl gets from
    ``np.random.seed(seed)`` + one ``np.random.choice`` per iteration, without touching global state."""
    return np.random.RandomState(seed).choice(n, size=(n_bootstrap, subset_size), replace=True)


def bootstrap_metric(
    data: list[Any],
    subset_size: int,
    reduce_fns: list[Callable[[list[Any]], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """``(mean, std)`` over ``n_bootstrap`` resamples of ``subset_size`` items (with replacement) of
    each ``reduce_fn(resample)``, one pair per function (verl's estimator of best@n, maj@n, ...)."""
    draws = _bootstrap_indices(len(data), subset_size, n_bootstrap, seed)
    results = [[] for _ in reduce_fns]
    for row in draws:
        sample = [data[i] for i in row]
        for out, fn in zip(results, reduce_fns, strict=True):
            out.append(fn(sample))
    return [(float(np.mean(r)), float(np.std(r))) for r in results]


def calc_maj_val(data: list[dict[str, Any]], vote_key: str, val_key: str) -> float:
    """``val_key`` of the first item voting for the most common ``vote_key`` (ties: first seen)."""
    vote2vals: dict[Any, list] = defaultdict(list)
    for item in data:
        vote2vals[item[vote_key]].append(item[val_key])
    majority = max(vote2vals, key=lambda vote: len(vote2vals[vote]))  # dicts keep first-seen order
    return vote2vals[majority][0]


def _is_numeric(value: Any) -> bool:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.ndim == 0
    return isinstance(value, bool | int | float | np.number)


def _prompt_metrics(vals: list[float], preds: list[Any] | None, seed: int) -> dict[str, float]:
    """verl's per-prompt metrics for one variable over its ``N`` samples: ``mean@N``; if N > 1 also
    ``std@N`` and, for n in 2, 4, 8, ... < N and N, bootstrap ``best@n``/``worst@n`` (and ``maj@n``
    when answers are given) ``/mean`` and ``/std``."""
    n_resps = len(vals)
    metrics = {f"mean@{n_resps}": float(np.mean(vals))}
    if n_resps == 1:
        return metrics
    metrics[f"std@{n_resps}"] = float(np.std(vals))
    ns = [2**p for p in range(1, n_resps.bit_length()) if 2**p < n_resps] + [n_resps]
    array = np.asarray(vals, dtype=np.float64)
    for n in ns:
        # Vectorised bootstrap of max/min: the same draws (same seed) as bootstrap_metric.
        resampled = array[_bootstrap_indices(n_resps, n, 1000, seed)]
        for name, stat in (("best", resampled.max(axis=1)), ("worst", resampled.min(axis=1))):
            metrics[f"{name}@{n}/mean"], metrics[f"{name}@{n}/std"] = float(stat.mean()), float(stat.std())
        if preds is not None:
            votes = [{"val": v, "pred": p} for v, p in zip(vals, preds, strict=True)]
            maj = partial(calc_maj_val, vote_key="pred", val_key="val")
            [(metrics[f"maj@{n}/mean"], metrics[f"maj@{n}/std"])] = bootstrap_metric(
                votes, n, [maj], seed=seed
            )
    return metrics


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[Any],
    infos_dict: dict[str, Sequence[Any]],
    seed: int = 42,
) -> dict[str, dict[str, dict[str, float]]]:
    """verl's validation statistics: ``{data_source: {var_name: {metric_name: value}}}``.

    Rows sharing a uid are the N samples of one prompt (a row whose value is None does not count for
    that variable). Every numeric variable of ``infos_dict``
    (``reward``, ``acc``, extra reward infos; string columns such as ``pred`` are skipped) gets the
    per-prompt metrics of :func:`_prompt_metrics` (``mean@N``, ``std@N``, ``best@n/mean``,
    ``best@n/std``, ``worst@n/...``, ``maj@n/...`` when ``infos_dict["pred"]`` holds the answers),
    each averaged over the prompts of the data source. The bootstrap draws 1000 resamples with
    replacement from ``seed``, as verl does, so the numbers match verl's for the same inputs.
    """
    rows: dict[str, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, uid) in enumerate(zip(data_sources, sample_uids, strict=True)):
        rows[source][uid].append(i)
    preds = infos_dict.get("pred")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for source, uid2rows in rows.items():
        per_var: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for prompt_rows in uid2rows.values():
            for var, values in infos_dict.items():
                # None: a row whose scorer did not give this key (a dict only on some rows: a code
                # row's sandbox_error); the prompt's other rows are this variable's samples
                kept = [i for i in prompt_rows if values[i] is not None]
                if not kept or not _is_numeric(values[kept[0]]):
                    continue
                prompt_preds = None if preds is None else [preds[i] for i in kept]
                vals = [float(values[i]) for i in kept]
                for name, value in _prompt_metrics(vals, prompt_preds, seed).items():
                    per_var[var][name].append(value)
        out[source] = {
            var: {name: float(np.mean(v)) for name, v in metrics.items()} for var, metrics in per_var.items()
        }
    return out


def flatten_validation_metrics(data_src2var2metric2val: dict[str, dict[str, dict[str, float]]]) -> dict:
    """The trainer's flat keys ``val-core/<source>/<var>/<metric>`` or ``val-aux/...``, as verl's
    ``_validate`` files them: ``val-core`` holds the core variable's (``acc`` if the source has it,
    else ``reward``) ``mean``/``maj``/``best`` metrics at the largest n; everything else is aux."""
    flat = {}
    for source, var2metric2val in data_src2var2metric2val.items():
        core_var = "acc" if "acc" in var2metric2val else "reward"
        for var, metric2val in var2metric2val.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric2val)
            for name, value in metric2val.items():
                core = var == core_var and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                flat[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = value
    return flat
