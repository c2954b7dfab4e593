"""A served reward model's processes: ``replicas`` × ``python -m hybridflow.serve --model PATH`` and, with
more than one, ``python -m hybridflow.serve.router`` in front (least in flight). :attr:`address`
(``host:port``) is what reward functions get as ``reward_router_address``.

They are started as subprocesses (the server is the floor above the trainer: started, never imported),
each with its own torch threads, logging to a file in ``log_dir``; :meth:`start` waits until every one
answers ``/health`` (a process that exits first raises with its log's tail) and :meth:`shutdown` ends
them. Use it as a context manager.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RewardModelServers:
    """``model_path``: the RM (a causal LM for a GenRM, a sequence classifier for a DisRM);
    ``replicas``; ``served_name`` (default ``model_path``); ``server_args``: more ``hybridflow.serve``
    flags (``--max-num-seqs``, ``--kv-cache-memory-gb``, ``--dtype``, ``--api-key``, ...);
    ``threads``: torch threads per replica."""

    def __init__(
        self,
        model_path: str,
        replicas: int = 1,
        served_name: str | None = None,
        server_args: tuple[str, ...] = (),
        threads: int = 1,
        log_dir: str | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"a served reward model needs at least one replica, got {replicas}")
        self.model_path, self.replicas = str(model_path), int(replicas)
        self.served_name = served_name or self.model_path
        self.server_args, self.threads = tuple(server_args), int(threads)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hybridflow-rm-"))
        self.start_timeout_s = float(start_timeout_s)
        self.processes: list[tuple[subprocess.Popen, str, Path]] = []
        self.urls: list[str] = []
        self.address: str | None = None

    def _spawn(self, module: str, args: list[str], name: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1"}
        log = self.log_dir / f"{name}-{port}.log"
        with open(log, "w") as out:  # a file, not a pipe nobody drains
            command = [sys.executable, "-m", module, "--port", str(port), *args]
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.processes.append((process, name, log))
        return process, f"http://127.0.0.1:{port}"

    def start(self) -> RewardModelServers:
        server_args = ["--model", self.model_path, "--served-model-name", self.served_name]
        server_args += ["--threads", str(self.threads), *self.server_args]
        for i in range(self.replicas):
            self.urls.append(self._spawn("hybridflow.serve", server_args, f"rm-replica-{i}")[1])
        url = self.urls[0]
        if self.replicas > 1:
            router_args = [arg for u in self.urls for arg in ("--upstream", u)]
            url = self._spawn("hybridflow.serve.router", router_args, "rm-router")[1]
        try:
            self._wait_healthy([*self.urls, url])
        except BaseException:
            self.shutdown()
            raise
        self.address = url.removeprefix("http://")
        return self

    def _wait_healthy(self, urls: list[str]) -> None:
        import httpx

        deadline = time.monotonic() + self.start_timeout_s
        waiting = list(dict.fromkeys(urls))
        while waiting:
            for process, name, log in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"reward model {name} exited at start-up: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reward model servers not healthy after {self.start_timeout_s:.0f} s: {waiting}"
                )
            for url in list(waiting):
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        waiting.remove(url)
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)

    def shutdown(self) -> None:
        for process, _, _ in self.processes:
            if process.poll() is None:
                process.terminate()
        for process, _, _ in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []

    def __enter__(self) -> RewardModelServers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()
