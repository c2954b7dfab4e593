"""PPO (actor + reference + critic) through ``run_ppo`` with the actor on one resource pool and the
reference and critic on another: the pools are separate processes, their phases overlap
(``timing_s/overlap_saved``), and the numbers equal a run that issues every phase one at a time."""

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from hybridflow.trainer.ppo.workers_setup import build_worker_groups
from tests.tiny_run import PPO_EXTRA, as_overrides, tiny_run_values

COMPARED = [
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
    "critic/values/mean",
    "critic/score/mean",
    "critic/advantages/mean",
    "response_length/mean",
]


def _config(tiny_model_dir, arithmetic_data, tmp_path, **extra):
    values = tiny_run_values(
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "ckpt",
        **{
            **PPO_EXTRA,
            "trainer.placement": "pools",
            "trainer.resource_pool_spec": "{actor:[1],aux:[1]}",
            "trainer.role_pool_mapping": "{actor_rollout:actor,ref:aux,critic:aux}",
            "trainer.save_on_preempt": False,
            **extra,
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    return config


@pytest.fixture(scope="module")
def split_groups(ray_session, tiny_model_dir, arithmetic_data, tmp_path_factory):
    config = _config(tiny_model_dir, arithmetic_data, tmp_path_factory.mktemp("wg"))
    groups = build_worker_groups(config, use_critic=True, use_reference=True)
    yield groups
    groups.shutdown()


def _run(config, groups, tmp_path: Path, name: str) -> dict[int, dict]:
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        run_ppo(config, worker_groups=groups)
    lines = (tmp_path / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_roles_on_two_pools_are_separate_processes(split_groups):
    assert set(split_groups.pools) == {"actor", "aux"}
    assert split_groups.ref is not split_groups.actor_rollout  # the reference is a worker of its own
    actor_pids = set(split_groups.actor_rollout.worker_pids)
    assert actor_pids.isdisjoint(split_groups.critic.worker_pids)
    assert split_groups.critic.worker_pids == split_groups.ref.worker_pids  # colocated on aux
    assert split_groups.total_workers == 2 and split_groups.world_size == 1


def test_concurrent_phases_overlap_and_equal_the_sequential_run(
    split_groups, tiny_model_dir, arithmetic_data, tmp_path
):
    runs = {}
    for concurrent in (True, False):
        name = f"concurrent_{concurrent}"
        config = _config(
            tiny_model_dir,
            arithmetic_data,
            tmp_path,
            **{"trainer.concurrent_phases": concurrent, "trainer.experiment_name": name},
        )
        runs[concurrent] = _run(config, split_groups, tmp_path, name)
    for step in (1, 2):
        together, apart = runs[True][step], runs[False][step]
        for key in COMPARED:
            assert math.isfinite(together[key]), key
            assert together[key] == pytest.approx(apart[key], rel=1e-6, abs=1e-7), (step, key)
        for phase in ("gen", "ref", "values", "update_critic", "update_actor", "reward"):
            assert together[f"timing_s/{phase}"] > 0 and apart[f"timing_s/{phase}"] > 0
        assert "timing_s/overlap_saved" not in apart
        # the critic's update (another pool) overlaps the actor's: the saving is at least part of the
        # shorter of the two
        shorter = min(together["timing_s/update_critic"], together["timing_s/update_actor"])
        assert together["timing_s/overlap_saved"] > 0.3 * shorter
    assert runs[True][2]["actor/kl_loss"] > 0  # the reference (its own worker) differs from the updated actor
