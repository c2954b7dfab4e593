"""``AgentLoopManager``: generation servers + agent-loop workers behind ``generate_sequences``
(verl's class; ``actor_rollout_ref.rollout.mode=async``).

Hybrid mode (the trainer's): each actor rank is one replica. Its engine stays in the rank's process and
shares the actor's weights; the rank's :class:`~hybridflow.workers.rollout.replica.LLMServer` takes the
requests. One ``generate_sequences`` call:

1. the servers open and the batch, split over ``rollout.agent.num_workers``
   :class:`~.worker.AgentLoopWorker` actors, starts one agent loop per sample at once: the loops render
   their prompts and send their first turns while the replicas wake up, and the servers queue them;
2. ``rollout_wake_up`` on every rank: the actor's current weights into the engines (in place, as the
   synchronous rollout does) and KV caches sized for the batch's samples (not the full budget: the
   training state shares the memory); then every rank runs ``serve_requests`` against its server (a
   long call), whose first exchange takes the queued requests into one prefill; requests spread over
   the replicas one at a time (least in flight, sticky per sample) and each sample is scored as it
   finishes;
3. the servers stop, the ranks return from serving and ``rollout_sleep`` frees the KV caches.

Starting the loops before the wake-up hides the wake-up (~20-25 ms a step on the long-tail workload,
2 cores) behind the samples' starts. A wake-up that raises fails the servers, so the loops already
waiting end at once, and the call raises the wake-up's error. With elastic replicas the loops start
after the wake-up (a replica may be replaced during it).

A rank whose process dies mid-rollout fails its server: the samples waiting on it raise an error
naming the replica and the sample, and the call raises instead of hanging. An agent loop that raises
does the same, naming the loop and the sample. Over a rollout pool of its own (``fully_async_main``,
``max_replica_restarts`` given) the replicas are elastic instead (:mod:`.elastic`): a replica that dies
is replaced and its requests go to the others.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.rollout_trace import rollout_numbers


class AgentLoopManager:
    """``config``: the resolved run config; ``worker_group``: the actor/rollout group (hybrid mode).
    ``generate_sequences`` has the worker group's contract, so the trainer calls either."""

    needs_all_fields = True  # the loops read the samples' dataset fields (messages, tools_kwargs, ...)

    def __init__(self, config, worker_group, max_replica_restarts: int | None = None) -> None:
        import ray
        from omegaconf import OmegaConf

        from hybridflow.workers.rollout.agent_loop.worker import AgentLoopWorker
        from hybridflow.workers.rollout.replica import LLMServer

        self.config = config
        self.worker_group = worker_group
        agent = config.actor_rollout_ref.rollout.get("agent") or {}
        replicas = worker_group.world_size
        self.server_names = [f"replica {r} (rank {r})" for r in range(replicas)]
        server_cls = ray.remote(num_cpus=0, max_concurrency=100_000)(LLMServer)
        self.servers = [server_cls.remote(name) for name in self.server_names]
        container = OmegaConf.to_container(config, resolve=True)
        self.tracing = bool((container["actor_rollout_ref"]["rollout"].get("trace") or {}).get("backend"))
        if self.tracing:  # the workers' working directory is not the driver's: an absolute path
            from hybridflow.utils.rollout_trace import trace_dir

            container["actor_rollout_ref"]["rollout"]["trace"]["dir"] = trace_dir(config)
        worker_cls = ray.remote(num_cpus=0, max_concurrency=100_000)(AgentLoopWorker)
        env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}
        verl_compat = sys.modules.get("hybridflow.verl_compat")
        if verl_compat is not None and verl_compat.is_installed():  # loops written for verl import there too
            env["env_vars"]["HYBRIDFLOW_VERL_ALIAS"] = "1"
        self.workers = [
            worker_cls.options(runtime_env=env).remote(container, self.servers, self.server_names)
            for _ in range(int(agent.get("num_workers") or 1))
        ]
        self.pad_token_id = None
        self.serving_refs: list | None = None  # per replica, its serve loop's future (None: not serving)
        self._down: set[int] = set()  # replicas whose process died, until they serve again
        self.elastic = None
        if max_replica_restarts is not None:  # a standalone pool: replicas that die are replaced
            from hybridflow.workers.rollout.agent_loop.elastic import ElasticReplicas

            self.elastic = ElasticReplicas(self, max_replica_restarts)

    # ------------------------------------------------------------------ one batch
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompt rows (repeated ``n`` times, with their dataset fields) → the rollout batch."""
        start = time.perf_counter()
        # each row's number in its group, counted before a group is split over workers: the sample's
        # seeded stream (a group split across two chunks would otherwise number both halves from 0 and
        # sample the same response twice) and the trace's rollout_n
        numbers = rollout_numbers(prompts.non_tensor_batch.get(keys.UID), len(prompts))
        prompts.non_tensor_batch["rollout_n"] = np.array(numbers, dtype=np.int64)
        chunks = prompts.split(_even_sizes(len(prompts), len(self.workers)))
        if self.elastic is None:
            # the loops start (prompts rendered, first turns sent) while the replicas wake: the servers
            # queue the requests, and each engine takes its queue in its first exchange, one prefill
            self._open_servers()
            refs = self._dispatch(chunks)
            try:
                sync_metrics, serve_refs = self.start_serving(rows=len(prompts), opened=True)
            except BaseException as error:
                self._abandon(refs, error)
                raise
        else:  # a replica may be replaced while waking: the loops start once the serving set is known
            sync_metrics, serve_refs = self.start_serving(rows=len(prompts))
            refs = self._dispatch(chunks)
        try:
            outputs = self._wait(refs, serve_refs)
        finally:
            served = self.stop_serving(serve_refs)
        # each worker's reward-loop metrics and clock differ: set aside from the concat, merged in _metrics
        own = [{k: out.meta_info.pop(k) for k in REWARD_META if k in out.meta_info} for out in outputs]
        output = concat_rows(outputs)
        for out, kept in zip(outputs, own, strict=True):
            out.meta_info.update(kept)
        output.meta_info["metrics"] = self._metrics(
            outputs, output, sync_metrics, served, time.perf_counter() - start
        )
        return output

    def _dispatch(self, chunks: list[DataProto]) -> list:
        """One chunk per agent-loop worker (empty ones skipped); their outputs' futures."""
        return [w.generate_sequences.remote(c) for w, c in zip(self.workers, chunks, strict=True) if len(c)]

    def _open_servers(self) -> None:
        """Let the servers take requests (a partial rollout's abort ended, stop cleared); they queue
        them until their replicas serve."""
        import ray

        ray.get([server.start_serving.remote() for server in self.servers])

    def _abandon(self, refs: list, error: BaseException) -> None:
        """The replicas did not wake (``error``) while the chunks' loops were already waiting on the
        servers: fail the servers so every loop ends at once, let the chunks return (their errors are
        this one's consequence), and clear the failure for a later call."""
        import ray

        self.fail_servers(f"the replicas did not start serving: {type(error).__name__}: {error}")
        try:
            ray.wait(refs, num_returns=len(refs), timeout=60)
        except Exception:  # noqa: S110  (Ray going down: the caller raises the wake-up's error)
            pass
        for server in self.servers:
            try:
                ray.get(server.recover.remote(), timeout=10)
            except Exception:  # noqa: S112
                continue

    def start_serving(self, rows: int | None = None, opened: bool = False) -> tuple[list, list]:
        """Wake the replicas (weights in, KV caches for ``rows`` samples each at most — any replica may
        get all of a batch — or full size) and start their serve loops; returns the wake-up metrics and
        one serve-loop future per replica (:meth:`stop_serving` ends them). ``opened``: the servers
        already take requests (:meth:`_open_servers`)."""
        import ray

        if self.elastic is None:
            ranks = list(range(len(self.servers)))
            sync_metrics = self.worker_group.rollout_wake_up(rows)
        else:  # a replica that died since the last phase is replaced now, the others serve
            sync_metrics = self.elastic.call_each("rollout_wake_up", self.elastic.serving_ranks(), rows)
            ranks = self.elastic.serving_ranks()
        group = self.worker_group if len(ranks) == len(self.servers) else self.worker_group.view(ranks)
        back = [r for r in ranks if r in self._down]  # restarted replicas, weights loaded by the sync
        ray.get([self.servers[r].recover.remote() for r in back])
        if not opened:
            self._open_servers()
        serving = group.serve_requests_async([self.servers[r] for r in ranks])  # one long call per rank
        refs: list = [None] * len(self.servers)
        for position, rank in enumerate(ranks):
            refs[rank] = serving.rank_refs[position]
        self._replicas_up(back)
        if back:
            print(f"hybridflow: {', '.join(self.server_names[r] for r in back)} serves again", flush=True)
        self.serving_refs = refs
        return sync_metrics, refs

    def _replicas_up(self, replicas: list[int]) -> None:
        import ray

        ray.get([w.replica_up.remote(r) for w in self.workers for r in replicas])
        self._down.difference_update(replicas)

    def mark_not_serving(self, replica: int) -> None:
        """Replica ``replica`` died (:mod:`.elastic`): no serve loop of it to watch or wait for."""
        self._down.add(replica)
        if self.serving_refs is not None:
            self.serving_refs[replica] = None

    def join_replicas(self, replicas: list[int]) -> None:
        """Restarted replicas that now hold the current weights serve again, at once if the others are
        serving (else from the next :meth:`start_serving`)."""
        import ray

        if self.serving_refs is None:
            return
        view = self.worker_group.view(replicas)
        view.rollout_wake_up(None)
        ray.get([self.servers[r].recover.remote() for r in replicas])
        ray.get([self.servers[r].start_serving.remote() for r in replicas])
        serving = view.serve_requests_async([self.servers[r] for r in replicas])
        for position, replica in enumerate(replicas):
            self.serving_refs[replica] = serving.rank_refs[position]
        self._replicas_up(replicas)
        print(f"hybridflow: {', '.join(self.server_names[r] for r in replicas)} serves again", flush=True)

    def elastic_metrics(self) -> dict[str, float]:
        """``rollout/replica_restarts`` and ``rollout/requests_rerouted`` (the run's totals so far), and
        ``rollout/replicas_serving`` (now: the replicas not waiting for a new process or its weights)."""
        import ray

        if self.elastic is None:
            return {}
        rerouted = sum(ray.get([w.requests_rerouted.remote() for w in self.workers]))
        return {
            "rollout/replica_restarts": float(self.elastic.restarts),
            "rollout/requests_rerouted": float(rerouted),
            "rollout/replicas_serving": float(len(self.servers) - len(self._down)),
        }

    def stop_serving(self, serve_refs: list) -> list[dict]:
        """Let every serve loop return once its engine holds no request; the replicas sleep."""
        import ray

        ray.get([server.stop_serving.remote() for server in self.servers])
        served = self._finish_serving(serve_refs)
        self.serving_refs = None
        if self.elastic is None:
            self.worker_group.rollout_sleep()
        else:  # a replica that died as serving ended (its loop's end then looks normal) is replaced now
            awake = [r for r in range(len(self.servers)) if r not in self._down]
            self.elastic.call_each("rollout_sleep", awake)
        return served

    def generate_async(self, prompts: DataProto, worker: int = 0):
        """One agent-loop worker's call on ``prompts`` (an ObjectRef of the output); the servers must be
        serving (:meth:`start_serving`). The asynchronous rollouter streams groups through this."""
        return self.workers[worker % len(self.workers)].generate_sequences.remote(prompts)

    def _wait(self, refs: list, serve_refs: list) -> list[DataProto]:
        """The chunks' outputs; a serve loop that ends early (its rank died) fails its server at once, so
        the samples waiting on it raise instead of hanging."""
        import ray

        pending, ended = list(refs), set()
        while pending:
            watching = self._watched(serve_refs, ended)
            ready, _ = ray.wait(pending + list(watching), num_returns=1, timeout=1.0)
            for ref in ready:
                if ref in watching:
                    ended.add(ref)
                    self._serve_loop_ended(ref, watching[ref])
                else:
                    pending.remove(ref)
        return ray.get(refs)

    @staticmethod
    def _watched(serve_refs: list, ended: set) -> dict:
        """The serve loops to watch: ``{future: replica}`` (a restarted replica's new one included)."""
        return {ref: r for r, ref in enumerate(serve_refs) if ref is not None and ref not in ended}

    def _serve_loop_ended(self, ref, replica: int) -> None:
        """A serve loop ended while serving: with elastic replicas a process that died is replaced
        (:mod:`.elastic`); otherwise (or for another cause) its server fails."""
        if getattr(self, "elastic", None) is not None:
            from hybridflow.single_controller.ray.base import WorkerDiedError

            try:
                self.worker_group._get_one(ref, replica, "serve_requests")
            except WorkerDiedError as died:
                self.elastic.replica_died(replica, str(died).splitlines()[0][:300])
                return
            except Exception:  # noqa: S110  (not a death: the server fails below, saying why)
                pass
        self._fail_server(ref, replica)

    def watch_serving(self, serve_refs: list, stop) -> None:
        """For a streaming caller (the asynchronous rollouter), which has no batch to wait on: block
        until ``stop()`` is true, polling the serve loops; one that ends while serving (its rank died)
        fails its server at once, so the samples waiting on it raise naming the replica."""
        import time

        import ray

        from hybridflow.workers.rollout.agent_loop.elastic import ReplicaRestartLimit

        ended: set = set()
        while not stop():
            watching = self._watched(serve_refs, ended)
            if not watching:
                if getattr(self, "elastic", None) is None:
                    return
                time.sleep(0.2)  # every replica died: their new processes will be watched
                continue
            try:
                ready, _ = ray.wait(list(watching), num_returns=1, timeout=0.2)
            except BaseException:  # Ray shut down under a run that failed elsewhere: nothing to watch
                if stop() or not ray.is_initialized():
                    return
                raise
            for ref in ready:
                ended.add(ref)
                replica = watching[ref]
                if stop():
                    continue
                try:
                    self._serve_loop_ended(ref, replica)
                except ReplicaRestartLimit:
                    raise
                except Exception as error:  # the caller ends the run: say which replica it was about
                    raise RuntimeError(
                        f"{self.server_names[replica]}: its serve loop ended while serving, and failing "
                        f"its server raised {type(error).__name__}: {error}"
                    ) from error

    def _fail_server(self, serve_ref, replica: int) -> None:
        """A serve loop ended while serving: fail its server, so the samples waiting on it raise."""
        import ray

        ray.get(self.servers[replica].fail.remote(self._serve_failure(serve_ref, replica)))

    def fail_servers(self, reason: str) -> None:
        """Fail every server (the run is ending): the samples waiting on any replica raise ``reason``
        instead of waiting for answers. Best effort: a server that cannot be reached is skipped."""
        import ray

        for server in self.servers:
            try:
                ray.get(server.fail.remote(reason), timeout=10)
            except Exception:  # noqa: S112  (Ray going down: nothing left to wait on it)
                continue

    def _finish_serving(self, serve_refs: list) -> list[dict]:
        """Each rank's serve statistics (an error in place of a rank that died)."""
        import ray

        stats = []
        for replica, ref in enumerate(serve_refs):
            if ref is None:  # a replica that died (elastic): not serving
                continue
            try:
                stats.append(ray.get(ref))
            except Exception as error:  # the rollout's own error (raised above) says more
                stats.append({"error": f"{self.server_names[replica]}: {type(error).__name__}"})
        return stats

    def _serve_failure(self, ref, replica: int) -> str:
        """Why a rank's serve loop ended early, as its worker group reports it (pid, node)."""
        try:
            self.worker_group._get_one(ref, replica, "serve_requests")
        except Exception as error:
            return f"its engine process failed mid-rollout: {str(error).splitlines()[0][:400]}"
        return "its serve loop ended before the rollout did"

    def abort_all(self) -> int:
        """Abort every request in flight on every replica (partial rollout); returns how many."""
        import ray

        return sum(ray.get([server.abort_all.remote() for server in self.servers]))

    def shutdown(self) -> None:
        import ray

        for actor in [*self.workers, *self.servers]:
            ray.kill(actor)

    # ------------------------------------------------------------------ metrics
    def _metrics(self, outputs, output: DataProto, sync_metrics, served: list[dict], seconds: float) -> dict:
        """verl's ``agent_loop/*`` metrics (as one-element lists, the rollout metrics' shape)."""
        per_sample = [m for out in outputs for m in out.meta_info.pop("metrics")]
        stuck = max(int(out.meta_info.pop("stuck_scorers", 0)) for out in outputs)
        generate = np.array([m["generate_sequences"] for m in per_sample])
        tools = np.array([m["tool_calls"] for m in per_sample])
        preempted = np.array([m["num_preempted"] for m in per_sample])
        metrics: dict[str, list] = {
            "generate_sequences": [seconds],
            "agent_loop/stuck_scorers": [float(stuck)],
        }
        if any("reward_metrics" in out.meta_info for out in outputs):  # the reward loop scored in the loops
            from hybridflow.workers.reward_loop.loop import merge_worker_metrics

            per_worker = [out.meta_info.pop("reward_metrics", {}) for out in outputs]
            clocks = [out.meta_info.pop("reward_clock", {}) for out in outputs]
            metrics.update({k: [v] for k, v in merge_worker_metrics(per_worker, clocks).items()})
        for name, values in (
            ("generate_sequences", generate),
            ("tool_calls", tools),
            ("num_preempted", preempted),
        ):
            for stat in ("min", "max", "mean"):
                metrics[f"agent_loop/{name}/{stat}"] = [float(getattr(values, stat)())]
        slowest = int(np.argmax(generate + tools))
        prompt_width = output.batch[keys.PROMPTS].shape[1]
        mask = output.batch[keys.ATTENTION_MASK][slowest]
        metrics["agent_loop/slowest/generate_sequences"] = [float(generate[slowest])]
        metrics["agent_loop/slowest/tool_calls"] = [float(tools[slowest])]
        metrics["agent_loop/slowest/prompt_length"] = [float(mask[:prompt_width].sum())]
        metrics["agent_loop/slowest/response_length"] = [float(mask[prompt_width:].sum())]
        metrics["agent_loop/slowest/num_preempted"] = [float(preempted[slowest])]
        requests = [float(s.get("requests", 0)) for s in served]
        metrics["agent_loop/replica_requests/min"] = [min(requests)]
        metrics["agent_loop/replica_requests/max"] = [max(requests)]
        busy = [float(s.get("seconds", 0.0)) for s in served]
        metrics["agent_loop/replica_serve_s/max"] = [max(busy)]
        metrics.update(_cache_metrics(served))
        for rank_metrics in sync_metrics:  # the weight sync of each rank (the worst is kept)
            for key, value in (rank_metrics or {}).items():
                metrics.setdefault(key, []).append(value)
        return metrics


REWARD_META = ("reward_metrics", "reward_clock")  # per worker (the reward loop's), merged by _metrics


def _cache_metrics(served: list[dict]) -> dict[str, list[float]]:
    """The synchronous rollout's cache metrics over the replicas' serve loops (hybridflow's engine):
    ``rollout/prefix_cache_hit_rate`` (cached prompt tokens / prompt tokens), ``rollout/preemptions``
    and ``rollout/kv_blocks_peak_frac`` (the fullest replica's most blocks held at once)."""
    counted = [s for s in served if s.get("prefix_queries") is not None]
    if not counted:  # vLLM replicas, or every serve loop failed
        return {}
    queries = sum(s["prefix_queries"] for s in counted)
    hits = sum(s["prefix_hits"] for s in counted)
    return {
        "rollout/prefix_cache_hit_rate": [hits / queries if queries else 0.0],
        "rollout/preemptions": [float(sum(s["preemptions"] for s in counted))],
        "rollout/kv_blocks_peak_frac": [max(s["kv_blocks_peak_frac"] for s in counted)],
    }


def _even_sizes(rows: int, parts: int) -> list[int]:
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def concat_rows(outputs: list[DataProto]) -> DataProto:
    """Concatenate chunk outputs whose prompt widths may differ (a loop may lengthen its prompt): each
    is left-padded to the widest first (the chunks' loop outputs of aborted samples are dropped: a batch
    rollout is not resumed)."""
    width = max(out.batch[keys.PROMPTS].shape[1] for out in outputs)
    for out in outputs:
        out.meta_info.pop("loop_outputs", None)
        left_pad_prompts(out, width)
    return DataProto.concat(outputs)


def left_pad_prompts(data: DataProto, width: int, pad_id: int = 0) -> None:
    """Widen the prompt part of a rollout batch to ``width`` columns by left padding (in place)."""
    extra = width - data.batch[keys.PROMPTS].shape[1]
    if extra <= 0:
        return
    rows = len(data)
    for key in (keys.PROMPTS, keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS):
        tensor = data.batch[key]
        fill = pad_id if key in (keys.PROMPTS, keys.INPUT_IDS) else 0
        pad = torch.full((rows, extra), fill, dtype=tensor.dtype, device=tensor.device)
        data.batch[key] = torch.cat([pad, tensor], dim=1)
    if keys.ROUTED_EXPERTS in data.batch.keys():  # router replay R3: (B, T, L, k), 0 on the new padding
        routed = data.batch[keys.ROUTED_EXPERTS]
        pad = torch.zeros(rows, extra, *routed.shape[2:], dtype=routed.dtype, device=routed.device)
        data.batch[keys.ROUTED_EXPERTS] = torch.cat([pad, routed], dim=1)
