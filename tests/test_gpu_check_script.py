"""``scripts/gpu_check.sh``, issue 26's one command for a GPU host, kept runnable where there is none:
it lists every check, each option it passes exists in the script it calls, and without a GPU it stops
at once saying so (the GPU machines are lent only now and then; a command that rotted meanwhile would
waste one)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
CHECKS = [
    "tests_cuda",
    "tests_suite",
    "resume_check",
    "rollout_engine_vs_hf",
    "assets",
    "grpo_step",
    "trl_data",
    "trl_grpo_step",
]


def _dry_run(*args: str, peers: Path | None = None) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable}
    if peers is not None:
        env["PEERS"] = str(peers)
    out = subprocess.run(
        ["bash", str(SCRIPT), *args, "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(re.findall(r"^\[(\w+)\] (.*)$", out, flags=re.M))


def test_the_dry_run_lists_every_check_in_order():
    assert list(_dry_run("all", "--with-trl")) == CHECKS
    assert list(_dry_run("tests")) == CHECKS[:2]
    assert list(_dry_run("bench")) == CHECKS[2:6]  # TRL only with --with-trl


@pytest.mark.parametrize("check", ["resume_check", "rollout_engine_vs_hf", "grpo_step"])
def test_each_option_passed_exists_in_the_benchmark(check):
    command = _dry_run("bench")[check].split()
    script = next(part for part in command if part.endswith(".py"))
    usage = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for option in (part for part in command if part.startswith("--")):
        assert option in usage, f"{script} has no {option}"


def test_trl_options_exist_in_the_peer_benchmark():
    peers = ROOT.parent / "shared" / "peers"
    bench = peers / "trl" / "trl_grpo_bench.py"
    if not bench.exists():
        pytest.skip(f"no TRL peer benchmark at {bench}")
    command = _dry_run("bench", "--with-trl", peers=peers)["trl_grpo_step"].split()
    source = bench.read_text()
    for option in (part for part in command if part.startswith("--")):
        assert f'"{option}"' in source, f"trl_grpo_bench.py has no {option}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the script would run")
def test_without_a_gpu_it_stops_at_once_saying_so(tmp_path):
    done = subprocess.run(
        ["bash", str(SCRIPT), "bench"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "no CUDA GPU is visible" in done.stderr
    assert not (tmp_path / "gpu_check.jsonl").exists()


def test_an_unknown_phase_or_option_is_refused_with_the_usage():
    for args in (["nope"], ["bench", "--fast"]):
        done = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 2, args
    assert "run 1" in subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True).stderr
