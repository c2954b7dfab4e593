"""Two Ray nodes on one machine (``python -m hybridflow.placement.local_cluster``, in a process of its
own: the suite's shared Ray is never touched). ``main_ppo`` runs against it as a real subprocess:

- with ``trainer.nnodes=2`` the two worker ranks land on different nodes (gloo across them, the
  rendezvous on rank 0's node) and the GRPO run logs the same numbers per step as the one-node run;
- a GPU pool on a cluster whose head node has no GPU starts, on the node that has one (the second
  node declares one logical GPU: placement only, nothing runs on a GPU);
- killing a node mid-run ends the run with one line naming the node and the roles it held, and the
  last checkpoint stays whole.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.utils.checkpoint.tracker import read_latest_checkpointed_iteration
from hybridflow.utils.process_reaper import descendants
from tests.tiny_run import as_overrides, tiny_run_values

pytestmark = pytest.mark.slow  # make test-slow: a two-node Ray cluster, three main_ppo processes on it

ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
COMPARED = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm"]


class LocalCluster:
    """The two-node cluster process; everything it started is killed at :meth:`stop`."""

    def __init__(self, workdir: Path) -> None:
        address_file = workdir / "address"
        self.log = (workdir / "cluster.log").open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hybridflow.placement.local_cluster",
                "--nodes",
                "2",
                "--cpus-per-node",
                "2",
            ]
            + ["--gpus-per-node", "1", "--fast-failure-detection", "--address-file", str(address_file)],
            env=ENV,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 90
        while not address_file.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, (
                workdir / "cluster.log"
            ).read_text()
            time.sleep(0.2)
        self.address = address_file.read_text().strip()
        self.seen = descendants(self.proc.pid)

    def lose_a_node(self) -> None:
        os.kill(self.proc.pid, signal.SIGUSR1)

    def stop(self) -> None:
        self.seen.update(descendants(self.proc.pid))
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for pid in [self.proc.pid, *self.seen]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(tmp_path_factory.mktemp("cluster"))
    yield local
    local.stop()


def _main_ppo(cluster, tiny_model_dir, arithmetic_data, workdir: Path, **overrides) -> subprocess.Popen:
    values = tiny_run_values(
        tiny_model_dir,
        arithmetic_data,
        workdir / "ckpt",
        **{
            "actor_rollout_ref.actor.optim.lr": 1e-3,
            "trainer.resume_mode": "disable",
            "trainer.experiment_name": "run",
            "ray_init.address": cluster.address,
            **overrides,
        },
    )
    workdir.mkdir(parents=True, exist_ok=True)
    with (workdir / "main_ppo.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "hybridflow.trainer.main_ppo", *as_overrides(values)],
            cwd=workdir,
            env=ENV,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(proc: subprocess.Popen, workdir: Path, timeout_s: float = 180) -> tuple[int, str]:
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    return code, (workdir / "main_ppo.log").read_text(errors="replace")


def _steps(workdir: Path) -> dict[int, dict]:
    path = workdir / "outputs" / "hybridflow" / "run" / "metrics.jsonl"
    if not path.exists():
        return {}
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return {r["step"]: r for r in records}


def test_grpo_on_two_nodes_matches_the_one_node_run(cluster, tiny_model_dir, arithmetic_data, tmp_path):
    runs = {}
    for nodes in (2, 1):
        workdir = tmp_path / f"nodes{nodes}"
        proc = _main_ppo(
            cluster,
            tiny_model_dir,
            arithmetic_data,
            workdir,
            **{
                "trainer.nnodes": nodes,
                "trainer.n_gpus_per_node": 2 // nodes,
                "trainer.total_training_steps": 3,
            },
        )
        code, output = _finish(proc, workdir)
        assert code == 0, output[-4000:]
        runs[nodes] = (_steps(workdir), output)
    # two nodes: one rank on each (the driver prints each rank's node at start-up)
    pool_line = next(
        line for line in runs[2][1].splitlines() if line.startswith("hybridflow: pool global_pool")
    )
    assert len(set(re.findall(r"node id (\w+)", pool_line))) == 2, pool_line
    one_node = next(
        line for line in runs[1][1].splitlines() if line.startswith("hybridflow: pool global_pool")
    )
    assert len(set(re.findall(r"node id (\w+)", one_node))) == 1, one_node
    assert sorted(runs[2][0]) == sorted(runs[1][0]) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in COMPARED:
            assert runs[2][0][step][key] == pytest.approx(runs[1][0][step][key], rel=1e-5, abs=1e-6), (
                step,
                key,
            )


GPU_POOL_SCRIPT = """
import json, sys
import ray
from hybridflow.single_controller import Worker
from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

ray.init(address=sys.argv[1])
head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
pool = RayResourcePool([1], use_gpu=True, ready_timeout_s=30)
group = RayWorkerGroup(pool, RayClassWithInitArgs(Worker), name_prefix="gpu_pool")
ran_on = group.execute_all("execute_fn", lambda worker: ray.get_runtime_context().get_node_id())
print(json.dumps({"ran_on": ran_on, "placed_on": pool.rank_node_ids, "head": head}))
group.shutdown()
"""


def test_a_head_node_without_gpus_hosts_no_gpu_worker(cluster):
    # the second node has one (logical) GPU, the head none: a GPU pool starts, on the second node
    out = subprocess.run(
        [sys.executable, "-c", GPU_POOL_SCRIPT, cluster.address],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ran_on"] == result["placed_on"] and result["head"] not in result["ran_on"]


def test_losing_a_node_mid_run_names_it_and_keeps_the_last_checkpoint(
    cluster, tiny_model_dir, arithmetic_data, tmp_path
):
    root = tmp_path / "ckpt"
    proc = _main_ppo(
        cluster,
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "trainer.nnodes": 2,
            "trainer.n_gpus_per_node": 1,
            "trainer.total_training_steps": 500,
            "trainer.save_freq": 2,
        },
    )
    deadline = time.monotonic() + 120
    while len(_steps(tmp_path)) < 3 or read_latest_checkpointed_iteration(str(root)) is None:
        assert proc.poll() is None and time.monotonic() < deadline, _finish(proc, tmp_path, 1)[1][-4000:]
        time.sleep(0.1)
    cluster.lose_a_node()
    lost_at = time.monotonic()
    code, output = _finish(proc, tmp_path, timeout_s=60)
    assert code == 1, output[-4000:]
    assert time.monotonic() - lost_at < 30  # Ray's health checks (fast here) + the driver's diagnosis
    errors = [line for line in output.splitlines() if line.startswith("hybridflow: error:")]
    assert len(errors) == 1, output[-4000:]
    assert re.search(r"node \S+ \(node id \w+\) left the Ray cluster mid-run", errors[0]), errors[0]
    assert "the roles on it: actor_rollout rank 1 (pool global_pool)" in errors[0]
    latest = read_latest_checkpointed_iteration(str(root))
    assert f"The checkpoint a resume finds is {root / f'global_step_{latest}'}" in errors[0]
    assert (root / f"global_step_{latest}" / "actor" / "checkpoint_meta.json").exists()
    assert not any(p.name.endswith((".tmp", ".old")) for p in root.rglob("*"))
