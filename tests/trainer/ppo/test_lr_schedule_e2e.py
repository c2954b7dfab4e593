"""Learning-rate schedules end to end through ``run_ppo``: the workers start before the trainer knows
the run's length, and their schedules still get it (issue 22's regression).

Each run starts its own worker processes, as ``main_ppo`` does, so the total reaches them the way it
reaches a user's run. ``actor/lr`` and ``critic/lr`` are the rates step k's update used; the expected
values are verl's schedules written out by hand below (``verl/utils/torch_functional.py``):

- constant with W warmup steps: k / W for k < W, then 1;
- cosine with W warmup steps over T steps: k / W for k < W, then
  max(m, (1 + m) / 2 + (1 - m) / 2 * cos(2 pi c (k - W) / (T - W))), m = min_lr_ratio, c = num_cycles;
- W = lr_warmup_steps when >= 0, else int(lr_warmup_steps_ratio * T);

with k = step - 1 (the first update uses the schedule's value at 0).
"""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from tests.tiny_run import as_overrides, tiny_run_values

LR = 1e-3


def _run(tmp: Path, model_dir: str, data, name: str, **extra) -> dict[int, dict]:
    values = tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "trainer.n_gpus_per_node": 1,
            "trainer.experiment_name": name,
            "trainer.resume_mode": "disable",
            "actor_rollout_ref.actor.optim.lr": LR,
            **extra,
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_ppo(config)  # no worker groups given: they start before the data (and the total) is known
    lines = (tmp / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def _lrs(metrics: dict[int, dict], key: str, steps) -> list[float]:
    return [metrics[step][key] for step in steps]


@pytest.fixture(scope="module")
def ppo_run(ray_session, tiny_model_dir, arithmetic_data, tmp_path_factory):
    """PPO with GAE for 4 steps, saving at 2 and 4: the actor on a cosine with a warmup ratio and a
    floor, the critic constant after a warmup given in steps."""
    tmp = tmp_path_factory.mktemp("lr_ppo")
    extra = {
        "algorithm.adv_estimator": "gae",
        "critic.optim.lr": LR,
        "trainer.total_training_steps": 4,
        "trainer.save_freq": 2,
        "actor_rollout_ref.actor.optim.warmup_style": "cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.5,
        "actor_rollout_ref.actor.optim.min_lr_ratio": 0.2,
        "critic.optim.warmup_style": "constant",
        "critic.optim.lr_warmup_steps": 3,
    }
    return {"tmp": tmp, "extra": extra, "metrics": _run(tmp, tiny_model_dir, arithmetic_data, "ppo", **extra)}


def test_cosine_with_a_warmup_ratio_and_a_floor_reaches_the_actor(ppo_run):
    # T = 4, W = int(0.5 * 4) = 2, m = 0.2: k = 0, 1 warm up (0, 1/2); k = 2, 3 take the cosine at
    # progress 0 and 1/2: 0.6 + 0.4 cos(0) = 1 and 0.6 + 0.4 cos(pi / 2) = 0.6
    expected = [0.0, 0.5 * LR, LR, 0.6 * LR]
    assert _lrs(ppo_run["metrics"], "actor/lr", range(1, 5)) == pytest.approx(expected, abs=1e-12)


def test_constant_after_a_warmup_in_steps_reaches_the_critic(ppo_run):
    # W = 3: 0, 1/3, 2/3, then 1
    expected = [0.0, LR / 3, 2 * LR / 3, LR]
    assert _lrs(ppo_run["metrics"], "critic/lr", range(1, 5)) == pytest.approx(expected, abs=1e-12)


# make test-slow: a whole run resumed mid-schedule (resumes are the slow tier's)
@pytest.mark.slow
def test_a_run_resumed_mid_schedule_continues_the_same_rates(
    ppo_run, tiny_model_dir, arithmetic_data, tmp_path
):
    ckpt = ppo_run["tmp"] / "ckpt" / "global_step_2"
    resumed = _run(
        tmp_path,
        tiny_model_dir,
        arithmetic_data,
        "resumed",
        **{
            **ppo_run["extra"],
            "trainer.save_freq": -1,
            "trainer.resume_mode": "resume_path",
            "trainer.resume_from_path": str(ckpt),
        },
    )
    assert sorted(resumed) == [3, 4]
    for key in ("actor/lr", "critic/lr"):
        assert _lrs(resumed, key, (3, 4)) == pytest.approx(_lrs(ppo_run["metrics"], key, (3, 4)), abs=1e-15)
