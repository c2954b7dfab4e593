"""The test-file isolation guard (``tests/isolation_guard.py``, issue 43), proven without vLLM: a file that
leaks a gloo default process group on purpose, run in a pytest of its own, is named by the guard, and the
file after it in the same process still starts its own group. Without the guard the same files reproduce
the failure vLLM's in-process engine caused ("trying to initialize the default process group twice")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import isolation_guard

REPO = Path(__file__).resolve().parents[2]

LEAKS = """
import torch.distributed as dist

def test_leaks_a_gloo_default_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    assert dist.is_initialized()

def test_the_same_file_still_has_it():
    assert dist.is_initialized()  # the guard looks only after a file's last test
"""

STARTS_ITS_OWN = """
import torch.distributed as dist

def test_starts_its_own_default_group(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    dist.destroy_process_group()
"""

TEARS_DOWN = """
import pytest
import torch.distributed as dist

@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

def test_uses_a_module_group(group):
    assert dist.get_world_size() == 1

def test_and_again(group):
    assert dist.is_initialized()
"""


def _run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            *args,
            str(folder),
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def leaky_suite(tmp_path_factory) -> Path:
    """Three files run in this order in one process: a leak, a file that needs a clean process, and a
    file that starts and tears down its own group in a module fixture (the guard must stay quiet there)."""
    folder = tmp_path_factory.mktemp("leaky_suite")
    (folder / "pytest.ini").write_text("[pytest]\n")  # its own rootdir: the repository's conftest stays out
    (folder / "test_a_leaks.py").write_text(LEAKS)
    (folder / "test_b_starts_its_own.py").write_text(STARTS_ITS_OWN)
    (folder / "test_c_tears_down.py").write_text(TEARS_DOWN)
    return folder


def test_the_guard_names_the_leaking_file_and_the_next_file_runs(leaky_suite):
    run = _run_pytest(leaky_suite, "-p", "tests.isolation_guard")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "5 passed, 1 error" in out, out
    assert "ERROR at teardown of test_the_same_file_still_has_it" in out, out
    assert "ERROR test_a_leaks.py::test_the_same_file_still_has_it" in out, out
    assert (
        "test isolation: test_a_leaks.py left torch.distributed's default process group "
        "(backend gloo, world size 1) initialized after its last test; cleaned up so later files run" in out
    ), out
    assert "test_b_starts_its_own" not in out.split("short test summary")[-1], out  # b passed
    assert "test_c_tears_down" not in out.split("short test summary")[-1], out  # the quiet case


def test_without_the_guard_the_leak_fails_the_next_file(leaky_suite):
    """The control: the same files without the guard fail as `make test` did on an AVX-512 machine."""
    run = _run_pytest(leaky_suite)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "trying to initialize the default process group twice" in out or "assert not True" in out, out
    assert "FAILED test_b_starts_its_own.py::test_starts_its_own_default_group" in out, out


def test_the_suite_runs_with_the_guard(request):
    """``tests/conftest.py`` installs the guard's hook for every `make test` and `make test-slow` run."""
    hooks = [
        getattr(plugin, "pytest_runtest_teardown", None)
        for plugin in request.config.pluginmanager.get_plugins()
    ]
    assert isolation_guard.pytest_runtest_teardown in hooks


def test_nothing_is_left_in_this_process():
    assert isolation_guard.leaked_state() == []
