"""``python -m hybridflow.plan_placement`` and ``trainer.placement=auto`` on a hand-made profile whose
ranking is derived by hand. The profile measures the target run itself at 1 and 2 workers, so the
cost model reproduces those times exactly and every placement's step is a sum of them:

phase seconds at 1 / 2 workers: gen 1.0 / 0.6, ref 0.4 / 0.3, values 0.4 / 0.3, update_actor 1.0 / 0.7,
update_critic 1.0 / 0.7, reward 0.1, adv 0.1 (the driver), 0.2 s outside the phases. No old-log-prob
pass (one PPO epoch, one mini-batch). A step = gen + prepare + adv + update + 0.2, each stage its
longest pool (the driver's reward is a lane of its own):

- actor+ref [1] | critic [1]: 1.0 + max(0.4, 0.4, 0.1) + 0.1 + max(1.0, 1.0) + 0.2 = 2.7
- everything on [2]:          0.6 + (0.3 + 0.3)        + 0.1 + (0.7 + 0.7)     + 0.2 = 2.9
- actor [1] | ref+critic [1]: 1.0 + (0.4 + 0.4)        + 0.1 + max(1.0, 1.0)   + 0.2 = 3.1
- actor+critic [1] | ref [1]: 1.0 + max(0.4, 0.4)      + 0.1 + (1.0 + 1.0)     + 0.2 = 3.7
- everything on [1]:          1.0 + (0.4 + 0.4)        + 0.1 + (1.0 + 1.0)     + 0.2 = 4.1
"""

import json
from dataclasses import asdict

import pytest

from hybridflow import plan_placement
from hybridflow.placement.memory import activation_bytes
from hybridflow.placement.planner import resolve_auto_placement, workload_from_config
from hybridflow.placement.spec import placement_from_config
from hybridflow.trainer.config import load_config, validate_config

SECONDS = {
    1: {
        "gen": 1.0,
        "ref": 0.4,
        "values": 0.4,
        "update_actor": 1.0,
        "update_critic": 1.0,
        "reward": 0.1,
        "adv": 0.1,
    },
    2: {
        "gen": 0.6,
        "ref": 0.3,
        "values": 0.3,
        "update_actor": 0.7,
        "update_critic": 0.7,
        "reward": 0.1,
        "adv": 0.1,
    },
}
EXPECTED = [
    (2.7, "actor_rollout+ref on actor_rollout_ref [1]; critic on critic [1]"),
    (2.9, "actor_rollout+ref+critic on actor_rollout_ref_critic [2]"),
    (3.1, "actor_rollout on actor_rollout [1]; ref+critic on ref_critic [1]"),
    (3.7, "actor_rollout+critic on actor_rollout_critic [1]; ref on ref [1]"),
    (4.1, "actor_rollout+ref+critic on actor_rollout_ref_critic [1]"),
]


def _args(tiny_model_dir, profile_path) -> list[str]:
    return [
        "--profile", str(profile_path),
        "--actor", tiny_model_dir,
        "--critic", tiny_model_dir,
        "--ref",
        "--devices", "2",
        "--batch", "4",
        "--n", "2",
        "--prompt-length", "40",
        "--response-length", "6",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",  # divides every pool's mini-batch
    ]  # fmt: skip


@pytest.fixture()
def profile_path(tiny_model_dir, tmp_path):
    """The hand-made profile, on the workload the CLI arguments describe."""
    args = plan_placement.build_parser().parse_args(_args(tiny_model_dir, "unused"))
    load = workload_from_config(load_config(plan_placement.plan_overrides(args)))
    samples = [
        {
            "workers": dict.fromkeys(load.params, w),
            "workload": asdict(load),
            "seconds": SECONDS[w],
            "step_s": sum(SECONDS[w].values()) + 0.2,
        }
        for w in (1, 2)
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"version": 1, "device": "cpu", "device_memory_gb": None, "samples": samples}))
    return path


def _ranking_rows(out: str) -> list[str]:
    """The ranking's rows: the lines after its header (a line another thread of this test process
    printed before it must not shift them; seen once under pytest-xdist)."""
    lines = out.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["rank", "s/step", "workers"])
    return lines[header + 1 :]


def test_plan_prints_the_hand_derived_ranking(tiny_model_dir, profile_path, capsys):
    plan_placement.main(_args(tiny_model_dir, profile_path))
    lines = _ranking_rows(capsys.readouterr().out)
    assert len(lines) == len(EXPECTED)
    for line, (seconds, placement) in zip(lines, EXPECTED, strict=True):
        rank, predicted, workers, rest = line.split(maxsplit=3)
        assert float(predicted) == pytest.approx(seconds, abs=1e-3) and rest.startswith(placement), line


def test_device_memory_rules_out_placements_that_do_not_fit(tiny_model_dir, profile_path, capsys):
    # the actor's 20 bytes/param alone need about half of this budget per worker: a worker holding the
    # actor and the critic (16 bytes/param) does not fit, two workers sharing them do. On top: the
    # actor's activations, the largest (2 rows per micro-batch on any pool; the reference's 16-row
    # micro-batch holds at most the 8 rows of a worker: 8 x 46 x (124 x 64 + 4 x 512) bytes, less)
    args = plan_placement.build_parser().parse_args(_args(tiny_model_dir, "unused"))
    load = workload_from_config(load_config(plan_placement.plan_overrides(args)))
    activations = activation_bytes(load, "actor_rollout", 1, 1)
    assert activations > activation_bytes(load, "ref", 1, 1)
    budget_gb = (30 * load.params["actor_rollout"] + activations) / 2**30 / 0.9
    plan_placement.main([*_args(tiny_model_dir, profile_path), "--device-memory-gb", str(budget_gb)])
    lines = _ranking_rows(capsys.readouterr().out)
    assert [line.split(maxsplit=3)[3].split("  (")[0] for line in lines] == [
        "actor_rollout+ref on actor_rollout_ref [1]; critic on critic [1]",
        "actor_rollout+ref+critic on actor_rollout_ref_critic [2]",
        "actor_rollout on actor_rollout [1]; ref+critic on ref_critic [1]",
    ]


def test_placement_auto_runs_the_planner_s_choice(tiny_model_dir, arithmetic_data, profile_path):
    train, test = arithmetic_data
    args = plan_placement.build_parser().parse_args(_args(tiny_model_dir, profile_path))
    config = load_config(
        [
            *plan_placement.plan_overrides(args),
            f"data.train_files={train}",
            f"data.val_files={test}",
            "trainer.placement=auto",
            f"trainer.placement_profile={profile_path}",
        ]
    )
    validate_config(config)
    notes = resolve_auto_placement(config)
    assert notes == [
        "trainer.placement=auto: actor_rollout+ref on actor_rollout_ref [1]; critic on critic [1] "
        "(predicted 2.70 s/step of 5 placements; next: actor_rollout+ref+critic on "
        "actor_rollout_ref_critic [2] (2.90 s))"
    ]
    assert config.trainer.resource_pool_spec == {"actor_rollout_ref": [1], "critic": [1]}
    validate_config(config)  # the written choice is a valid placement
    placement = placement_from_config(config)
    assert placement.mapping == {
        "actor_rollout": "actor_rollout_ref",
        "ref": "actor_rollout_ref",
        "critic": "critic",
    }
    assert resolve_auto_placement(config) == []  # written once
