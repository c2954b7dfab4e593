"""The planner against the clock: a short profiling run calibrates the cost model, three placements
of a PPO run (actor, reference, critic) on this machine's two cores are then actually trained, and
the placement the planner ranks first is the one measured fastest.

The three: everything colocated on 1 worker, everything colocated on 2 workers, and the actor on one
worker with the reference and critic on another. The profile is two separate runs (colocated on 1 and
on 2 workers, phases one at a time); the measured runs take turns (round robin) so that a slow
moment of the machine does not fall on one placement only.
"""

import json
import statistics

import pytest

from hybridflow.placement.planner import format_ranking, load_profile, rank_placements
from hybridflow.placement.spec import placement_from_config
from hybridflow.profile_placement import measure_run, profile
from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo.workers_setup import build_worker_groups

pytestmark = pytest.mark.slow  # make test-slow: eight timed training runs of a 1M-parameter model

ROUNDS, STEPS = 2, 5
MODEL = {"hidden_size": 128, "num_layers": 4, "intermediate_size": 352}
CANDIDATES = {
    "colocated_1": ["trainer.n_gpus_per_node=1"],
    "colocated_2": ["trainer.n_gpus_per_node=2"],
    "split": [
        "trainer.n_gpus_per_node=2",
        "trainer.placement=pools",
        "trainer.resource_pool_spec={actor_rollout:[1],ref_critic:[1]}",
        "trainer.role_pool_mapping={actor_rollout:actor_rollout,ref:ref_critic,critic:ref_critic}",
    ],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small model with enough compute per phase (~1M parameters) that overlapping phases pays."""
    from hybridflow.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("planner_model") / "model", **MODEL))


@pytest.fixture(scope="module")
def run_overrides(model_dir, arithmetic_data, tmp_path_factory):
    train, test = arithmetic_data
    return [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=8",
        "data.max_prompt_length=40",
        "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # two updates a step: old log-probs are a phase
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "critic.enable=true",
        f"trainer.default_local_dir={tmp_path_factory.mktemp('ckpt')}",
    ]


def test_the_planner_ranks_the_measured_fastest_placement_first(
    ray_session, run_overrides, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    configs = {name: load_config([*run_overrides, *extra]) for name, extra in CANDIDATES.items()}
    groups = {
        name: build_worker_groups(c, use_critic=True, use_reference=True) for name, c in configs.items()
    }
    try:
        # 1. the short profiling run (its own runs, on the colocated candidates' processes)
        prof = profile(
            run_overrides, [1, 2], steps=3, worker_groups={1: groups["colocated_1"], 2: groups["colocated_2"]}
        )
        (tmp_path / "profile.json").write_text(json.dumps(prof))
        model, _ = load_profile(str(tmp_path / "profile.json"))
        # 2. the three placements, trained in turns
        steps_s = {name: [] for name in CANDIDATES}
        for round_ in range(ROUNDS):
            for name, extra in CANDIDATES.items():
                run = measure_run([*run_overrides, *extra], STEPS, f"{name}_{round_}", groups[name])
                steps_s[name] += run["steps_s"]
        measured = {name: statistics.median(times) for name, times in steps_s.items()}
        # 3. the planner's ranking of the same three
        placements = [placement_from_config(c) for c in configs.values()]
        ranked = rank_placements(configs["split"], model, candidates=placements)
        print(format_ranking(ranked))
        print("measured s/step:", {name: round(s, 4) for name, s in measured.items()})
        assert len(ranked) == 3
        fastest = min(measured, key=measured.get)
        assert ranked[0].placement.shape == placement_from_config(configs[fastest]).shape, (
            ranked[0],
            measured,
        )
    finally:
        for group in groups.values():
            group.shutdown()
    # the full search (every partition and allocation on 2 devices) holds these three, and its winner is
    # predicted no slower than theirs
    everything = rank_placements(configs["split"], model)
    assert len(everything) == 5 and everything[0].seconds <= ranked[0].seconds
    shapes = {c.placement.shape: c.seconds for c in everything}
    for cand in ranked:
        assert shapes[cand.placement.shape] == pytest.approx(cand.seconds)
