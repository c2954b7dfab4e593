"""Validation: generate with ``rollout.val_kwargs`` (greedy by default) and score with the reward fn.

Reports ``val-core/<data_source>/reward/mean@N`` (and best/worst/maj@N when N > 1) as verl does.
"""

from __future__ import annotations

import numpy as np

from hybridflow import keys
from hybridflow.protocol import AUTO_PADDING_KEY, DataProto
from hybridflow.trainer.ppo import metric_utils
from hybridflow.trainer.ppo.generations import decode_generations, ground_truths, report_val_generations
from hybridflow.trainer.ppo.rollouts import chat_template_meta, rollout_with_uids


def run_validation(trainer) -> dict[str, float]:
    val_kwargs = trainer.config.actor_rollout_ref.rollout.val_kwargs
    meta = {
        "validate": True,
        "global_steps": trainer.global_steps,
        "do_sample": bool(val_kwargs.do_sample),
        AUTO_PADDING_KEY: True,
    }  # the validation set need not divide the workers
    meta.update(chat_template_meta(trainer.config))
    sources, uids, infos = [], [], {"reward": []}
    texts: dict[str, list] = {"inputs": [], "outputs": [], "gts": []}  # log_val_generations, dumps
    for batch_dict in trainer.val_dataloader:
        batch = rollout_with_uids(
            trainer.rollout,
            DataProto.from_single_dict(batch_dict),
            int(val_kwargs.n),
            meta,
            timing={},
        )
        result = trainer.val_reward_fn(batch, return_dict=True)
        infos["reward"].extend(result["reward_tensor"].sum(dim=-1).tolist())
        for key, values in result.get("reward_extra_info", {}).items():
            if len(values) == len(batch):
                infos.setdefault(key, []).extend(values)
        unknown = np.array(["unknown"] * len(batch), dtype=object)
        sources.extend(batch.non_tensor_batch.get(trainer.config.data.reward_fn_key, unknown).tolist())
        uids.extend(batch.non_tensor_batch[keys.UID].tolist())
        _collect_texts(trainer, batch, texts)
    infos = {k: v for k, v in infos.items() if len(v) == len(sources)}
    report_val_generations(trainer, texts["inputs"], texts["outputs"], texts["gts"], infos)
    nested = metric_utils.process_validation_metrics(sources, uids, infos)
    return metric_utils.flatten_validation_metrics(nested)  # verl's val-core/... and val-aux/... keys


def _collect_texts(trainer, batch: DataProto, texts: dict[str, list]) -> None:
    """Decode the batch's prompts and responses only when a generation log or dump wants them."""
    cfg = trainer.config.trainer
    if not (cfg.get("log_val_generations") or cfg.get("validation_data_dir")):
        return
    inputs, outputs = decode_generations(batch, trainer.tokenizer)
    texts["inputs"].extend(inputs)
    texts["outputs"].extend(outputs)
    texts["gts"].extend(ground_truths(batch))
