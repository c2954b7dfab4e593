"""``scripts/gpu_check.sh``, the one command for a GPU host (issues 26, 33), kept runnable where there is
none: it lists every check in priority order, ``all --with-trl`` fits one call of the lent host (8 min
with the install), each phase runs under its own time limit, each option it passes exists in the script
it calls, and without a GPU it stops at once saying so (the GPU machines are lent only now and then; a
command that rotted meanwhile would waste one)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
CHECKS = [  # the one-call plan of `all --with-trl`, most important first
    "engine_vs_hf",
    "assets",
    "grpo_step",
    "trl_data",
    "trl_grpo_step",
    "tests_cuda_graphs",
    "resume_check",
]


def _dry_run_text(*args: str, peers: Path | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable}
    if peers is not None:
        env["PEERS"] = str(peers)
    return subprocess.run(
        ["bash", str(SCRIPT), *args, "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _dry_run(*args: str, peers: Path | None = None) -> dict[str, str]:
    """check name -> its command (after ``timeout N``)."""
    out = _dry_run_text(*args, peers=peers)
    return dict(re.findall(r"^\[(\w+)\] timeout \d+ (.*)$", out, flags=re.M))


def test_the_dry_run_lists_every_check_in_order():
    assert list(_dry_run("all", "--with-trl")) == CHECKS
    assert list(_dry_run("all")) == [c for c in CHECKS if not c.startswith("trl")]
    assert list(_dry_run("bench")) == ["engine_vs_hf", "assets", "grpo_step"]  # TRL only with --with-trl
    assert list(_dry_run("tests")) == ["tests_cuda_graphs", "tests_cuda"]
    assert list(_dry_run("suite")) == ["tests_suite"]


def test_the_one_call_plan_fits_eight_minutes_with_the_install():
    """Every phase has a time limit; their sum and the install stay within one call's 8 minutes."""
    text = _dry_run_text("all", "--with-trl")
    limits = [int(n) for n in re.findall(r"^\[\w+\] timeout (\d+) ", text, flags=re.M)]
    assert len(limits) == len(CHECKS)
    plan = re.search(r"^plan: (\d+)s of phase limits \+ (\d+)s install = (\d+)s .*: yes\)$", text, flags=re.M)
    assert plan, text
    assert int(plan[1]) == sum(limits) and int(plan[3]) == sum(limits) + int(plan[2]) <= 480


@pytest.mark.parametrize("check", ["resume_check", "engine_vs_hf", "grpo_step"])
def test_each_option_passed_exists_in_the_benchmark(check):
    command = _dry_run("all")[check].split()
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
    usage = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True).stderr
    assert "one call" in usage
