"""DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476): keep only prompt groups whose responses
disagree (non-zero std of the chosen metric) and generate more until the batch is full."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hybridflow import keys
from hybridflow.protocol import DataProto


def group_metric(batch: DataProto, metric: str) -> np.ndarray:
    """Per-row value of ``metric``: a reward extra (``acc``, ...), or ``seq_reward``/``seq_final_reward``/
    ``score`` computed from the token-level scores."""
    if metric in batch.non_tensor_batch:
        return np.asarray(batch.non_tensor_batch[metric], dtype=np.float64)
    scores = batch.batch[keys.TOKEN_LEVEL_SCORES].sum(dim=-1).numpy().astype(np.float64)
    if metric in ("seq_reward", "seq_final_reward", "score", "acc"):
        return scores
    raise KeyError(f"filter_groups.metric={metric!r} is neither a reward extra nor a known sequence metric")


def informative_rows(batch: DataProto, metric: str) -> np.ndarray:
    """Indices of rows whose uid group has a non-zero std of ``metric`` (groups of one are kept)."""
    values = group_metric(batch, metric)
    uids = batch.non_tensor_batch[keys.UID]
    keep_uids = {u for u in set(uids) if len(values[uids == u]) == 1 or np.std(values[uids == u]) > 0}
    return np.array([i for i, u in enumerate(uids) if u in keep_uids], dtype=np.int64)


PROMPT_KEYS = (keys.PROMPTS, keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)


def align_prompt_widths(parts: list[DataProto]) -> list[DataProto]:
    """Left-pad the prompt side of batches generated from different prompt batches to one width
    (prompts are as wide as their batch's longest prompt). Padding is masked, so its id is irrelevant."""
    if any(keys.PROMPTS not in p.batch.keys() for p in parts):
        return parts
    width = max(p.batch[keys.PROMPTS].shape[1] for p in parts)
    for part in parts:
        extra = width - part.batch[keys.PROMPTS].shape[1]
        for key in PROMPT_KEYS if extra else ():
            value = part.batch[key]
            part.batch[key] = torch.cat([torch.zeros(len(part), extra, dtype=value.dtype), value], dim=1)
    return parts


class GroupFilter:
    """``algorithm.filter_groups`` section: metric, max_num_gen_batches (<= 0: unlimited)."""

    def __init__(self, cfg) -> None:
        self.metric = cfg.metric or "acc"
        self.max_num_gen_batches = int(cfg.max_num_gen_batches)

    def fill(
        self, batch: DataProto, more: Callable[[], DataProto], num_prompts: int, metrics: dict
    ) -> DataProto:
        """Filter ``batch``; call ``more()`` for new scored batches until ``num_prompts`` groups remain."""
        n_rows_per_prompt = len(batch) // len(set(batch.non_tensor_batch[keys.UID]))
        kept: list[DataProto] = []
        generated = 0
        while True:
            generated += 1
            kept.append(batch.select_idxs(informative_rows(batch, self.metric)))
            total = sum(len(k) for k in kept)
            if total >= num_prompts * n_rows_per_prompt:
                break
            if 0 < self.max_num_gen_batches <= generated:
                raise RuntimeError(
                    f"DAPO dynamic sampling: only {total // n_rows_per_prompt} of {num_prompts} prompt "
                    f"groups had non-zero {self.metric!r} std after {generated} generation batches; raise "
                    "algorithm.filter_groups.max_num_gen_batches or check the reward function"
                )
            batch = more()
        metrics["train/num_gen_batches"] = generated
        merged = DataProto.concat(align_prompt_widths([k.select(meta_info_keys=[]) for k in kept]))
        merged.meta_info = kept[0].meta_info
        return merged.slice(0, num_prompts * n_rows_per_prompt)
