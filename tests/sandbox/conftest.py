"""The SandboxFusion-compatible server as its own process (``python -m hybridflow.sandbox serve`` on a free
port of 127.0.0.1), started once, as soon as this folder is collected (it boots while the test modules
import), plus a small server that answers junk."""

import contextlib
import http.server
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from hybridflow.utils.ports import find_free_port as free_port

_SERVER: dict = {}  # the one server process of the session, started when this conftest is collected


def _start_server(log_dir: str) -> tuple[subprocess.Popen, str, str]:
    """Start the server now, so that it boots while the test modules are imported."""
    if not _SERVER:
        port = free_port()
        log = os.path.join(log_dir, f"sandbox-server-{port}.log")
        command = [
            sys.executable,
            "-m",
            "hybridflow.sandbox",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        command += ["--max-concurrency", "4", "--max-memory-mb", "1024"]
        with open(log, "w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
        _SERVER.update(process=process, url=f"http://127.0.0.1:{port}", log=log)
    return _SERVER["process"], _SERVER["url"], _SERVER["log"]


def pytest_collectstart(collector):
    if isinstance(collector, pytest.Package) and collector.path.name == "sandbox":
        _start_server(tempfile.gettempdir())


def pytest_sessionfinish(session, exitstatus):
    process = _SERVER.pop("process", None)
    if process is not None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        with contextlib.suppress(OSError):
            os.remove(_SERVER["log"])


@pytest.fixture(scope="session")
def sandbox_server():
    """``(base_url, process)`` of a healthy server; skips where the kernel refuses the sandbox."""
    process, url, log = _start_server(tempfile.gettempdir())
    deadline = time.monotonic() + 90
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the sandbox server exited: {open(log).read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sandbox server did not become healthy: {open(log).read()[-3000:]}")
        time.sleep(0.2)
    probe = httpx.post(f"{url}/run_code", json={"code": "print('ok')", "language": "python"}, timeout=60)
    message = probe.json().get("message", "")
    if "cannot create the sandbox's namespaces" in message:
        pytest.skip(f"the sandbox cannot run on this machine: {message}")
    assert probe.json()["run_result"]["stdout"] == "ok\n", probe.json()
    return url, process


class _JunkHandler(http.server.BaseHTTPRequestHandler):
    """``/junk``: 200 with text that is not JSON; ``/list``: a JSON list; ``/error``: HTTP 500;
    ``/slow``: answers after 3 s."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/slow":
            time.sleep(3)
        status, body = {"/error": (500, b"boom"), "/list": (200, b"[1, 2]")}.get(self.path, (200, b"<html>"))
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def junk_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _JunkHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
