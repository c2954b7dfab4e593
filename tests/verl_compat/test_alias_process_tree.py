"""The verl alias follows the process tree (issue 38): after ``install()`` every Python process started
from that process resolves ``import verl`` to hybridflow (spawn, forkserver, fork, ``subprocess``, Ray
workers); the start hook never shadows a real verl; verl's config folder is ours to Hydra."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow import verl_compat

REPO = Path(__file__).resolve().parents[2]
ALIAS = "<verl alias 'verl' -> 'hybridflow'>"

CHILD = """import verl  # at the top, as verl's tests do: a spawned process imports this before all else


def alias(_=None):
    return repr(verl)
"""

MAIN = """import multiprocessing
import subprocess
import sys

if __name__ == "__main__":  # a spawned process runs this file too (as __mp_main__): no install() there
    import hybridflow.verl_compat

    assert hybridflow.verl_compat.install()
    import child

    for method in ("spawn", "forkserver", "fork"):
        with multiprocessing.get_context(method).Pool(1) as pool:
            print(method, pool.apply(child.alias))
    code = "import child; print(child.alias())"
    print("subprocess", subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
"""


def _python(args, cwd, **env_extra):
    """This checkout's python with no alias switch in the environment, unless given."""
    env = {k: v for k, v in os.environ.items() if k != verl_compat.ENV_SWITCH}
    env.update(PYTHONPATH=str(REPO), OMP_WAIT_POLICY="PASSIVE", **env_extra)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=180
    )


@pytest.fixture
def hook_here():
    if not verl_compat.hook_is_current():
        pytest.fail(
            f"the verl alias start hook is missing or stale at {verl_compat.hook_path()}: run `make install` "
            "or `python -m hybridflow.verl_compat --install-hook`"
        )


def test_spawn_forkserver_fork_and_subprocess_children_get_the_alias(tmp_path, hook_here):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "main.py").write_text(MAIN)
    run = _python(["main.py"], tmp_path)
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.strip().splitlines())
    assert lines == {m: ALIAS for m in ("spawn", "forkserver", "fork", "subprocess")}, run.stdout


def test_the_start_hook_imports_nothing_until_verl_and_never_shadows_a_real_verl(tmp_path, hook_here):
    probe = "import sys; print('hybridflow' in sys.modules); import verl; print(verl.__file__)"
    armed = _python(["-c", probe], tmp_path, HYBRIDFLOW_VERL_ALIAS="1")
    assert armed.stdout.split() == ["False", str(REPO / "hybridflow" / "__init__.py")], armed.stderr
    # a verl in the script's folder: sys.path has it only after the hook ran, and it wins
    (tmp_path / "verl").mkdir()
    (tmp_path / "verl" / "__init__.py").write_text("")
    (tmp_path / "script.py").write_text("import verl\nprint(verl.__file__)\n")
    for first in ("", "import hybridflow\n"):  # via the hook, or via hybridflow's own switch
        (tmp_path / "script.py").write_text(f"{first}import verl\nprint(verl.__file__)\n")
        real = _python(["script.py"], tmp_path, HYBRIDFLOW_VERL_ALIAS="1")
        assert real.stdout.strip() == str(tmp_path / "verl" / "__init__.py"), real.stderr
        assert real.stderr.count("a real verl is installed") == 1, real.stderr
    off = _python(["-c", "import verl"], tmp_path / "verl", HYBRIDFLOW_VERL_ALIAS="0")
    assert "No module named 'verl'" in off.stderr


def test_ray_workers_of_a_running_cluster_get_the_alias(ray_session):
    """The cluster started before install() (the session's): a worker group's processes get the switch."""
    from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.single_controller.workers import DPWorker

    assert verl_compat.install()
    try:
        group = RayWorkerGroup(
            RayResourcePool([1], use_gpu=False, cpus_per_process=1),
            RayClassWithInitArgs(DPWorker),
            name_prefix="verl_alias",
        )
        try:
            seen = group.execute_all("execute_fn", lambda worker: repr(__import__("verl")))
        finally:
            group.shutdown()
    finally:
        verl_compat.uninstall()
    assert seen == [ALIAS]


def test_hook_file_is_one_import_line_written_once_and_removed(tmp_path):
    text = verl_compat.pth_text()
    assert text.startswith("import ") and text.count("\n") == 1
    assert not verl_compat.hook_is_current(str(tmp_path))
    path = verl_compat.write_hook(str(tmp_path))
    assert Path(path).read_text() == text and verl_compat.hook_is_current(str(tmp_path))
    assert verl_compat.remove_hook(str(tmp_path)) and not verl_compat.remove_hook(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no site-packages folder"):
        verl_compat.write_hook(str(tmp_path / "missing"))


def test_install_sets_the_switch_for_children_and_uninstall_clears_it(monkeypatch):
    monkeypatch.delenv(verl_compat.ENV_SWITCH, raising=False)
    assert verl_compat.install() and os.environ[verl_compat.ENV_SWITCH] == "1"
    verl_compat.uninstall()
    assert verl_compat.ENV_SWITCH not in os.environ


def test_verls_config_folder_is_ours_to_hydra(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    missing = str(tmp_path / "verl" / "trainer" / "config")
    assert verl_compat.hydra_config_source(missing) is None  # alias off: Hydra's own error
    monkeypatch.chdir(tmp_path)
    assert verl_compat.install()
    try:
        assert verl_compat.hydra_config_source(f"file://{missing}") == verl_compat.OUR_CONFIG_SOURCE
        assert verl_compat.hydra_config_source("pkg://verl.trainer.config") == verl_compat.OUR_CONFIG_SOURCE
        assert verl_compat.hydra_config_source(str(tmp_path / "conf")) is None
        ours = OmegaConf.load(REPO / "hybridflow" / "trainer" / "config" / "ppo_trainer.yaml")
        with initialize_config_dir(config_dir=os.path.abspath("verl/trainer/config"), version_base=None):
            assert compose(config_name="ppo_trainer").algorithm.adv_estimator == ours.algorithm.adv_estimator
        Path(missing).mkdir(parents=True)  # a verl checkout's folder is its own
        assert verl_compat.hydra_config_source(missing) is None
    finally:
        verl_compat.uninstall()
