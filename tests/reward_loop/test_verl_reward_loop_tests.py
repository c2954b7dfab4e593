"""verl's own reward-loop CPU tests (verl_tests/, vendored unchanged) pass through the ``verl`` alias.

They run in a subprocess that calls ``hybridflow.verl_compat.install()`` and imports the two files;
each ``async def test_*`` runs under ``asyncio.run`` (they are written for pytest-asyncio, not a
dependency here) after what their autouse fixture does, with a tokenizer built offline in place of the
Qwen tokenizer their fixture reads from ``~/models``. Two tests that wait by design are left out to keep the
suite short: ``test_tpm_rate_limiting`` (20 s; its bucket is the RPM one's, run by
``test_rpm_rate_limiting``) and ``test_large_token_acquire`` (4 s; the same path as our
``test_reward_loop.py::test_large_requests_go_into_debt_and_wait_the_shortfall``).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FILES = {
    "test_async_token_bucket_on_cpu.py": "70906fb51bd3848aa9e925261f2f5c4f71718e17",
    "test_rate_limited_reward_manager_on_cpu.py": "dfeca215327c8dd4aadab4ee2b4f10a7ce6e5f53",
}
LEFT_OUT = {"test_tpm_rate_limiting", "test_large_token_acquire"}  # 20 s and 4 s of waiting by design

RUNNER = """
import asyncio, importlib.util, inspect, json, logging, sys, time
import hybridflow.verl_compat
hybridflow.verl_compat.install()
from hybridflow.models.tiny import build_tokenizer
from hybridflow.tasks.arithmetic import task_texts
folder, left_out = sys.argv[1], set(sys.argv[2].split(","))
tokenizer = build_tokenizer(task_texts(n=300))


class Caplog(logging.Handler):  # pytest's caplog, as much of it as the test reads
    def __init__(self):
        super().__init__()
        self.records = []
        logging.getLogger().addHandler(self)

    def emit(self, record):
        self.records.append(record)

    def set_level(self, level):
        logging.getLogger().setLevel(level)


results = {}
for name in ("test_async_token_bucket_on_cpu", "test_rate_limited_reward_manager_on_cpu"):
    spec = importlib.util.spec_from_file_location(name, f"{folder}/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for cls in [c for c in vars(module).values() if inspect.isclass(c) and c.__name__.startswith("Test")]:
        for method in [m for m in dir(cls) if m.startswith("test_") and m not in left_out]:
            test = cls()
            if hasattr(module, "api_counter"):  # the autouse fixture's reset
                module.api_counter.reset()
                manager = module.RateLimitedRewardManager
                manager._class_initialized, manager._semaphore = False, None
                manager._rpm_limiter = manager._tpm_limiter = None
            fn = getattr(test, method)
            wanted = inspect.signature(fn).parameters
            kwargs = {"tokenizer": tokenizer} if "tokenizer" in wanted else {}
            if "caplog" in wanted:
                kwargs["caplog"] = Caplog()
            start = time.monotonic()
            try:
                out = fn(**kwargs)
                if inspect.iscoroutine(out):
                    asyncio.run(out)
                results[f"{name}::{method}"] = "passed"
                print(f"{name}::{method} {time.monotonic() - start:.2f} s", file=sys.stderr)
            except BaseException as error:
                results[f"{name}::{method}"] = f"failed: {type(error).__name__}: {error}"
print(json.dumps(results))
"""


def _blob(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_files_are_verls_unchanged():
    for name, blob in FILES.items():
        assert _blob(HERE / "verl_tests" / name) == blob, name


def test_verls_reward_loop_tests_pass_through_the_alias():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("HYBRIDFLOW_VERL_ALIAS", None)
    args = [sys.executable, "-c", RUNNER, str(HERE / "verl_tests"), ",".join(LEFT_OUT)]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {k: v for k, v in results.items() if v != "passed"}
    assert not failed, failed
    assert len(results) == 28, sorted(results)  # 14 of the token bucket's 15 tests, 14 of the manager's 15
