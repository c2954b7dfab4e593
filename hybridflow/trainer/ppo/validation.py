"""Validation: generate with ``rollout.val_kwargs`` (greedy by default) and score with the reward fn.

Reports ``val-core/<data_source>/reward/mean@N`` (and best/worst/maj@N when N > 1) as verl does.
"""

from __future__ import annotations

import uuid

import numpy as np

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo import metric_utils


def run_validation(trainer) -> dict[str, float]:
    n = int(trainer.config.actor_rollout_ref.rollout.val_kwargs.n)
    sources, uids, infos = [], [], {"reward": []}
    for batch_dict in trainer.val_dataloader:
        batch = DataProto.from_single_dict(batch_dict)
        batch.non_tensor_batch[keys.UID] = np.array(
            [str(uuid.uuid4()) for _ in range(len(batch))], dtype=object
        )
        batch = batch.repeat(n, interleave=True)
        gen_input = batch.select(
            batch_keys=[keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS],
            non_tensor_batch_keys=[],
            meta_info_keys=[],
        )
        gen_input.meta_info = {
            "validate": True,
            "global_steps": trainer.global_steps,
            "do_sample": bool(trainer.config.actor_rollout_ref.rollout.val_kwargs.do_sample),
        }
        gen_input.meta_info["_auto_padding"] = True  # the validation set need not divide the workers
        output = trainer.wg.actor_rollout.generate_sequences(gen_input)
        output.meta_info.pop("metrics", None)
        batch.pop(batch_keys=[keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS])
        batch = batch.union(output)
        result = trainer.val_reward_fn(batch, return_dict=True)
        infos["reward"].extend(result["reward_tensor"].sum(dim=-1).tolist())
        for key, values in result.get("reward_extra_info", {}).items():
            if len(values) == len(batch):
                infos.setdefault(key, []).extend(values)
        sources.extend(
            batch.non_tensor_batch.get(
                trainer.config.data.reward_fn_key, np.array(["unknown"] * len(batch), dtype=object)
            ).tolist()
        )
        uids.extend(batch.non_tensor_batch[keys.UID].tolist())
    infos = {k: v for k, v in infos.items() if len(v) == len(sources)}
    return metric_utils.process_validation_metrics(sources, uids, infos)
