"""Generations as text, as verl writes them.

- ``trainer.rollout_data_dir`` / ``trainer.validation_data_dir``: every training step's rollouts /
  every validation's generations as ``{dir}/{step}.jsonl``, one JSON object per response with verl's
  fields ``input``, ``output``, ``gts``, ``score``, ``step`` and each per-sample reward extra
  (``acc``, ``pred``, ...).
- ``trainer.log_val_generations=N``: N validation samples ``(input, output, score)`` per validation to
  the trackers (:meth:`hybridflow.utils.tracking.Tracking.log_generations`), chosen as verl chooses
  them: sorted by input, shuffled with a fixed seed (42), the first N, so the same prompts are
  followed from one validation to the next.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from hybridflow import keys
from hybridflow.protocol import DataProto


def decode_generations(batch: DataProto, tokenizer) -> tuple[list[str], list[str]]:
    """(inputs, outputs): each row's prompt and response text, attended tokens only (padding dropped
    whatever its id), special tokens skipped (verl's ``skip_special_tokens=True``)."""
    prompts, responses = batch.batch[keys.PROMPTS], batch.batch[keys.RESPONSES]
    mask = batch.batch[keys.ATTENTION_MASK].bool()
    prompt_mask, response_mask = mask[:, : prompts.shape[1]], mask[:, prompts.shape[1] :]
    inputs = tokenizer.batch_decode(
        [ids[m].tolist() for ids, m in zip(prompts, prompt_mask, strict=True)], skip_special_tokens=True
    )
    outputs = tokenizer.batch_decode(
        [ids[m].tolist() for ids, m in zip(responses, response_mask, strict=True)], skip_special_tokens=True
    )
    return inputs, outputs


def ground_truths(batch: DataProto) -> list[Any]:
    """Each row's ``reward_model.ground_truth`` (verl's ``gts``), None where the row has none."""
    column = batch.non_tensor_batch.get("reward_model")
    if column is None:
        return [None] * len(batch)
    return [row.get("ground_truth") if isinstance(row, dict) else None for row in column]


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def dump_generations(
    dump_dir: str,
    step: int,
    inputs: list[str],
    outputs: list[str],
    scores: list[float],
    gts: list[Any] | None = None,
    extra: dict[str, list] | None = None,
) -> str:
    """Write ``{dump_dir}/{step}.jsonl`` (overwritten): line i is ``{"input", "output", "gts", "score",
    "step", **extra}`` of sample i; extras whose length is not the number of samples are left out (as
    verl does). Returns the file's path."""
    n = len(inputs)
    columns: dict[str, list] = {"input": inputs, "output": outputs, "gts": gts or [None] * n}
    columns.update({"score": list(scores), "step": [int(step)] * n})
    columns.update({k: list(v) for k, v in (extra or {}).items() if len(v) == n and k not in columns})
    os.makedirs(os.path.expanduser(dump_dir), exist_ok=True)
    path = os.path.join(os.path.expanduser(dump_dir), f"{int(step)}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            record = {name: values[i] for name, values in columns.items()}
            f.write(json.dumps(record, ensure_ascii=False, default=_json_default) + "\n")
    return path


def pick_samples(inputs: list[str], outputs: list[str], scores: list[float], n: int) -> list[tuple]:
    """``n`` ``(input, output, score)`` triples: sorted by input, shuffled with seed 42, the first n."""
    if n <= 0:
        return []
    samples = sorted(zip(inputs, outputs, scores, strict=True), key=lambda sample: sample[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:n]


def dump_rollouts(trainer, batch: DataProto) -> str | None:
    """``trainer.rollout_data_dir``: this step's rollouts with their scores and reward extras."""
    dump_dir = trainer.config.trainer.get("rollout_data_dir")
    if not dump_dir:
        return None
    inputs, outputs = decode_generations(batch, trainer.tokenizer)
    scores = batch.batch[keys.TOKEN_LEVEL_SCORES].sum(dim=-1).tolist()
    extra = {
        k: list(batch.non_tensor_batch[k]) for k in trainer.reward_extra_keys if k in batch.non_tensor_batch
    }
    return dump_generations(
        dump_dir, trainer.global_steps, inputs, outputs, scores, ground_truths(batch), extra
    )


def report_val_generations(trainer, inputs, outputs, gts, infos: dict[str, list]) -> None:
    """``trainer.log_val_generations`` and ``trainer.validation_data_dir`` for one validation;
    ``infos["reward"]`` holds the sequence scores, the other entries the reward extras."""
    scores = infos["reward"]
    count = int(trainer.config.trainer.get("log_val_generations") or 0)
    if count > 0 and trainer.tracker is not None:
        trainer.tracker.log_generations(pick_samples(inputs, outputs, scores, count), trainer.global_steps)
    dump_dir = trainer.config.trainer.get("validation_data_dir")
    if dump_dir:
        extra = {k: v for k, v in infos.items() if k != "reward"}
        dump_generations(dump_dir, trainer.global_steps, inputs, outputs, scores, gts, extra)
