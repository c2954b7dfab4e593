"""verl's own CPU tests pass, unchanged, with the ``verl`` alias turned on by ``install()`` alone (issue 38).

``verl_tests/`` holds verl's eight CPU test files (verl b178a3c, Apache-2.0; its README says where
from). A run copies test files into a fresh temporary folder whose only other file is a ``conftest.py``
calling ``hybridflow.verl_compat.install()``, and runs pytest there in a subprocess whose environment
has no ``HYBRIDFLOW_VERL_ALIAS``: the gloo ranks that the distributed tests start with
``torch.multiprocessing.spawn`` get the alias from what ``install()`` does (the variable it sets, read
by the start hook of hybridflow_verl_alias.pth), and ``test_algo_config_on_cpu.py`` composes
``ppo_trainer`` from ``verl/trainer/config`` relative to the folder, which does not exist there.

All eight files run, verl's 128 tests. Their cost is the 16 processes that the five spawning tests
start (in test_torch_functional.py and test_seqlen_balancing.py), each importing torch: measured under
load on two shared cores, 83 CPU-seconds for all 128 tests against 76 for those two files and the
Hydra one alone, so nothing is left out to save time.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow import verl_compat

HERE = Path(__file__).resolve().parent
VERL_TESTS = HERE / "verl_tests"
REPO = HERE.parents[1]
ALL_FILES = {  # file -> verl's git blob id at b178a3c (verl_tests/README.md)
    "test_protocol_on_cpu.py": "800d428639239a1b2fc4de3125371d657213ce8b",
    "test_core_algos_on_cpu.py": "288f28e63989df8a05e53f43d75aad43b86662bd",
    "test_seqlen_balancing.py": "2628c8de98492690a42d25c2e3ac2e9fbd9e4738",
    "test_torch_functional.py": "50bbe065f243c6c23d6bf0c59245345eda7a4f99",
    "test_metric_utils_on_cpu.py": "3922cf9a48ff55003a2d02f7c4bcd881e3c5df4d",
    "test_algo_config_on_cpu.py": "d08c949ee48a3b6fc045f43b0fc455a4f4ac4708",
    "test_registry_on_cpu.py": "9932ae8917805e3c92bbc0e11abd398463e8e87a",
    "test_flops_counter.py": "e1b59333d001d539e39364775040f7977a767cc0",
}
EXPECTED_PASSED = 128
CONFTEST = "import hybridflow.verl_compat\n\nhybridflow.verl_compat.install()\n"
# verl's test_seqlen_balancing_distributed_params reuses one rendezvous file for two process groups in a
# row, and now and then the second group fails while it forms with gloo's "Connection closed by peer"
# (about 1 run in 10 when these tests were first run here; on 2026-11-26 it failed once in 13 runs,
# under heavy load). That one test is run again, once, on that error only (docs/coming_from_verl.md).
GLOO_RENDEZVOUS_FLAKE = re.compile(r"Connection closed by peer|Connection reset by peer")
FLAKY_TEST = "test_seqlen_balancing.py::test_seqlen_balancing_distributed_params"


def _git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _pytest(folder: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != verl_compat.ENV_SWITCH}
    # this checkout, whatever the venv holds; one thread per rank on two shared cores
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull]
    return subprocess.run(
        [*command, "--rootdir", str(folder), *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _counts(output: str) -> dict[str, int]:
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", summary)}


def test_vendored_files_are_verls_unchanged():
    for name, blob_id in ALL_FILES.items():
        assert _git_blob_id(VERL_TESTS / name) == blob_id, f"{name} differs from verl b178a3c"
    assert "Apache License" in (VERL_TESTS / "LICENSE").read_text()


def test_the_start_hook_is_in_this_interpreter():
    assert verl_compat.hook_is_current(), (
        f"the verl alias start hook is missing or stale at {verl_compat.hook_path()}: run `make install` "
        "(or `python -m hybridflow.verl_compat --install-hook`); the spawned processes below need it"
    )


@pytest.mark.slow  # make test-slow: verl's whole CPU suite (128 tests, 16 spawned processes)
def test_verl_tests_pass_through_install_alone(tmp_path):
    files = tuple(ALL_FILES)
    if not verl_compat.hook_is_current():
        pytest.fail("the verl alias start hook is not installed here (see the test above)")
    for name in files:
        shutil.copy(VERL_TESTS / name, tmp_path / name)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*files, "conftest.py"])

    # The folder, collected in pytest's (alphabetical) order, as a user's run would: verl's
    # test_core_algos_on_cpu.py leaves core_algos.ADV_ESTIMATOR_REGISTRY empty (its setUp rebinds it,
    # its tearDown clears it), so test_algo_config_on_cpu.py, which needs "gae" there, must run first:
    # in verl's tree it does too (tests/trainer/config/ before tests/trainer/ppo/).
    run = _pytest(tmp_path, [])
    counts = _counts(run.stdout)
    if counts.get("failed") == 1 and f"FAILED {FLAKY_TEST}" in run.stdout:
        if GLOO_RENDEZVOUS_FLAKE.search(run.stdout + run.stderr):
            again = _pytest(tmp_path, [FLAKY_TEST])
            assert again.returncode == 0, again.stdout[-6000:] + again.stderr[-3000:]
            counts = {**counts, "failed": 0, "passed": counts.get("passed", 0) + 1}
    assert counts.get("passed") == EXPECTED_PASSED and not counts.get("failed"), (
        f"{counts}\n{run.stdout[-8000:]}\n{run.stderr[-3000:]}"
    )
