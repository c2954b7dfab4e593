"""Learning-rate schedules: verl's formulas, and the PPO trainer giving them the run's length."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import build_trainer
from hybridflow.workers.fsdp_utils import build_lr_scheduler, lr_lambda


def lrs(optim_cfg: dict, steps: int) -> list[float]:
    """The lr each of ``steps`` updates uses (read before the scheduler steps, as the workers log it)."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=optim_cfg["lr"])
    scheduler = build_lr_scheduler(optimizer, OmegaConf.create(optim_cfg))
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def test_constant_with_warmup_starts_at_zero_like_verl():
    # verl: step / max(1, W) for step < W, then 1
    assert [lr_lambda("constant", 2, 10, 0.0, 0.5)(s) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]
    assert [lr_lambda("constant", 0, 10, 0.0, 0.5)(s) for s in range(2)] == [1.0, 1.0]


def test_cosine_decays_to_min_ratio_over_the_run():
    # W = 0, total 4: 0.5 (1 + cos(pi * s / 4)) -> 1, 0.85355, 0.5, 0.14645, 0; with min 0.1: 0.1 + 0.9 x
    f = lr_lambda("cosine", 0, 4, 0.0, 0.5)
    expected = [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0]
    assert [f(s) for s in range(5)] == pytest.approx(expected)
    g = lr_lambda("cosine", 0, 4, 0.1, 0.5)
    assert [g(s) for s in range(5)] == pytest.approx([0.1 + 0.9 * x for x in expected])


def test_cosine_without_total_steps_is_an_error():
    with pytest.raises(ValueError, match="total_training_steps"):
        lrs({"lr": 1.0, "warmup_style": "cosine", "total_training_steps": -1}, 1)
    with pytest.raises(ValueError, match="total_training_steps"):
        lrs({"lr": 1.0, "lr_warmup_steps_ratio": 0.5, "total_training_steps": -1}, 1)


def _built_trainer_config(model_dir, data, tmp_path, *overrides: str):
    """The config after ``build_trainer`` (which writes the run's length into the optim sections), with a
    cosine actor schedule of peak 1.0 and ``overrides``."""
    train, test = data
    config = load_config(
        [
            f"data.train_files={train}",
            f"data.val_files={test}",
            f"actor_rollout_ref.model.path={model_dir}",
            "trainer.logger=[console]",
            "actor_rollout_ref.actor.optim.lr=1.0",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            *overrides,
        ]
    )
    OmegaConf.resolve(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        build_trainer(config)
    return config


def test_ppo_trainer_gives_actor_and_critic_schedules_the_run_length(
    tiny_model_dir, arithmetic_data, tmp_path
):
    config = _built_trainer_config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "trainer.total_training_steps=4",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5",
        "critic.optim.warmup_style=cosine",
    )
    actor_optim = OmegaConf.to_container(config.actor_rollout_ref.actor.optim)
    assert actor_optim["total_training_steps"] == 4
    assert config.critic.optim.total_training_steps == 4
    # warmup W = int(0.5 * 4) = 2 steps from 0, then a cosine over the remaining 2: 0, 0.5, 1, 0.5
    assert lrs(actor_optim, 4) == pytest.approx([0.0, 0.5, 1.0, 0.5])


def test_without_total_steps_the_run_length_is_the_batches_of_the_epochs(
    tiny_model_dir, arithmetic_data, tmp_path
):
    """No ``total_training_steps``: T = batches per epoch x epochs = (64 prompts // 16) x 1 = 4, W = 0,
    m = 0, so a cosine without warmup gives 1/2 (1 + cos(pi k / 4)) for k = 0..3 (the GRPO run's actor
    receives these, as the PPO run's does in tests/trainer/ppo/test_lr_schedule_e2e.py)."""
    config = _built_trainer_config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "trainer.total_training_steps=null",
        "trainer.total_epochs=1",
    )
    actor_optim = OmegaConf.to_container(config.actor_rollout_ref.actor.optim)
    assert actor_optim["total_training_steps"] == 4
    assert lrs(actor_optim, 4) == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)])
    with pytest.raises(ValueError, match="total_training_steps"):
        lrs({"lr": 1.0, "lr_warmup_steps_ratio": 0.5, "total_training_steps": -1}, 1)


def test_zero_warmup_steps_means_no_warmup_even_with_a_ratio():
    # verl reads lr_warmup_steps=0 as "no warmup"; only a negative value hands over to the ratio
    optim = {"lr": 1.0, "lr_warmup_steps": 0, "lr_warmup_steps_ratio": 0.5, "total_training_steps": 4}
    assert lrs(optim, 2) == [1.0, 1.0]
    assert lrs({**optim, "lr_warmup_steps": -1}, 2) == [0.0, 0.5]
