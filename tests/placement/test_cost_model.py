"""The planner's cost model and enumeration, on hand-derived numbers."""

import pytest

from hybridflow.placement.cost_model import (
    CostModel,
    PhaseFit,
    Workload,
    _simplest_nonnegative_fit,
    step_seconds,
)
from hybridflow.placement.planner import allocations, enumerate_placements, set_partitions
from hybridflow.placement.spec import Placement

# actor 10 params x 2 layers, critic 5 x 2; 4 rows of 3 prompt + 2 response tokens
LOAD = Workload(
    params={"actor_rollout": 10.0, "ref": 10.0, "critic": 5.0},
    layers={"actor_rollout": 2, "ref": 2, "critic": 2},
    rows=4,
    prompt_length=3,
    response_length=2,
)


def test_work_and_serial_units():
    # gen: serial = 2 decode steps x 2 layers; work = 4 rows x 5 tokens x 10 params
    assert (LOAD.serial("gen"), LOAD.work("gen")) == (4.0, 200.0)
    assert (LOAD.serial("values"), LOAD.work("values")) == (2.0, 100.0)  # the critic's 5 params
    assert (LOAD.serial("reward"), LOAD.work("reward")) == (0.0, 4.0)  # the driver: per row
    assert sorted(LOAD.phases()) == sorted(
        ["gen", "reward", "adv", "update_actor", "old_log_prob", "ref", "values", "update_critic"]
    )


def test_calibration_recovers_alpha_and_beta_from_two_worker_counts():
    # t = alpha*serial + beta*work/workers with alpha=0.01, beta=0.001 for every worker phase
    def seconds(workers: int) -> dict:
        out = {p: 0.01 * LOAD.serial(p) + 0.001 * LOAD.work(p) / workers for p in LOAD.phases()}
        out["reward"] = out["adv"] = 0.002 * LOAD.rows  # driver phases do not scale with workers
        return out

    samples = [
        {
            "workload": LOAD,
            "workers": dict.fromkeys(LOAD.params, w),
            "seconds": seconds(w),
            "step_s": 0.5 + sum(seconds(w).values()),
        }
        for w in (1, 2)
    ]
    model = CostModel.calibrate(samples)
    for phase in ("gen", "old_log_prob", "ref", "values", "update_actor", "update_critic"):
        assert model.fits[phase].alpha == pytest.approx(0.01)
        assert model.fits[phase].beta == pytest.approx(0.001)
    assert model.fits["reward"].beta == pytest.approx(0.002) and model.fits["reward"].alpha == 0
    assert model.overhead_s == pytest.approx(0.5)
    # 4 workers: gen = 0.01*4 + 0.001*200/4
    assert model.phase_seconds(LOAD, "gen", 4) == pytest.approx(0.04 + 0.05)


def test_more_workers_being_slower_is_explained_by_communication():
    # measured: 1 worker 0.5 s, 2 workers 0.6 s (a small model: the collectives cost more than they save)
    samples = [
        {"workload": LOAD, "workers": dict.fromkeys(LOAD.params, w), "seconds": {"values": t}, "step_s": t}
        for w, t in ((1, 0.5), (2, 0.6))
    ]
    fit = CostModel.calibrate(samples).fits["values"]
    # alpha * 2 layers = 0.5; gamma * 5 params * 1/2 = 0.1; no beta (that would make 2 workers faster)
    assert (fit.alpha, fit.beta, fit.gamma) == pytest.approx((0.25, 0.0, 0.04))
    model = CostModel({"values": fit})
    assert model.phase_seconds(LOAD, "values", 4) == pytest.approx(0.5 + 0.04 * 5 * 3 / 4)


def test_the_fit_never_goes_negative():
    # time falls more than 1/workers predicts: no exact non-negative fit; the best is beta alone
    rows = [(1.0, 10.0, 0.0, 10.0), (1.0, 5.0, 1.0, 4.0)]
    alpha, beta, gamma = _simplest_nonnegative_fit(rows)
    assert min(alpha, beta, gamma) >= 0
    assert (alpha, gamma) == (0.0, 0.0) and beta == pytest.approx((10 * 10 + 5 * 4) / (10**2 + 5**2))


def _unit_model(seconds_per_phase: dict[str, float]) -> CostModel:
    """Phase times that ignore the workload: beta * work / workers with work normalised away."""
    fits = {}
    for phase, s in seconds_per_phase.items():
        work = LOAD.work(phase)
        fits[phase] = PhaseFit(alpha=0.0, beta=s / work if work else 0.0)
    return CostModel(fits, overhead_s=0.1)


def test_a_step_is_each_stage_s_longest_pool_when_concurrent_and_the_sum_when_not():
    model = _unit_model(
        {
            "gen": 4,
            "old_log_prob": 1,
            "ref": 1,
            "values": 2,
            "reward": 0.5,
            "adv": 0.2,
            "update_actor": 3,
            "update_critic": 2,
        }
    )
    split = {"actor_rollout": "a", "ref": "b", "critic": "b"}
    total, stages = step_seconds(model, LOAD, split, {"a": 1, "b": 1})
    # prepare: pool a = old 1, pool b = ref 1 + values 2 = 3, driver = reward 0.5 -> 3
    # update: pool a = 3, pool b = 2 -> 3
    assert stages == {"gen": 4.0, "prepare": 3.0, "adv": 0.2, "update": 3.0}
    assert total == pytest.approx(10.3)
    colocated = dict.fromkeys(split, "a")
    total, stages = step_seconds(model, LOAD, colocated, {"a": 1})
    assert stages["prepare"] == 4.0 and stages["update"] == 5.0  # one pool: its phases queue
    total, stages = step_seconds(model, LOAD, split, {"a": 1, "b": 1}, concurrent=False)
    assert stages["prepare"] == 4.5 and stages["update"] == 5.0  # one after the other, driver included
    # twice the workers halve every worker phase (beta only), not the driver's
    total, stages = step_seconds(model, LOAD, colocated, {"a": 2})
    assert stages["gen"] == 2.0 and stages["prepare"] == 2.0 and stages["adv"] == 0.2


def test_enumeration_counts():
    assert [len(set_partitions(list("abcd"[:k]))) for k in range(1, 5)] == [1, 2, 5, 15]  # Bell numbers
    assert sorted(allocations(2, 3)) == [(1, 1), (1, 2), (2, 1)]
    found = enumerate_placements(["actor_rollout", "ref", "critic"], devices_per_node=2)
    # one set: 1 or 2 workers; two sets (3 ways to split): 1 + 1; three sets need 3 devices
    assert len(found) == 5
    assert (
        Placement(
            {"actor_rollout_ref_critic": (2,)},
            dict.fromkeys(["actor_rollout", "ref", "critic"], "actor_rollout_ref_critic"),
        )
        in found
    )
    assert (
        Placement(
            {"actor_rollout": (1,), "ref_critic": (1,)},
            {"actor_rollout": "actor_rollout", "ref": "ref_critic", "critic": "ref_critic"},
        )
        in found
    )
    two_nodes = enumerate_placements(["actor_rollout"], devices_per_node=2, nnodes=2)
    assert [p.pools for p in two_nodes] == [{"actor_rollout": (1, 1)}, {"actor_rollout": (2, 2)}]
