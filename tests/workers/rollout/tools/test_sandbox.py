"""The Python sandbox: every containment case is asserted on what actually happened outside the child."""

import asyncio
import os
import resource
import socket
import time

import pytest

from hybridflow.utils.sandbox import SandboxLimits, run_python
from hybridflow.workers.rollout.tools.python_tool import PYTHON_TOOL_SCHEMA, PythonTool

FAST = {"wall_timeout_s": 3.0, "cpu_time_s": 3}
pytestmark = pytest.mark.usefixtures("sandbox_available")


def run(code, work_root=None, **limits):
    return asyncio.run(run_python(code, SandboxLimits(**{**FAST, **limits}), work_root=work_root))


def processes_of_run(result):
    """Independent /proc scan: (pid, state) of every process in the run's group or with the run's uid."""
    pgid, uid = result.isolation["process_group"], result.isolation.get("uid")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat_file:
                fields = stat_file.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/status") as status_file:
                real_uid = int(next(line for line in status_file if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if int(fields[2]) == pgid or (uid not in (None, os.getuid()) and real_uid == uid):
            found.append((int(pid), fields[0]))
    return found


def assert_nothing_left(result):
    assert [p for p in processes_of_run(result) if p[1] not in "ZX"] == []
    deadline = time.monotonic() + 2.0  # dead members may still wait for init to reap them
    while time.monotonic() < deadline:
        try:
            os.killpg(result.isolation["process_group"], 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    assert all(state in "ZX" for _, state in processes_of_run(result))


def test_normal_code_runs_in_its_own_directory_and_leaves_nothing_behind(tmp_path):
    code = (
        "import os\nopen('notes.txt', 'w').write('kept')\n"
        "print(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'])\nprint(open('notes.txt').read())"
    )
    result = run(code, work_root=str(tmp_path))
    assert (result.exit_code, result.timed_out, result.killed_reason) == (0, False, None)
    assert result.stdout == "/sandbox /sandbox /tmp\nkept\n"  # writing in the working directory works
    assert list(tmp_path.iterdir()) == []  # the run's host directory (main.py, mount points) is removed
    assert result.stderr == "" and result.duration_s < 3
    assert run("import os\nprint(os.listdir())").stdout == "['main.py']\n"  # nothing carried over


def test_code_that_cannot_be_stored_is_a_sandbox_error():
    too_big = run("x = 1\n" * 200, max_file_bytes=1000)
    assert too_big.killed_reason == "sandbox error" and "1200 bytes" in too_big.stderr
    surrogate = run("print('\udc80')")  # e.g. from a JSON "\udc80" escape in a tool call
    assert surrogate.killed_reason == "sandbox error" and "UnicodeEncodeError" in surrogate.stderr
    assert too_big.exit_code is None and surrogate.exit_code is None  # nothing ran


def test_infinite_loop_is_stopped_by_the_wall_timeout():
    started = time.monotonic()
    result = run("while True: pass", wall_timeout_s=2.0, cpu_time_s=10)
    assert result.timed_out and result.killed_reason == "wall timeout" and result.exit_code == -9
    assert 1.9 < time.monotonic() - started < 4.5
    assert_nothing_left(result)


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run("while True: pass", wall_timeout_s=5.0, cpu_time_s=1)
    assert not result.timed_out and result.killed_reason == "cpu limit" and result.exit_code < 0
    assert result.duration_s < 4


def test_large_allocation_fails_inside_and_leaves_the_parent_alone():
    parent_limit = resource.getrlimit(resource.RLIMIT_AS)
    result = run("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert result.exit_code == 1 and result.killed_reason == "memory limit"
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert resource.getrlimit(resource.RLIMIT_AS) == parent_limit
    assert len(bytearray(300 * 1024**2)) == 300 * 1024**2  # the parent can still allocate
    assert run("print('still fine')").stdout == "still fine\n"


@pytest.mark.parametrize("drop_privileges", [True, False])  # as root, False leaves only the Python guard
def test_fork_bomb_is_contained_and_leaves_no_processes(drop_privileges):
    started = time.monotonic()
    code = "import os\nwhile True:\n    os.fork()"
    result = run(code, wall_timeout_s=3.0, max_processes=16, drop_privileges=drop_privileges)
    assert time.monotonic() - started < 6
    assert result.killed_reason in (None, "wall timeout")
    assert "BlockingIOError" in result.stderr or result.timed_out  # process creation was refused
    assert result.isolation["leftovers_killed"] is True
    assert_nothing_left(result)


def test_background_child_does_not_outlive_the_run():
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('parent done')"
    result = run(code, wall_timeout_s=3.0)
    assert result.stdout == "parent done\n" and not result.timed_out and result.duration_s < 2.5
    assert_nothing_left(result)


def test_child_escaping_the_process_group_is_still_killed():
    code = (
        "import ctypes, os, time\n"
        "if os.fork() == 0:\n"
        "    ctypes.CDLL(None).setsid()\n"  # out of the group the parent kills; the pid namespace ends it
        "    time.sleep(60)\n"
        "print(os.getuid())"
    )
    result = run(code)
    assert int(result.stdout) == result.isolation["uid"] != 0
    assert processes_of_run(result) == [] or all(state in "ZX" for _, state in processes_of_run(result))


def _listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    return server, server.getsockname()[1]


def _assert_never_connected(server):
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()


@pytest.mark.parametrize("use_namespace", [True, False])
def test_network_access_fails_and_reaches_nothing(use_namespace):
    server, port = _listener()
    code = (
        "import socket\n"
        "try:\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        f"    s.connect(('127.0.0.1', {port}))\n"
        "except OSError as error:\n"
        "    print('raw socket refused:', error)\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
    )
    result = run(code, use_network_namespace=use_namespace)
    assert result.exit_code == 1 and "raw socket refused" in result.stdout
    assert "Traceback" in result.stderr and "create_connection" in result.stderr
    _assert_never_connected(server)
    if use_namespace and result.isolation["network"] == "netns":
        assert "Network is unreachable" in result.stderr
    else:
        assert result.isolation["network"] == "python-guard"
        assert "network access is disabled in the sandbox" in result.stderr


def test_huge_output_is_truncated_with_a_marker():
    code = "import sys\nprint('x' * 100000)\nsys.stderr.write('e' * 5000)"
    result = run(code, max_output_bytes=1000)
    assert result.exit_code == 0
    assert result.stdout == "x" * 1000 + "\n[... truncated 99001 bytes]"
    assert result.stderr == "e" * 1000 + "\n[... truncated 4000 bytes]"


def test_python_tool_reports_bad_arguments_without_raising():
    tool = PythonTool()
    assert tool.name == "code_interpreter" and tool.get_openai_tool_schema() == PYTHON_TOOL_SCHEMA
    assert tool.limits == SandboxLimits()
    verl_style = PythonTool({"default_timeout": 7, "memory_limit_mb": 300, "max_output_bytes": 99})
    assert (verl_style.limits.wall_timeout_s, verl_style.limits.memory_mb) == (7.0, 300)
    assert verl_style.limits.max_output_bytes == 99
    for parameters in ({}, {"code": 42}, {"code": None}, {"code": "  "}, {"code": "print('\udc80')"}):
        text, reward, metrics = asyncio.run(tool.execute("i", parameters))
        assert text.startswith("Error: the 'code' argument") and reward == 0.0
        assert metrics == {"error": "bad arguments"}  # counted as a failed call, nothing ran
    assert "not valid Unicode (a lone surrogate at character 7)" in text


def test_python_tool_runs_code_and_describes_how_it_ended():
    tool = PythonTool({"wall_timeout_s": 2.0, "cpu_time_s": 5, "max_output_bytes": 200})

    async def calls():
        return await asyncio.gather(
            tool.execute("a", {"code": "print(6 * 7)"}),
            tool.execute("b", {"code": "print('before')\n1 / 0"}),
            tool.execute("c", {"code": "while True: pass"}),
            tool.execute("d", {"code": "print(1)\x00"}),
        )

    (ok, ok_reward, ok_metrics), (error, _, error_metrics), (slow, _, slow_metrics), (nul, _, nul_metrics) = (
        asyncio.run(calls())
    )
    assert ok == "42" and ok_reward == 0.0 and "error" not in ok_metrics
    assert ok_metrics["exit_code"] == 0 and ok_metrics["timed_out"] is False and ok_metrics["duration_s"] < 2
    assert error.startswith("before\nTraceback") and "ZeroDivisionError" in error
    assert error.endswith("[exit code 1]") and error_metrics["exit_code"] == 1
    assert slow.endswith("[timed out after 2.0s]") and slow_metrics["timed_out"] is True
    assert (error_metrics["error"], slow_metrics["error"]) == ("exit code 1", "wall timeout")
    assert "null bytes" in nul and nul_metrics["error"] == "exit code 1"


def test_concurrent_executions_keep_their_own_outputs():
    tool = PythonTool({"wall_timeout_s": 10.0})
    code = "import time\ntime.sleep(0.2)\nprint('run', {})"

    async def calls():
        return await asyncio.gather(*(tool.execute(str(i), {"code": code.format(i)}) for i in range(6)))

    responses = asyncio.run(calls())
    assert [text for text, _, _ in responses] == [f"run {i}" for i in range(6)]
