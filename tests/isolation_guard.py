"""The test-file isolation guard (issue 43): after the last test of each test file, nothing that lives for
the whole process may be left behind for the next file run in the same pytest worker.

What it checks, once the file's own fixtures are torn down:

- torch.distributed's default process group (``init_process_group`` without ``destroy_process_group``);
  a later file that starts its own then fails with "trying to initialize the default process group twice";
- vLLM's parallel state (``vllm.distributed.parallel_state``'s world and model-parallel groups), which an
  in-process vLLM engine sets up and only its shutdown removes.

A leak is reported as an error at teardown of that file's last test, naming the file and what it left, and
then cleaned up, so the files after it run as if it had not leaked. ``tests/conftest.py`` installs the hook
for the whole suite; a pytest run can also load it alone with ``-p tests.isolation_guard``
(``tests/utils/test_isolation_guard.py`` does, in a subprocess).
"""

from __future__ import annotations

import sys

import pytest


def vllm_groups_left() -> list[str]:
    """The names of vLLM's parallel groups still set in this process (empty when vLLM was never
    imported here: the check imports nothing)."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None:
        return []
    coordinator = getattr(state, "GroupCoordinator", None)
    if coordinator is None:
        return []
    return sorted(name for name, value in vars(state).items() if isinstance(value, coordinator))


def leaked_state() -> list[str]:
    """What this process holds that a test file must not leave behind, one description each."""
    leaks = []
    groups = vllm_groups_left()
    if groups:
        leaks.append(f"vLLM's parallel state ({', '.join(groups)}): an in-process vLLM engine not shut down")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        leaks.append(
            f"torch.distributed's default process group (backend {dist.get_backend()}, "
            f"world size {dist.get_world_size()})"
        )
    return leaks


def clean_up() -> list[str]:
    """Tear down what :func:`leaked_state` found; returns what could not be torn down."""
    problems = []
    if vllm_groups_left():
        try:
            sys.modules["vllm.distributed.parallel_state"].cleanup_dist_env_and_memory()
        except Exception as error:  # noqa: BLE001 - reported, then the plain torch teardown below
            problems.append(f"vLLM's cleanup_dist_env_and_memory raised {error!r}")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001
            problems.append(f"destroy_process_group raised {error!r}")
    return problems


def last_of_its_file(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    return nextitem is None or nextitem.path != item.path


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After pytest's own teardown of ``item`` (module fixtures included when it is the file's last test):
    fail that teardown if the file leaked process-global state, after cleaning it up."""
    result = yield
    if not last_of_its_file(item, nextitem):
        return result
    leaks = leaked_state()
    if not leaks:
        return result
    problems = clean_up()
    after = "cleaned up so later files run" if not problems else "cleanup failed: " + "; ".join(problems)
    pytest.fail(
        f"test isolation: {item.nodeid.split('::')[0]} left "
        f"{' and '.join(leaks)} initialized after its last test; {after}. Tear it down in the fixture "
        "or test that started it (vLLM: VLLMEngine.shutdown(); torch: dist.destroy_process_group()).",
        pytrace=False,
    )
