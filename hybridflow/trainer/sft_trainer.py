"""Supervised fine-tuning driven by the single controller: ``python -m hybridflow.trainer.sft_trainer``.

The same FSDP2 model-building code as the RL actor, on a Ray worker group; the result is written as
a Hugging Face directory (``trainer.default_local_dir``) that RL then starts from. The config
(``config/sft_trainer.yaml``) is checked before Ray starts: an unknown key, or a value whose effect is
not delivered (bf16 master weights, ``honesty.SFT_LIMITED_VALUES``), is a :class:`ConfigError`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from hybridflow.trainer.hydra_entry import hydra_entry  # noqa: E402


@hydra_entry("sft_trainer")
def main(config: DictConfig) -> None:
    run_sft(config)


def run_sft(config: DictConfig) -> list[dict[str, float]]:
    """Train and save the model; returns every step's metrics."""
    import torch
    from tqdm import tqdm

    from hybridflow.protocol import DataProto
    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from hybridflow.trainer.ppo.workers_setup import build_resource_pool, ensure_ray
    from hybridflow.utils.dataset import StatefulDataLoader
    from hybridflow.utils.dataset.sft_dataset import SFTDataset, collate_sft
    from hybridflow.utils.tracking import Tracking
    from hybridflow.workers.sft_worker import SFTWorker

    OmegaConf.resolve(config)
    validate_sft_config(config)
    torch.set_num_threads(1)
    with open_dict(config):
        config.model.path = config.model.partial_pretrain or config.model.path
    tokenizer = sft_tokenizer(config.model)
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
    if len(loader) == 0:  # drop_last: nothing to train on (and a step target would loop forever)
        raise ValueError(
            f"data.train_files hold {len(dataset)} rows, fewer than one batch of "
            f"data.train_batch_size={config.data.train_batch_size}"
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


def validate_sft_config(config: DictConfig) -> None:
    """Raise :class:`ConfigError` listing every problem of a composed SFT config, one line each."""
    from hybridflow.trainer.config import CONFIG_DIR, ConfigError, _check_device
    from hybridflow.trainer.config.honesty import sft_problems
    from hybridflow.trainer.config.mistakes import unknown_key_problems

    schema = OmegaConf.load(CONFIG_DIR / "sft_trainer.yaml")
    problems = unknown_key_problems(config, schema, "sft_trainer.yaml")
    files = config.data.train_files
    for path in [files] if isinstance(files, str) else list(files or []):
        if not os.path.isfile(os.path.expanduser(str(path))):
            problems.append(f"data.train_files: file {path!r} does not exist")
    model_path = config.model.partial_pretrain or config.model.path
    if not model_path or not os.path.isdir(os.path.expanduser(str(model_path))):
        problems.append(f"model.path: {model_path!r} is not a local model directory")
    workers = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    if int(config.data.train_batch_size) % max(workers, 1) or int(config.data.train_batch_size) < workers:
        problems.append(
            f"data.train_batch_size={config.data.train_batch_size} does not split evenly over the "
            f"{workers} worker processes (trainer.n_gpus_per_node x trainer.nnodes)"
        )
    problems += _check_device(config) + sft_problems(config)  # same device rule as the PPO trainer
    if problems:
        raise ConfigError("invalid SFT config:\n  - " + "\n  - ".join(problems))


def sft_tokenizer(model_cfg):
    """The driver's tokenizer of ``model.path``, honouring ``external_lib`` and ``trust_remote_code`` as
    the workers' model loading does."""
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.workers.model_builder import import_external_lib

    import_external_lib(model_cfg.get("external_lib"))
    return load_tokenizer(
        os.path.expanduser(str(model_cfg.path)), trust_remote_code=bool(model_cfg.get("trust_remote_code"))
    )


if __name__ == "__main__":
    main()
