"""``python -m hybridflow.sandbox serve`` over HTTP: SandboxFusion's ``/run_code`` shape, normal runs
(stdin/stdout, return codes, files in and out, compiled and other languages) and hostile code (an
endless loop, too much memory, files outside the run, the network, killing the driver), the server
answering each and serving on."""

import base64
import os
import time
import uuid

import httpx
import pytest

from hybridflow.sandbox.runner import SETUP_SLACK_S


def run(url, timeout=60, **request):
    response = httpx.post(f"{url}/run_code", json=request, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def url(sandbox_server):
    return sandbox_server[0]


@pytest.fixture(scope="module")
def languages(url):
    return httpx.get(f"{url}/health", timeout=10).json()["languages"]


def test_ping_and_health(url, languages):
    assert httpx.get(f"{url}/v1/ping", timeout=10).json() == "pong"
    assert "python" in languages


def test_stdin_stdout_and_the_response_shape(url):
    body = run(
        url, code="import sys\nprint(sys.stdin.read().upper(), end='')", language="python", stdin="abc\n"
    )
    assert set(body) >= {"status", "message", "compile_result", "run_result", "files", "executor_pod_name"}
    assert body["status"] == "Success" and body["compile_result"] is None and body["files"] == {}
    result = body["run_result"]
    assert set(result) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert (result["status"], result["return_code"], result["stdout"], result["stderr"]) == (
        "Finished",
        0,
        "ABC\n",
        "",
    )
    assert 0 <= result["execution_time"] < 10


def test_return_codes_and_errors(url):
    body = run(
        url, code="import sys\nprint('out'); print('err', file=sys.stderr); sys.exit(3)", language="python"
    )
    assert body["status"] == "Failed"
    assert body["run_result"] == {
        **body["run_result"],
        "status": "Finished",
        "return_code": 3,
        "stdout": "out\n",
    }
    assert body["run_result"]["stderr"] == "err\n"
    body = run(url, code="def broken(:\n", language="python")
    assert (body["status"], body["run_result"]["return_code"]) == ("Failed", 1)
    assert "SyntaxError" in body["run_result"]["stderr"]
    assert (
        run(url, code="import os; os.kill(os.getpid(), 9)", language="python")["run_result"]["return_code"]
        == -9
    )


def test_files_in_and_out(url):
    code = (
        "data = open('data/in.txt').read()\n"
        "open('out.txt', 'w').write(data[::-1])\n"
        "import os; os.makedirs('deep/er'); open('deep/er/x.bin', 'wb').write(bytes(range(256)))\n"
        "os.symlink('/etc/passwd', 'link')\n"
    )
    body = run(
        url,
        code=code,
        language="python",
        files={"data/in.txt": b64(b"hello")},
        fetch_files=["out.txt", "deep/er/x.bin", "absent.txt", "link"],
    )
    assert body["status"] == "Success", body
    assert base64.b64decode(body["files"]["out.txt"]) == b"olleh"
    assert base64.b64decode(body["files"]["deep/er/x.bin"]) == bytes(range(256))
    assert "absent.txt" not in body["files"] and "link" not in body["files"]  # absent; a link is not followed
    for bad in (
        {"files": {"../up.txt": b64(b"x")}},
        {"files": {"/abs.txt": b64(b"x")}},
        {"fetch_files": ["../x"]},
    ):
        refused = run(url, code="print(1)", language="python", **bad)
        assert refused["status"] == "SandboxError" and "inside the run's directory" in refused["message"]
    assert "not valid base64" in run(url, code="", language="python", files={"a": "***"})["message"]


def test_an_endless_loop_is_stopped_at_its_timeout(url):
    started = time.monotonic()
    body = run(url, code="while True:\n    pass\n", language="python", run_timeout=1)
    elapsed = time.monotonic() - started
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "TimeLimitExceeded" and body["run_result"]["return_code"] is None
    assert 1 <= body["run_result"]["execution_time"] < 3
    assert elapsed < 1 + SETUP_SLACK_S
    # output printed before the timeout is kept; a child left running is stopped with it
    body = run(
        url,
        code="import subprocess, time\nprint('started', flush=True)\n"
        "subprocess.Popen(['sleep', '60'])\ntime.sleep(60)",
        language="python",
        run_timeout=1,
    )
    assert body["run_result"]["status"] == "TimeLimitExceeded" and body["run_result"]["stdout"] == "started\n"


def test_more_memory_than_the_limit_fails_and_the_server_survives(url):
    body = run(
        url,
        code="x = bytearray(400 * 1024 * 1024)\nprint('allocated')",
        language="python",
        memory_limit_MB=128,
    )
    assert body["status"] == "Failed"
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["return_code"] != 0
    assert "MemoryError" in body["run_result"]["stderr"] and body["run_result"]["stdout"] == ""
    fits = run(
        url,
        code="x = bytearray(32 * 1024 * 1024)\nprint('allocated')",
        language="python",
        memory_limit_MB=256,
    )
    assert fits["status"] == "Success" and fits["run_result"]["stdout"] == "allocated\n"


def test_files_outside_the_run_cannot_be_read_or_written(url, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)  # readable by anyone on the host
    marker = f"/tmp/sandbox-escape-{uuid.uuid4().hex}"
    code = f"""
import os
def attempt(what, action):
    try:
        action()
        print(what, 'ok')
    except OSError as error:
        print(what, 'failed', type(error).__name__)
attempt('read-host-file', lambda: open({str(secret)!r}).read())
attempt('read-shadow', lambda: open('/etc/shadow').read())
attempt('write-parent', lambda: open('../escape.txt', 'w').write('x'))
attempt('write-usr', lambda: open('/usr/escape.txt', 'w').write('x'))
attempt('write-tmp', lambda: open({marker!r}, 'w').write('x'))
print(sorted(os.listdir('/')))
"""
    body = run(url, code=code, language="python")
    lines = body["run_result"]["stdout"].splitlines()
    assert lines[:5] == [
        "read-host-file failed FileNotFoundError",
        "read-shadow failed FileNotFoundError",
        "write-parent failed OSError",  # the root is a read-only tmpfs
        "write-usr failed OSError",
        "write-tmp ok",  # the run's own /tmp, private to it
    ], body
    assert "home" not in lines[5] and "work" not in lines[5]
    assert not os.path.exists(marker) and not os.path.exists("/escape.txt")


def test_no_network(url):
    port = int(url.rsplit(":", 1)[1])
    code = f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=3)
    print('connected')
except OSError as error:
    print('blocked', type(error).__name__)
"""
    assert run(url, code=code, language="python")["run_result"]["stdout"].startswith("blocked")


def test_code_that_kills_the_driver_is_a_sandbox_error_and_the_server_goes_on(url):
    body = run(url, code="import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", language="python")
    assert body["status"] == "SandboxError" and "without a report" in body["message"]
    forged = run(
        url,
        code="print('\\x1e' + '0' * 32 + '\\x1e{\"run\": null}' + '\\x1e' + '0' * 32 + '\\x1e')",
        language="python",
    )
    assert forged["status"] == "Success" and forged["run_result"]["stdout"].startswith("\x1e")  # just output
    assert run(url, code="print(2 + 2)", language="python")["run_result"]["stdout"] == "4\n"


def test_cpp_compiles_runs_and_reports_compile_errors(url, languages):
    if "cpp" not in languages:
        pytest.skip("g++ is not installed where the sandbox sees it")
    code = '#include <cstdio>\nint main() { int a, b; scanf("%d %d", &a, &b); printf("%d\\n", a + b); }\n'
    body = run(url, code=code, language="cpp", stdin="2 40")
    assert body["status"] == "Success", body
    assert body["compile_result"]["status"] == "Finished" and body["compile_result"]["return_code"] == 0
    assert body["run_result"]["stdout"] == "42\n"
    broken = run(url, code="int main() { return undefined_name; }", language="cpp")
    assert broken["status"] == "Failed" and broken["run_result"] is None
    assert (
        broken["compile_result"]["return_code"] != 0
        and "undefined_name" in broken["compile_result"]["stderr"]
    )


def test_bash_runs_and_unknown_languages_are_refused_by_name(url, languages):
    if "bash" in languages:
        body = run(url, code='read name\necho "hi $name"\nexit 4', language="bash", stdin="bob\n")
        assert (body["status"], body["run_result"]["stdout"], body["run_result"]["return_code"]) == (
            "Failed",
            "hi bob\n",
            4,
        )
    for language in ("klingon", "lean"):
        refused = run(url, code="x", language=language)
        assert refused["status"] == "SandboxError" and repr(language) in refused["message"]
        assert refused["run_result"] is None
    assert httpx.post(f"{url}/run_code", json={"language": "python"}, timeout=10).status_code == 422
