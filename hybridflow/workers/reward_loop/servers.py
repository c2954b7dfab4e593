"""A served reward model's processes: ``replicas`` × ``python -m hybridflow.serve --model PATH`` and, with
more than one, ``python -m hybridflow.serve.router`` in front (least in flight). :attr:`address`
(``host:port``) is what reward functions get as ``reward_router_address``.

They are started as subprocesses (the server is the floor above the trainer: started, never imported),
each with its own torch threads, logging to a file in ``log_dir``; :meth:`start` waits until every one
answers ``/health`` (a process that exits first raises with its log's tail) and :meth:`shutdown` ends
them. Use it as a context manager.

main_ppo builds them from the config (:meth:`RewardModelServers.from_config`: ``reward_model.enable``
with ``use_reward_loop``): ``model.path`` served under its expanded path (verl's served name), the
``reward_model.rollout.*`` engine keys as server flags, one replica per worker of the pool
(colocated: the trainer's ``n_gpus_per_node x nnodes``; standalone, ``enable_resource_pool``: the
reward model's own) over ``rollout.tensor_model_parallel_size``. Colocated, the trainer's reward phase
wakes them before scoring and puts them to sleep after (:meth:`wake_up` / :meth:`sleep`, the server's
``/wake_up`` and ``/sleep``: the KV cache released and re-created). :meth:`dead` names the replicas that
exited; :meth:`check_alive` raises with their exit codes and logs' tails.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridflow.utils.ports import find_free_port


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
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hybridflow-rm-")).resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = float(start_timeout_s)
        self.processes: list[tuple[subprocess.Popen, str, Path]] = []
        self.urls: list[str] = []
        self.address: str | None = None
        self._watching = False

    @classmethod
    def from_config(cls, config, log_dir: str | None = None) -> RewardModelServers:
        """The served reward model ``config`` (the whole run config) asks for (module docstring)."""
        rm, trainer = config.reward_model, config.trainer
        served = rm.rollout
        path = os.path.expanduser(str(rm.model.path))
        pool = (
            int(rm.n_gpus_per_node) * int(rm.nnodes)
            if rm.get("enable_resource_pool")
            else (int(trainer.n_gpus_per_node) * int(trainer.nnodes))
        )
        replicas = max(1, pool // int(served.get("tensor_model_parallel_size", 1) or 1))
        max_len = served.get("max_model_len") or int(served.prompt_length) + int(served.response_length)
        args = ["--backend", str(served.get("name", "engine")), "--max-model-len", str(int(max_len))]
        args += ["--max-num-seqs", str(int(served.max_num_seqs))]
        args += ["--max-num-batched-tokens", str(int(served.max_num_batched_tokens))]
        if not served.get("enable_prefix_caching", True):  # the server's default is on
            args.append("--no-enable-prefix-caching")
        if served.get("kv_cache_memory_gb") is not None:
            args += ["--kv-cache-memory-gb", str(float(served.kv_cache_memory_gb))]
        else:  # verl's fraction, shared by the replicas that start together from one free-memory reading
            args += ["--gpu-memory-utilization", str(float(served.gpu_memory_utilization) / replicas)]
        if str(trainer.get("device", "cpu")) == "cuda":  # the judge beside the trainer, on its GPUs
            args += ["--device", "cuda"]
        dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(served.get("dtype"), served.get("dtype"))
        if dtype is not None:
            args += ["--dtype", str(dtype)]
        threads = int(trainer.get("num_threads_per_worker", 1) or 1)
        return cls(path, replicas, server_args=tuple(args), threads=threads, log_dir=log_dir)

    def _spawn(self, module: str, args: list[str], name: str) -> tuple[subprocess.Popen, str]:
        port = find_free_port()
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

    # ------------------------------------------------------------------ health
    def dead(self) -> list[str]:
        """``name (url): exit code N; log tail`` for each process that exited (empty: all alive)."""
        lines = []
        for (process, name, log), url in zip(self.processes, [*self.urls, self.address or ""], strict=False):
            code = process.poll()
            if code is not None:
                tail = log.read_text()[-600:].strip().replace("\n", " | ") if log.exists() else ""
                lines.append(f"{name} ({url}): exit code {code}; its log ({log}) ends: {tail}")
        return lines

    def watch(self, interval_s: float = 2.0, report=None) -> None:
        """A daemon thread reporting, once each, the processes that exit before :meth:`shutdown`
        (``report``: a function of one line; default: print to stderr): a dead replica's requests fail
        (502 from the router, counted in ``reward/failures/error``), and this says which one and why."""
        import threading

        report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self._watching = True

        def run() -> None:
            told: set[str] = set()
            while self._watching:
                for line in self.dead():
                    name = line.split(" ", 1)[0]
                    if self._watching and name not in told:
                        told.add(name)
                        report(f"hybridflow: the served reward model lost {line}")
                time.sleep(interval_s)

        threading.Thread(target=run, name="reward-model-watch", daemon=True).start()

    def check_alive(self) -> None:
        """Raise naming every replica (or the router) that exited."""
        dead = self.dead()
        if dead:
            raise RuntimeError("the served reward model lost a process: " + " || ".join(dead))

    def _is_classifier(self) -> bool:
        from hybridflow.models.loading import is_sequence_classifier

        return is_sequence_classifier(self.model_path)

    # ------------------------------------------------------------------ colocated sleep / wake
    def _post_all(self, endpoint: str) -> list[dict]:
        import httpx

        key = os.environ.get("HYBRIDFLOW_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        answers = []
        for url in self.urls:
            try:
                answer = httpx.post(f"{url}{endpoint}", headers=headers, timeout=120)
            except httpx.HTTPError as error:
                self.check_alive()
                raise RuntimeError(
                    f"reward model replica {url}{endpoint}: {type(error).__name__}: {error}"
                ) from error
            if answer.status_code == 404 and self._is_classifier():  # a DisRM holds no KV cache
                answers.append({})
                continue
            if answer.status_code != 200:
                raise RuntimeError(
                    f"reward model replica {url}{endpoint}: {answer.status_code} {answer.text[:300]}"
                )
            answers.append(answer.json())
        return answers

    def sleep(self) -> dict[str, float]:
        """Every replica releases its KV cache; ``{"freed_kv_gb", "rss_freed_gb"}`` summed over them."""
        answers = self._post_all("/sleep")
        freed = sum(a.get("freed_kv_bytes", 0) for a in answers)
        rss = sum(a.get("rss_before_bytes", 0) - a.get("rss_after_bytes", 0) for a in answers)
        return {"freed_kv_gb": freed / 2**30, "rss_freed_gb": rss / 2**30}

    def wake_up(self) -> dict[str, float]:
        """Every replica re-creates its KV cache (raises first when one exited)."""
        self.check_alive()
        answers = self._post_all("/wake_up")
        return {"kv_gb": sum(a.get("kv_bytes", 0) for a in answers) / 2**30}

    def describe(self) -> str:
        flags = shlex.join(self.server_args)
        return f"{self.replicas} replica(s) of {self.model_path} ({flags}; {self.threads} thread(s) each)"

    def shutdown(self) -> None:
        self._watching = False
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
