"""``python -m hybridflow.trainer.fully_async_main`` end to end on the tiny model (a trainer pool of one
process, a rollout pool of one):

- staleness 0 with a sync every step is on-policy: it equals synchronous ``main_ppo`` step by step —
  same prompts, same sampled tokens (each sample draws from its own stream), same scores and losses;
- staleness 1 with partial rollout and token-level IS runs, keeps every sample's version gap within the
  bound and reports ``fully_async/*`` and ``rollout_corr/*``.
"""

import json
import math

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from tests.tiny_run import as_overrides, tiny_run_values

COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm")


def _values(model_dir, data, tmp, name, **extra) -> dict:
    return tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "trainer.n_gpus_per_node": 1,
            "trainer.experiment_name": name,
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 3,
            "trainer.rollout_data_dir": str(tmp / "rollouts" / name),
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "actor_rollout_ref.actor.entropy_coeff": 0.01,
            "data.max_response_length": 8,
            **extra,
        },
    )


def _metrics(tmp, name) -> dict[int, dict]:
    lines = (tmp / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def _rollouts(tmp, name, step) -> list[tuple]:
    rows = [json.loads(line) for line in (tmp / "rollouts" / name / f"{step}.jsonl").read_text().splitlines()]
    return sorted((row["input"], row["output"], row["score"]) for row in rows)


def _run_fully_async(values: dict, tmp):
    from hybridflow.trainer.fully_async.main import run_fully_async

    config = load_config(as_overrides(values), config_name="fully_async_ppo_trainer")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_fully_async(config)


ON_POLICY = {
    "async_training.staleness_threshold": 0,
    "async_training.trigger_parameter_sync_step": 1,
    "async_training.partial_rollout": False,
    "async_training.use_rollout_log_probs": False,  # old log-probs recomputed, as main_ppo's
}


@pytest.fixture(scope="module")
def on_policy_runs(ray_session, vllm_model_dir, arithmetic_data, tmp_path_factory):
    """One synchronous ``main_ppo`` run and one on-policy fully-async run of 4 steps (the latter saving
    at steps 2 and 4), in one directory: two tests read them (a run costs ~30 CPU-seconds)."""
    from hybridflow.trainer.main_ppo import run_ppo

    tmp = tmp_path_factory.mktemp("on_policy")
    sync_values = _values(vllm_model_dir, arithmetic_data, tmp, "sync", **{"trainer.total_training_steps": 4})
    sync = load_config(as_overrides(sync_values))
    OmegaConf.resolve(sync)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_ppo(sync)
    whole = _values(
        vllm_model_dir,
        arithmetic_data,
        tmp,
        "fully_async",
        **ON_POLICY,
        **{"trainer.total_training_steps": 4, "trainer.save_freq": 2},
    )
    _run_fully_async(whole, tmp)
    return tmp


@pytest.mark.slow  # make test-slow (~60-90 s: two whole runs); the fast tier's make test budget
def test_staleness_zero_with_a_sync_every_step_equals_main_ppo(on_policy_runs):
    tmp = on_policy_runs
    sync_metrics, async_metrics = _metrics(tmp, "sync"), _metrics(tmp, "fully_async")
    assert sorted(async_metrics) == sorted(sync_metrics) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert _rollouts(tmp, "fully_async", step) == _rollouts(tmp, "sync", step)
        for key in COMPARED:
            assert async_metrics[step][key] == pytest.approx(sync_metrics[step][key], rel=1e-6, abs=1e-7), (
                step,
                key,
            )
        assert async_metrics[step]["fully_async/staleness/max"] == 0.0
    assert async_metrics[4]["fully_async/count/current_param_version"] == 3  # synced after steps 1, 2, 3


@pytest.fixture(scope="module")
def mixed_length_data(tmp_path_factory):
    """Arithmetic prompts of 1- to 3-digit operands: their token lengths differ, so groups finished at
    different times come padded to different prompt widths."""
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_rl_dataset

    train, test = write_rl_dataset(
        tmp_path_factory.mktemp("mixed"),
        ArithmeticTaskConfig(min_digits=1, max_digits=3, num_train=64, num_test=6),
    )
    return str(train), str(test)


def _pause_mid_generation(monkeypatch) -> list[int]:
    """Make every sync's pause land while a request is being generated: the pause waits (at most 30 s)
    until a replica holds a request, then 20 ms (the engine decodes a few of its 96 tokens), and records
    how many requests it aborted. Without it, whether a sync finds a sample mid-flight depends on the
    machine: where generation outruns the update, every sample is done before the sync (CI's did)."""
    import asyncio
    import time

    from hybridflow.trainer.fully_async.rollouter import Rollouter

    pause, aborted = Rollouter._pause, []

    async def requests_held(self) -> int:
        return sum(await asyncio.gather(*[server.in_flight.remote() for server in self.manager.servers]))

    async def pause_mid_generation(self):
        deadline = time.monotonic() + 30.0
        while self.in_flight and not await requests_held(self) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        aborted.append(await requests_held(self))
        await pause(self)

    monkeypatch.setattr(Rollouter, "_pause", pause_mid_generation)
    return aborted


@pytest.mark.slow  # make test-slow (77 s): the fast tier keeps fully_async_main's staleness-0 run
def test_stale_partial_rollouts_with_token_is(
    ray_session, vllm_model_dir, mixed_length_data, tmp_path, monkeypatch
):
    """Staleness 1 with partial rollout: every sample waits 3 s before it generates (longer than an
    update), so samples are in flight at each sync, which aborts them mid-generation; they resume under
    the new weights."""
    loop = "tests.workers.rollout.verl_style_agent_loops.SlowSingleTurnAgentLoop"
    (tmp_path / "loops.yaml").write_text(f"- name: slow\n  _target_: {loop}\n  delay_s: 3.0\n  every: 1\n")
    aborted = _pause_mid_generation(monkeypatch)
    values = _values(
        vllm_model_dir,
        mixed_length_data,
        tmp_path,
        "stale",
        **{
            "async_training.staleness_threshold": 1,
            "async_training.partial_rollout": True,
            "async_training.use_rollout_log_probs": False,
            "algorithm.rollout_correction.rollout_is": "token",
            "trainer.total_training_steps": 4,
            "data.max_response_length": 96,
            "actor_rollout_ref.rollout.ignore_eos": True,  # long samples: a sync lands while they run
            "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(tmp_path / "loops.yaml"),
            "actor_rollout_ref.rollout.agent.default_agent_loop": "slow",
        },
    )
    _run_fully_async(values, tmp_path)
    assert any(aborted), aborted  # some sync did find requests in flight
    metrics = _metrics(tmp_path, "stale")
    assert sorted(metrics) == [1, 2, 3, 4]
    for record in metrics.values():
        assert record["fully_async/staleness/max"] <= 1  # ceil(staleness_threshold)
        for key in (
            "fully_async/count/total_generated_samples",
            "fully_async/partial/partial_ratio",
            "fully_async/trainer/idle_ratio",
            "rollout_corr/rollout_is_mean",
            "rollout_corr/kl",
        ):
            assert math.isfinite(record[key]), key
    assert any(record["fully_async/staleness/max"] == 1 for record in metrics.values())  # it did run ahead
    assert any(record["fully_async/partial/partial_ratio"] > 0 for record in metrics.values())  # and resumed
    assert metrics[4]["timing_s/param_sync"] > 0
    # every sync was probed, and every replica held the trainer's weights (fp32: within 1e-2)
    assert all(record["fully_async/param_sync/probe_gap_max"] <= 1e-2 for record in metrics.values())


@pytest.mark.slow  # make test-slow: a weight sync broken on purpose in a running run
def test_a_broken_weight_sync_stops_the_run_naming_the_replica(
    ray_session, vllm_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    """The usual async config — staleness 1, the rollout's log-probs as old_log_probs — has no per-step
    gap check (its samples may come from older weights, and nothing is recomputed). A sync broken on
    purpose (the replicas get the initial weights again, labelled as the new version) is caught by the
    probe after that sync: the run stops with an error naming the replica and the version (before, it
    trained on, sampling from the initial weights)."""
    import hybridflow.trainer.fully_async.trainer as trainer_module
    from hybridflow.utils.rollout_parity import RolloutLogProbGapError

    real_sync = trainer_module.sync_parameters

    def broken_sync(manager, version):
        if version == 0:
            manager.keep_last_sent = True  # the initial weights, kept in the object store
            return real_sync(manager, version)
        # the old weights under the new version
        manager.rollout.receive_weights_by_checkpoint_engine(version, manager.last_sent)
        return {"timing_s/param_sync": 0.0}

    monkeypatch.setattr(trainer_module, "sync_parameters", broken_sync)
    values = _values(
        vllm_model_dir,
        arithmetic_data,
        tmp_path,
        "broken_sync",
        **{
            "async_training.staleness_threshold": 1,
            "trainer.total_training_steps": 3,
            "actor_rollout_ref.rollout.checkpoint_engine.backend": "object_store",
        },
    )
    named = r"sync to version 1: replica 0 \(rank 0\) \(rollout.name=engine\) samples with other weights"
    with pytest.raises(RolloutLogProbGapError, match=named):
        _run_fully_async(values, tmp_path)
    logged = tmp_path / "outputs" / "hybridflow" / "broken_sync" / "metrics.jsonl"
    assert not logged.exists() or not logged.read_text().strip()  # step 1's sync failed: nothing logged


# make test-slow: a second whole run resumed from the first one's checkpoint (resumes are the slow tier's)
@pytest.mark.slow
def test_a_resumed_run_continues_with_the_next_prompts(on_policy_runs, vllm_model_dir, arithmetic_data):
    """Checkpoints hold the groups trained and the parameter version: a run resumed at step 2 of the
    on-policy run (``on_policy_runs``' "fully_async") trains steps 3 and 4 on its prompts (and,
    on-policy, its very samples)."""
    tmp = on_policy_runs
    resumed = {
        **_values(
            vllm_model_dir,
            arithmetic_data,
            tmp,
            "resumed",
            **ON_POLICY,
            **{"trainer.total_training_steps": 4},
        ),
        "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": str(tmp / "ckpt" / "global_step_2"),
        "trainer.default_local_dir": str(tmp / "ckpt_resumed"),
    }
    _run_fully_async(resumed, tmp)
    assert sorted(_metrics(tmp, "resumed")) == [3, 4]
    for step in (3, 4):
        assert _rollouts(tmp, "resumed", step) == _rollouts(tmp, "fully_async", step)
    assert _metrics(tmp, "resumed")[3]["fully_async/count/groups_trained"] == 12


def _trained_prompts(tmp, name, step) -> list[str]:
    return sorted(row[0] for row in _rollouts(tmp, name, step))


@pytest.mark.slow  # make test-slow: delays injected into every third sample and every update
def test_slow_samples_and_slow_updates_keep_the_bound_and_the_data(
    ray_session, vllm_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    """Slow generations (every third prompt waits) and slow updates: every trained sample's version gap
    stays within the bound, each step trains the same prompts as the run without delays (oldest first,
    nothing dropped), so the trained response length does not drift toward the fast samples."""
    from hybridflow.trainer.fully_async.trainer import FullyAsyncTrainer

    stale = {
        "async_training.staleness_threshold": 1,
        "async_training.partial_rollout": True,
        "async_training.use_rollout_log_probs": False,
        "algorithm.rollout_correction.rollout_is": "token",
        "trainer.total_training_steps": 4,
    }
    _run_fully_async(_values(vllm_model_dir, arithmetic_data, tmp_path, "plain", **stale), tmp_path)
    loop = "tests.workers.rollout.verl_style_agent_loops.SlowSingleTurnAgentLoop"
    (tmp_path / "loops.yaml").write_text(f"- name: slow\n  _target_: {loop}\n  delay_s: 0.4\n")
    slow_update = FullyAsyncTrainer.after_update

    def after_a_slow_update(self):
        import time

        time.sleep(0.3)
        return slow_update(self)

    monkeypatch.setattr(FullyAsyncTrainer, "after_update", after_a_slow_update)
    delayed = {
        **stale,
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(tmp_path / "loops.yaml"),
        "actor_rollout_ref.rollout.agent.default_agent_loop": "slow",
    }
    _run_fully_async(_values(vllm_model_dir, arithmetic_data, tmp_path, "delayed", **delayed), tmp_path)
    plain, slow = _metrics(tmp_path, "plain"), _metrics(tmp_path, "delayed")
    for step in (1, 2, 3, 4):
        assert slow[step]["fully_async/staleness/max"] <= 1
        assert _trained_prompts(tmp_path, "delayed", step) == _trained_prompts(tmp_path, "plain", step)
    mean_length = [sum(m[s]["response_length/mean"] for s in m) / len(m) for m in (plain, slow)]
    assert mean_length[1] == pytest.approx(mean_length[0], rel=0.05)


@pytest.mark.slow  # make test-slow: a process of a running fully-async run killed, twice
@pytest.mark.parametrize(
    ("victim_class", "named"),
    [("StandaloneRolloutWorker", "rollout"), ("Colocated_actor", "actor")],
    ids=["rollout", "trainer"],
)
def test_a_killed_process_ends_the_run_with_an_error_naming_it_and_keeps_the_checkpoint(
    ray_session, vllm_model_dir, arithmetic_data, tmp_path, victim_class, named
):
    """SIGKILL of the rollout pool's (with ``max_replica_restarts=0``: no replacement) or the trainer
    pool's process after step 1: the run ends within 60 s with an error naming that pool's rank, and
    step 1's checkpoint stays the last good one."""
    import signal
    import threading
    import time

    import psutil

    from hybridflow.utils.checkpoint.tracker import read_latest_checkpointed_iteration

    values = _values(
        vllm_model_dir,
        arithmetic_data,
        tmp_path,
        "killed",
        **ON_POLICY,
        **{"trainer.total_training_steps": 50, "trainer.save_freq": 1},
        # no replacement: a rollout replica's death ends the run (past the limit, here the first)
        **{"actor_rollout_ref.rollout.max_replica_restarts": 0},
    )
    failure: list[BaseException] = []

    def run():
        try:
            _run_fully_async(values, tmp_path)
        except BaseException as error:  # the test inspects it
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while read_latest_checkpointed_iteration(str(tmp_path / "ckpt")) is None:
        assert time.monotonic() < deadline and thread.is_alive(), "the run did not save its first step"
        time.sleep(0.2)
    candidates = [
        p
        for p in psutil.process_iter(["cmdline", "create_time", "status"])
        if victim_class in " ".join(p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE
    ]
    assert candidates, f"no {victim_class} process"
    victim = max(candidates, key=lambda p: p.info["create_time"])  # not an earlier test's, still exiting
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    thread.join(timeout=90)
    assert not thread.is_alive(), f"the run hung after its {named} process died"
    assert time.monotonic() - killed_at < 60
    (error,) = failure
    assert named in str(error) and ("replica 0" in str(error) or "rank 0" in str(error)), str(error)
    last = read_latest_checkpointed_iteration(str(tmp_path / "ckpt"))
    assert last is not None and last >= 1
    assert (tmp_path / "ckpt" / f"global_step_{last}").is_dir()


@pytest.mark.slow  # make test-slow: a rollout replica of a running fully-async run killed with SIGKILL
def test_a_killed_rollout_replica_is_replaced_and_every_prompt_is_trained_once(
    ray_session, vllm_model_dir, arithmetic_data, tmp_path
):
    """Two rollout replicas; after step 1 one is killed with SIGKILL: the run finishes its 6 steps, a
    new replica took its place (``rollout/replica_restarts`` = 1), the staleness bound held, and every
    prompt of the 24 trained was trained once with its 2 samples (none lost, none twice)."""
    import signal
    import threading
    import time
    from collections import Counter

    import psutil

    values = _values(
        vllm_model_dir,
        arithmetic_data,
        tmp_path,
        "elastic",
        **{
            "rollout.n_gpus_per_node": 2,
            "trainer.total_training_steps": 6,
            "async_training.staleness_threshold": 1,
            "async_training.trigger_parameter_sync_step": 1,
            "async_training.partial_rollout": True,
            "data.max_response_length": 16,
        },
    )
    failure: list[BaseException] = []

    def run():
        try:
            _run_fully_async(values, tmp_path)
        except BaseException as error:  # the test inspects it
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    log = tmp_path / "outputs" / "hybridflow" / "elastic" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (log.exists() and log.read_text().strip()):
        assert time.monotonic() < deadline and thread.is_alive(), f"the run did not log step 1: {failure}"
        time.sleep(0.1)
    replicas = [
        p
        for p in psutil.process_iter(["cmdline", "create_time", "status"])
        if "StandaloneRolloutWorker" in " ".join(p.info["cmdline"] or [])
        and p.info["status"] != psutil.STATUS_ZOMBIE
    ]
    assert len(replicas) >= 2, "no two rollout replicas"
    victim = max(replicas, key=lambda p: p.info["create_time"])  # this run's (an earlier test's may linger)
    victim.send_signal(signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive(), "the run hung after a rollout replica died"
    assert not failure, failure
    metrics = _metrics(tmp_path, "elastic")
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    assert metrics[6]["rollout/replica_restarts"] == 1
    assert metrics[6]["rollout/requests_rerouted"] >= 0  # 0 if no request was in flight on it
    assert metrics[6]["rollout/replicas_serving"] == 2  # the new one serves
    assert all(metrics[step]["fully_async/staleness/max"] <= 1 for step in metrics)
    trained = Counter(row[0] for step in metrics for row in _rollouts(tmp_path, "elastic", step))
    assert sum(trained.values()) == 6 * 4 * 2  # steps x groups per step x rollout.n
    assert set(trained.values()) == {2}, trained  # each prompt's two samples, once
