"""Supervised fine-tuning driven by the single controller: ``python -m hybridflow.trainer.sft_trainer``.

The same FSDP2 model-building code as the RL actor, on a Ray worker group; the result is written as
a Hugging Face directory (``trainer.default_local_dir``) that RL then starts from.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402


@hydra.main(config_path="config", config_name="sft_trainer", version_base=None)
def main(config: DictConfig) -> None:
    run_sft(config)


def run_sft(config: DictConfig) -> list[dict[str, float]]:
    """Train and save the model; returns every step's metrics."""
    import torch
    from tqdm import tqdm

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.protocol import DataProto
    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from hybridflow.trainer.ppo.workers_setup import build_resource_pool, ensure_ray
    from hybridflow.utils.dataset import StatefulDataLoader
    from hybridflow.utils.dataset.sft_dataset import SFTDataset, collate_sft
    from hybridflow.utils.tracking import Tracking
    from hybridflow.workers.sft_worker import SFTWorker

    OmegaConf.resolve(config)
    torch.set_num_threads(1)
    with open_dict(config):
        config.model.path = config.model.partial_pretrain or config.model.path
    tokenizer = load_tokenizer(os.path.expanduser(config.model.path))
    dataset = SFTDataset(
        config.data.train_files,
        tokenizer,
        config.data.max_length,
        config.data.prompt_key,
        config.data.response_key,
        config.data.truncation,
    )
    loader = StatefulDataLoader(
        dataset,
        batch_size=int(config.data.train_batch_size),
        shuffle=bool(config.data.shuffle),
        seed=int(config.data.seed),
        drop_last=True,
        collate_fn=collate_sft,
    )
    total_steps = int(config.trainer.total_training_steps or len(loader) * int(config.trainer.total_epochs))
    with open_dict(config):
        config.optim.total_training_steps = total_steps
    ensure_ray(config.ray_init)
    wg = RayWorkerGroup(
        build_resource_pool(config.trainer),
        RayClassWithInitArgs(SFTWorker, config),
        name_prefix="sft",
        num_threads=int(config.trainer.num_threads_per_worker),
    )
    tracker = Tracking(
        config.trainer.project_name, config.trainer.experiment_name, list(config.trainer.logger)
    )
    history: list[dict[str, float]] = []
    try:
        wg.init_model()
        step = 0
        with tqdm(total=total_steps, desc="sft", dynamic_ncols=True) as progress:
            while step < total_steps:
                for batch in loader:
                    step += 1
                    out = wg.train_step(DataProto.from_single_dict(batch))
                    metrics = {k: sum(v) / len(v) for k, v in out.meta_info["metrics"].items()}
                    history.append(metrics)
                    if step % int(config.trainer.log_freq) == 0 or step == total_steps:
                        tracker.log(metrics, step=step)
                    progress.set_postfix(loss=f"{metrics['train/loss']:.3f}")
                    progress.update(1)
                    if step >= total_steps:
                        break
        wg.save_hf_model(os.path.expanduser(config.trainer.default_local_dir))
    finally:
        tracker.finish()
        wg.shutdown()
    return history


if __name__ == "__main__":
    main()
