"""Helpers for the fault tests: ``main_ppo`` runs as a real subprocess (its own Ray, two worker processes)
on the suite's tiny model and arithmetic data, and the tests signal, kill and starve it for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.utils.process_reaper import descendants
from tests.tiny_run import tiny_run_values

# Limits on how long a run may take stretch with the pytest processes sharing the two cores (make test
# runs two): they bound a hang, they are not what the tests measure.
TIME_SCALE = float(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))

PROJECT, EXPERIMENT = "hybridflow", "reliability"


class Run:
    """One ``python -m hybridflow.trainer.main_ppo`` (or ``module``) process in ``workdir`` (its own
    session)."""

    def __init__(self, workdir: Path, overrides: dict, module: str = "hybridflow.trainer.main_ppo") -> None:
        self.workdir = workdir
        self.log = workdir / "main_ppo.log"
        args = [f"{k}={v}" for k, v in overrides.items()]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the test can clean up everything it started
            )
        self.seen: dict[int, int] = {}  # every descendant observed: {pid: start time}

    @property
    def metrics_path(self) -> Path:
        return self.workdir / "outputs" / PROJECT / EXPERIMENT / "metrics.jsonl"

    def steps_logged(self) -> list[int]:
        if not self.metrics_path.exists():
            return []
        steps = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except ValueError:
                pass  # a line being written
        return steps

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def record_descendants(self) -> dict[int, int]:
        self.seen.update(descendants(self.proc.pid))
        return self.seen

    def wait_until(self, predicate, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
        """Poll ``predicate()`` (recording descendants) until true; fail if the run ends first."""
        timeout_s *= TIME_SCALE
        deadline, recorded_at = time.monotonic() + timeout_s, 0.0
        while not predicate():
            if time.monotonic() - recorded_at > 0.25:  # a /proc scan: not at every fast poll
                self.record_descendants()
                recorded_at = time.monotonic()
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"main_ppo exited ({self.proc.returncode}) before {what}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s}s:\n{self.tail()}")
            time.sleep(poll_s)

    def wait(self, timeout_s: float) -> int:
        timeout_s *= TIME_SCALE
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"main_ppo still running after {timeout_s}s:\n{self.tail()}") from None

    def tail(self, chars: int = 4000) -> str:
        return self.output()[-chars:]

    def survivors(self) -> list[str]:
        """Recorded descendants still alive (pid and command line)."""
        alive = []
        for pid, start in self.seen.items():
            try:
                stat = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
            except OSError:
                continue
            if int(stat[19]) == start and stat[0] != b"Z":
                alive.append(f"{pid} {cmdline}")
        return alive

    def assert_no_survivors(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while self.survivors() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not self.survivors(), f"processes outlived main_ppo by {within_s}s: {self.survivors()}"

    def kill_everything(self) -> None:
        for pid in [self.proc.pid, *self.seen]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def main_ppo(tiny_model_dir, arithmetic_data, tmp_path):
    """``start(**overrides) -> Run``: a small GRPO run (4 prompts x 2 responses, jsonl log) saving under
    ``tmp_path/ckpt`` unless overridden. One worker process unless a test asks for more
    (``trainer__n_gpus_per_node=2``): signals, saves and scorers behave alike at any world size, and
    each extra worker costs a run ~9 CPU-seconds of start-up on the suite's two shared cores.
    Everything it started is killed at teardown."""
    runs: list[Run] = []

    def start(**overrides) -> Run:
        values = tiny_run_values(
            tiny_model_dir,
            arithmetic_data,
            tmp_path / "ckpt",
            **{"trainer.experiment_name": EXPERIMENT, "ray_init.num_cpus": 4, "trainer.n_gpus_per_node": 1},
        )
        values.update({key.replace("__", "."): value for key, value in overrides.items()})
        run = Run(tmp_path, values)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill_everything()


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size, read_only=False) -> Path``: a tiny tmpfs of its own (needs root, as in CI)."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True
        )
        if result.returncode != 0:
            pytest.skip(
                f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {result.stderr.decode().strip()}"
            )
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
