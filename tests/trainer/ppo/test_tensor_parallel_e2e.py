"""GRPO through ``run_ppo`` on 2 worker processes with tensor parallelism: the actor (and reference)
trained with t = 2 and the engine generating with t_g = 1, then both = 2, against t = t_g = 1.

With t_g = 1 the generation layout (2 engines, one per rank, seeded per rank) is the TP = 1 run's, and
the engines hold bit-identical weights at step 1, so the step-1 rewards are the same samples' rewards
and the step-1 update (one mini-batch) sees the same batch: its loss, entropy and gradient norm agree to
fp32 tolerance. After it, Adam's first step (``lr * sign(g)`` for every weight) turns fp32 rounding in
near-zero gradients into different weights, so step 2 samples differently: its rewards agree within
sampling noise. With t_g = 2 one generation group of both ranks samples the whole batch from one seed:
rewards agree within sampling noise, and the engine's log-probs of its samples equal the TP actor's
(``training/rollout_log_probs_diff_max``, old log-probs computed by the actor's own pass)."""

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from tests.tiny_run import as_overrides, tiny_run_values

SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward in [0, 1] that varies with every sampled token (a random model rarely answers right)."""
    return (sum(map(ord, solution_str)) % 11) / 10
'''


def _run(tmp: Path, model_dir: str, data, actor_tp: int, rollout_tp: int) -> dict[int, dict]:
    scorer = tmp / "scorer.py"
    scorer.write_text(SCORER)
    values = tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.reuse_update_log_probs": False,
            "actor_rollout_ref.actor.optim.lr": 1e-3,
            "actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.actor.tensor_model_parallel_size": actor_tp,
            "actor_rollout_ref.rollout.tensor_model_parallel_size": rollout_tp,
            "custom_reward_function.path": str(scorer),
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 2,
            "trainer.experiment_name": f"tp{actor_tp}_{rollout_tp}",
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_ppo(config)
    lines = next(tmp.rglob("metrics.jsonl")).read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


class _Runs(dict):
    """Each layout's run, made the first time a test asks for it (the fast tier runs two of the three)."""

    def __init__(self, model_dir, data, tmp_path_factory):
        super().__init__()
        self.model_dir, self.data, self.tmp_path_factory = model_dir, data, tmp_path_factory

    def __missing__(self, layout):
        tmp = self.tmp_path_factory.mktemp(f"tp{layout[0]}{layout[1]}")
        self[layout] = _run(tmp, self.model_dir, self.data, *layout)
        return self[layout]


@pytest.fixture(scope="module")
def runs(ray_session, tiny_model_dir, arithmetic_data, tmp_path_factory):
    return _Runs(tiny_model_dir, arithmetic_data, tmp_path_factory)


# 8 responses with scores in [0, 1]: a mean's standard error is at most 0.5 / sqrt(8); two runs differ
# by more than 4 standard errors of the difference with probability < 1e-4
NOISE = 4 * math.sqrt(2 * 0.25 / 8)


# make test-slow: two whole runs compared; TP itself is exact in tests/workers/test_tensor_parallel.py
@pytest.mark.slow
def test_tp_training_with_per_rank_generation_repeats_the_tp1_run(runs):
    base, tp = runs[(1, 1)], runs[(2, 1)]
    for key in ("critic/score/mean", "response_length/mean"):
        assert tp[1][key] == base[1][key], key  # the same samples
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert tp[1][key] == pytest.approx(base[1][key], rel=1e-4, abs=1e-6), key
    assert abs(tp[2]["critic/score/mean"] - base[2]["critic/score/mean"]) <= NOISE
    assert tp[2]["training/rollout_log_probs_diff_max"] < 1e-4


# make test-slow: a third whole run; engine TP itself is in tests/workers/rollout/test_resharding.py
@pytest.mark.slow
def test_tp_generation_groups_sample_the_tp_actors_distribution(runs):
    base, both = runs[(1, 1)], runs[(2, 2)]
    for step in (1, 2):
        assert both[step]["training/rollout_log_probs_diff_max"] < 1e-4
        assert abs(both[step]["critic/score/mean"] - base[step]["critic/score/mean"]) <= NOISE
        assert both[step]["actor/grad_norm"] > 0
