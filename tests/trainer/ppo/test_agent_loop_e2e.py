"""``rollout.mode=async`` end to end through ``run_ppo``: agent loops on one server replica per rank.

- the same seed gives the same samples as the synchronous rollout (each sample draws from its own
  stream, whichever rank or replica generates it), so the two modes train the same step;
- a loop written for verl (verl's imports, through the verl alias), registered from a YAML, trains;
  rewards are computed in the loop, ``agent_loop/*`` metrics are logged;
- a loop that raises, or a rank that dies mid-rollout, ends the run with an error naming it.
"""

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from hybridflow.trainer.ppo.workers_setup import build_worker_groups
from tests.tiny_run import as_overrides, tiny_run_values

LOOPS = "tests.workers.rollout.verl_style_agent_loops"


def _config(model_dir, data, tmp: Path, name: str, **extra):
    values = tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "trainer.experiment_name": name,
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 1,
            "trainer.rollout_data_dir": str(tmp / "rollouts" / name),
            "data.max_response_length": 8,
            **extra,
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    return config


def _run(config, tmp: Path, groups=None) -> dict[int, dict]:
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_ppo(config, worker_groups=groups)
    name = config.trainer.experiment_name
    lines = (tmp / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def _rollouts(tmp: Path, name: str) -> list[tuple]:
    lines = (tmp / "rollouts" / name / "1.jsonl").read_text().splitlines()
    return sorted((r["input"], r["output"], r["score"]) for r in map(json.loads, lines))


@pytest.fixture(scope="module")
def groups(ray_session, tiny_model_dir, arithmetic_data, tmp_path_factory):
    config = _config(tiny_model_dir, arithmetic_data, tmp_path_factory.mktemp("wg"), "wg")
    built = build_worker_groups(config, use_critic=False, use_reference=False)
    yield built
    built.shutdown()


# make test-slow: two whole runs compared; the async agent loops train in the fast tier's trace,
# verl-loop and reward-loop runs
@pytest.mark.slow
def test_async_samples_and_trains_like_sync(groups, tiny_model_dir, arithmetic_data, tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        config = _config(
            tiny_model_dir,
            arithmetic_data,
            tmp_path,
            mode,
            **{"actor_rollout_ref.rollout.mode": mode, "actor_rollout_ref.rollout.agent.num_workers": 2},
        )
        runs[mode] = _run(config, tmp_path, groups)[1]
    assert _rollouts(tmp_path, "async") == _rollouts(tmp_path, "sync")  # same prompts, tokens, scores
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "actor/entropy"):
        assert runs["async"][key] == pytest.approx(runs["sync"][key], rel=1e-5, abs=1e-7), key
    async_metrics = runs["async"]
    for key in (
        "agent_loop/generate_sequences/max",
        "agent_loop/slowest/response_length",
        "agent_loop/num_preempted/mean",
        "agent_loop/replica_requests/min",
        "agent_loop/tool_calls/mean",
    ):
        assert math.isfinite(async_metrics[key]), key
    assert async_metrics["agent_loop/replica_requests/min"] > 0  # both replicas served
    assert async_metrics["training/rollout_log_probs_diff_max"] <= 1e-5


def _with_agent_name(data, tmp: Path, name: str) -> tuple[str, str]:
    """The arithmetic files with an ``agent_name`` column naming ``name`` (verl's dataset field)."""
    paths = []
    for source in data:
        table = pq.read_table(source)
        table = table.append_column("agent_name", pa.array([name] * len(table)))
        path = tmp / Path(source).name
        pq.write_table(table, path)
        paths.append(str(path))
    return paths[0], paths[1]


@pytest.mark.slow  # a whole server-mode run (~57 s); the agent loops' own tests: tests/workers/rollout/
def test_a_loop_written_for_verl_runs_unchanged(groups, tiny_model_dir, arithmetic_data, tmp_path):
    """verl's imports resolve through the verl alias, in the driver and in the agent-loop workers."""
    from hybridflow import verl_compat

    verl_compat.install()
    try:
        _run_the_verl_loop(groups, tiny_model_dir, arithmetic_data, tmp_path)
    finally:
        verl_compat.uninstall()


def _run_the_verl_loop(groups, tiny_model_dir, arithmetic_data, tmp_path):
    target = "tests.workers.rollout.verl_written_agent_loop.TwoTurnAgentLoop"
    (tmp_path / "loops.yaml").write_text(f"- name: two_turn_agent\n  _target_: {target}\n")
    config = _config(
        tiny_model_dir,
        _with_agent_name(arithmetic_data, tmp_path, "two_turn_agent"),
        tmp_path,
        "two_turn",
        **{
            "actor_rollout_ref.rollout.mode": "async",
            "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(tmp_path / "loops.yaml"),
            "trainer.total_training_steps": 2,
            "data.max_response_length": 16,  # 3 tokens, "Check." (6), then the second answer
        },
    )
    metrics = _run(config, tmp_path, groups)
    assert metrics[2]["num_turns/mean"] == 4  # the loop's own turn count reached the batch
    assert math.isfinite(metrics[2]["actor/pg_loss"])
    assert metrics[2]["training/rollout_log_probs_diff_max"] <= 1e-5  # masks line up with the tokens
    rows = [
        json.loads(line) for line in (tmp_path / "rollouts" / "two_turn" / "1.jsonl").read_text().splitlines()
    ]
    assert all("Check." in row["output"] for row in rows)


def test_an_unknown_agent_name_is_refused_before_the_first_step(tiny_model_dir, arithmetic_data, tmp_path):
    from hybridflow.trainer.config import ConfigError, validate_config

    config = _config(
        tiny_model_dir,
        _with_agent_name(arithmetic_data, tmp_path, "nobody_registered_this"),
        tmp_path,
        "unknown",
        **{"actor_rollout_ref.rollout.mode": "async"},
    )
    with pytest.raises(ConfigError, match="agent loop 'nobody_registered_this'"):
        validate_config(config)


@pytest.mark.slow  # make test-slow: a loop that raises mid-rollout, then the same workers train
def test_a_loop_that_raises_names_itself_and_the_sample(groups, tiny_model_dir, arithmetic_data, tmp_path):
    (tmp_path / "loops.yaml").write_text(
        f"- name: failing\n  _target_: {LOOPS}.FailingAgentLoop\n  fail_index: 3\n"
    )
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "failing",
        **{
            "actor_rollout_ref.rollout.mode": "async",
            "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(tmp_path / "loops.yaml"),
            "actor_rollout_ref.rollout.agent.default_agent_loop": "failing",
            "data.shuffle": False,
        },
    )
    with pytest.raises(
        Exception,
        match=r"agent loop 'failing' failed on row \d+ \(dataset index 3.*the environment is unreachable",
    ):
        _run(config, tmp_path, groups)
    # the servers stopped and the ranks came back: the same workers still train
    config = _config(
        tiny_model_dir, arithmetic_data, tmp_path, "after", **{"actor_rollout_ref.rollout.mode": "async"}
    )
    assert math.isfinite(_run(config, tmp_path, groups)[1]["actor/pg_loss"])


@pytest.mark.slow  # make test-slow: a rank of a running run killed (its own worker processes)
def test_a_rank_dying_mid_rollout_is_an_error_naming_it(
    ray_session, tiny_model_dir, arithmetic_data, tmp_path
):
    groups = None
    (tmp_path / "loops.yaml").write_text(
        f"- name: killing\n  _target_: {LOOPS}.KillingAgentLoop\n  pid_file: {tmp_path / 'pid'}\n"
    )
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "killing",
        **{
            "actor_rollout_ref.rollout.mode": "async",
            "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(tmp_path / "loops.yaml"),
            "actor_rollout_ref.rollout.agent.default_agent_loop": "killing",
            "actor_rollout_ref.rollout.agent.generate_timeout_s": 60,
        },
    )
    groups = build_worker_groups(config, use_critic=False, use_reference=False)
    try:
        (tmp_path / "pid").write_text(str(groups.actor_rollout.worker_pids[1]))
        with pytest.raises(Exception, match=r"replica 1 \(rank 1\)|rank 1"):
            _run(config, tmp_path, groups)
    finally:
        groups.shutdown()


def test_a_log_prob_gap_beyond_the_limit_stops_the_run(groups, tiny_model_dir, arithmetic_data, tmp_path):
    """The wiring of rollout.log_prob_gap_limit: a limit below the engine's real (fp32) gap stops step 1
    with an error naming the step and the backend, before anything is saved."""
    from hybridflow.utils.rollout_parity import RolloutLogProbGapError

    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "gap",
        **{"actor_rollout_ref.rollout.log_prob_gap_limit": 1e-12, "trainer.save_freq": 1},
    )
    with pytest.raises(RolloutLogProbGapError, match=r"step 1: the engine rollout's log-probs differ"):
        _run(config, tmp_path, groups)
    assert not (tmp_path / "ckpt" / "global_step_1").exists()
