"""Per-step PPO diagnostics under verl's metric names (pure torch/numpy; no Ray).

- ``compute_data_metrics``: scores, rewards, advantages, returns, values, explained variance, lengths;
- ``compute_timing_metrics``: ``timing_s/<phase>`` and ``timing_per_token_ms/<phase>``;
- ``compute_throughput_metrics``: ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput``;
- ``process_validation_metrics``: ``val-core/<source>/reward/mean@N``, ``best@N``, ``maj@N``, ...;
- ``compute_rollout_probs_diff``: rollout-engine vs trainer probability mismatch.

Shapes follow :mod:`hybridflow.keys`: ``prompts (B, T_p)``, ``responses (B, T_r)``,
``attention_mask (B, T_p + T_r)``, per-token fields ``(B, T_r)``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridflow import keys as K
from hybridflow.protocol import DataProto
from hybridflow.utils.torch_functional import masked_var

__all__ = [
    "compute_data_metrics",
    "compute_timing_metrics",
    "compute_throughput_metrics",
    "compute_throughout_metrics",
    "reduce_metrics",
    "process_validation_metrics",
    "compute_rollout_probs_diff",
]

# Phases normalised by response tokens only (generation) vs by all tokens (every forward/backward pass).
_RESPONSE_TOKEN_PHASES = ("gen",)
_ALL_TOKEN_PHASES = ("ref", "values", "adv", "update_critic", "update_actor", "old_log_prob")
# At most this many n-subsets per prompt when averaging majority voting (all of them when fewer exist).
_MAX_VOTE_SUBSETS = 256


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


def compute_timing_metrics(batch: DataProto, timing_raw: dict[str, float]) -> dict[str, float]:
    """``timing_s/<name>`` for every entry; ``timing_per_token_ms/<name>`` for the known phases.

    Generation is normalised by response tokens, the training-side passes by prompt + response tokens.
    """
    prompt_length, response_length, _, _ = _lengths(batch)
    n_response = response_length.sum().item()
    n_all = prompt_length.sum().item() + n_response
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
    else the attention-mask sum.
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


compute_throughout_metrics = compute_throughput_metrics  # verl's spelling, for ported code


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Mean of each list (e.g. one value per micro-batch); scalars pass through; empty lists are dropped."""
    reduced = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor | np.ndarray) and value.ndim > 0:
            value = value.reshape(-1).tolist()
        if isinstance(value, list | tuple):
            if len(value) == 0:
                continue
            value = np.mean([float(v) for v in value])
        reduced[key] = float(value)
    return reduced


def _expected_extreme(values: np.ndarray, n: int, largest: bool) -> float:
    """E[max] (or E[min]) of ``n`` of the samples drawn without replacement, computed exactly.

    With ascending order statistics v_(1..N): P(max = v_(i)) = C(i-1, n-1) / C(N, n). For n = N this
    is simply the max. (verl estimates the same quantity by bootstrap with replacement.)
    """
    ordered = np.sort(values) if largest else np.sort(values)[::-1]
    total = math.comb(len(values), n)
    return float(sum(v * math.comb(i, n - 1) for i, v in enumerate(ordered)) / total)


def _majority_value(vals: Sequence[float], votes: Sequence[Any]) -> float:
    """Value of the first sample voting for the most common answer (ties: the first answer seen)."""
    counts = Counter(votes)
    winner = max(counts, key=counts.get)  # Counter keeps first-seen order, max keeps the first tie
    return float(vals[list(votes).index(winner)])


def _expected_majority(vals: np.ndarray, votes: list[Any], n: int, rng: np.random.Generator) -> float:
    """Mean majority-vote value over n-subsets: all of them, or ``_MAX_VOTE_SUBSETS`` random ones."""
    if math.comb(len(vals), n) <= _MAX_VOTE_SUBSETS:
        subsets = list(itertools.combinations(range(len(vals)), n))
    else:
        subsets = [np.sort(rng.choice(len(vals), size=n, replace=False)) for _ in range(_MAX_VOTE_SUBSETS)]
    return float(np.mean([_majority_value(vals[list(s)], [votes[i] for i in s]) for s in subsets]))


def _prompt_metrics(vals: np.ndarray, votes: list[Any] | None, rng: np.random.Generator) -> dict[str, float]:
    """``mean@N``, ``std@N`` and, for n = 2, 4, ... < N and N, ``best@n``/``worst@n``/``maj@n`` means."""
    n_resps = len(vals)
    metrics = {f"mean@{n_resps}": float(np.mean(vals))}
    if n_resps == 1:
        return metrics
    metrics[f"std@{n_resps}"] = float(np.std(vals))
    ns = [2**p for p in range(1, n_resps.bit_length()) if 2**p < n_resps] + [n_resps]
    for n in ns:
        metrics[f"best@{n}/mean"] = _expected_extreme(vals, n, largest=True)
        metrics[f"worst@{n}/mean"] = _expected_extreme(vals, n, largest=False)
        if votes is not None:
            metrics[f"maj@{n}/mean"] = _expected_majority(vals, votes, n, rng)
    return metrics


def _sample_count(metric_name: str) -> int:
    """The n of ``best@n/mean`` or ``mean@n``."""
    return int(metric_name.split("@")[1].split("/")[0])


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[Any],
    infos_dict: dict[str, Sequence[Any]],
    seed: int = 42,
) -> dict[str, float]:
    """Validation metrics per data source, averaged over prompts, as flat ``val-*/<source>/<var>/<metric>``.

    Rows sharing a uid are the N samples of one prompt. For every numeric variable (``reward``, ``acc``,
    extra reward infos) each prompt gets ``mean@N``, ``std@N`` and, when N > 1, ``best@n/mean``,
    ``worst@n/mean`` (expected max/min of n samples, exact) and, if ``infos_dict["pred"]`` holds the
    answers, ``maj@n/mean`` (value of the majority answer). As in verl, ``val-core`` holds the core
    variable's (``acc`` if present else ``reward``) mean/best/maj at the largest n; all else is ``val-aux``.
    Differences: no bootstrap (so no ``/std`` entries) and subsets are drawn without replacement.
    """
    rng = np.random.default_rng(seed)
    groups: dict[str, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for row, (source, uid) in enumerate(zip(data_sources, sample_uids, strict=True)):
        groups[source][uid].append(row)
    votes_all = infos_dict.get("pred")
    numeric = [
        var
        for var, vals in infos_dict.items()
        if var != "pred" and len(vals) and not isinstance(vals[0], str | bytes)
    ]
    core_var = "acc" if "acc" in numeric else "reward"

    out: dict[str, float] = {}
    for source, uid_rows in groups.items():
        for var in numeric:
            per_metric: dict[str, list[float]] = defaultdict(list)
            for rows in uid_rows.values():
                vals = np.asarray([float(infos_dict[var][i]) for i in rows])
                votes = None if votes_all is None else [votes_all[i] for i in rows]
                for name, value in _prompt_metrics(vals, votes, rng).items():
                    per_metric[name].append(value)
            n_max = max(_sample_count(name) for name in per_metric)
            for name, prompt_vals in per_metric.items():
                core = var == core_var and name.startswith(("mean@", "best@", "maj@"))
                section = "val-core" if core and _sample_count(name) == n_max else "val-aux"
                out[f"{section}/{source}/{var}/{name}"] = float(np.mean(prompt_vals))
    return out


def compute_rollout_probs_diff(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """``|exp(rollout_log_probs) - exp(old_log_probs)|`` over valid tokens: max, mean, std (unbiased).

    All inputs (B, T_r). A large gap means the rollout engine and the trainer disagree numerically,
    which biases the importance ratios of off-policy corrections.
    """
    diff = (rollout_log_probs.float().exp() - old_log_probs.float().exp()).abs()
    diff = torch.masked_select(diff, response_mask.bool())
    prefix = "training/rollout_probs_diff"
    if diff.numel() == 0:
        return {f"{prefix}_max": 0.0, f"{prefix}_mean": 0.0, f"{prefix}_std": 0.0}
    return {
        f"{prefix}_max": diff.max().item(),
        f"{prefix}_mean": diff.mean().item(),
        f"{prefix}_std": diff.std().item() if diff.numel() > 1 else 0.0,
    }


def rollout_parity_metrics(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """:func:`compute_rollout_probs_diff` plus the same gap in log-probabilities
    (``training/rollout_log_probs_diff_max``/``_mean``), which is what parity tolerances bound."""
    metrics = compute_rollout_probs_diff(rollout_log_probs, old_log_probs, response_mask)
    log_diff = torch.masked_select(
        (rollout_log_probs.double() - old_log_probs.double()).abs(), response_mask.bool()
    )
    empty = log_diff.numel() == 0
    metrics["training/rollout_log_probs_diff_max"] = 0.0 if empty else log_diff.max().item()
    metrics["training/rollout_log_probs_diff_mean"] = 0.0 if empty else log_diff.mean().item()
    return metrics
