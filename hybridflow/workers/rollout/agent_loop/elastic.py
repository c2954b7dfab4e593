"""Elastic rollout replicas: a replica whose engine process dies mid-rollout is replaced, the run goes on.

For a rollout pool of its own (``fully_async_main``'s standalone replicas; in ``main_ppo``'s server mode
a replica is a training rank, whose death ends the run). When a replica's serve loop ends because its
process died (:meth:`ElasticReplicas.replica_died`, called by the manager's serve-loop watcher):

1. its server is marked lost (:meth:`~hybridflow.workers.rollout.replica.LLMServer.lose`): the requests
   waiting on it raise :class:`~hybridflow.workers.rollout.replica.ReplicaLost`, and the agent loops'
   server managers send them to the other replicas from the same prompt (``rollout/requests_rerouted``;
   a multi-turn sample keeps its finished turns, the turn in flight starts over); the agent-loop workers
   route nothing more to it;
2. a new process takes its place in the worker group (same bundle, same rank) and builds its model and
   its checkpoint engine (``rollout/replica_restarts``);
3. it gets the current weights through the checkpoint engine, from the trainer's actor, by the same path
   as a parameter sync: :meth:`ElasticReplicas.load_pending` when the actor still holds the replicas'
   version (the trainer calls it between steps), else the next parameter sync, which moves the weights
   to every replica;
4. it serves again: its serve loop starts, its server recovers, the agent loops route to it.

A replica that dies between serving phases (while the rollouter pauses and its engine sleeps, or while it
wakes for the next phase) is found by those calls themselves (:meth:`ElasticReplicas.call_each`) and
replaced the same way. A death inside a parameter sync's broadcast still ends the run (its collective
breaks on every rank).

Past ``actor_rollout_ref.rollout.max_replica_restarts`` restarts in a run the next death ends the run with
:class:`ReplicaRestartLimit`, naming the replica and the count.
"""

from __future__ import annotations

import threading

MAX_REPLICA_RESTARTS_KEY = "actor_rollout_ref.rollout.max_replica_restarts"


class ReplicaRestartLimit(RuntimeError):
    """Replicas kept dying: the run stops (the message names the replica and the count)."""


class ElasticReplicas:
    """The restarts of ``manager``'s replicas (an
    :class:`~hybridflow.workers.rollout.agent_loop.manager.AgentLoopManager` over a standalone rollout
    pool). ``weight_sync``: the trainer's
    :class:`~hybridflow.workers.checkpoint_engine.CheckpointEngineManager`, set once it exists."""

    def __init__(self, manager, max_restarts: int) -> None:
        self.manager = manager
        self.max_restarts = int(max_restarts)
        self.restarts = 0  # in the run, all replicas together
        self.per_replica = [0] * len(manager.servers)
        self.pending: dict[int, list] = {}  # replica -> its new process's set-up calls, until it has weights
        self.weight_sync = None
        self.lock = threading.Lock()  # a restart against a weight load of the pending replicas

    # ------------------------------------------------------------------ a death (the watcher's thread)
    def replica_died(self, replica: int, reason: str) -> None:
        """Replica ``replica``'s process died while serving: reroute its requests and start a new
        process in its place (its weights come later: :meth:`load_pending`). Raises
        :class:`ReplicaRestartLimit` past the limit."""
        import ray

        manager = self.manager
        name = manager.server_names[replica]
        with self.lock:
            self.restarts += 1
            self.per_replica[replica] += 1
            if self.restarts > self.max_restarts:
                raise ReplicaRestartLimit(
                    f"{name} of the rollout pool died ({reason}); rollout replicas have died "
                    f"{self.restarts} times in this run ({name}: {self.per_replica[replica]}), more than "
                    f"{MAX_REPLICA_RESTARTS_KEY}={self.max_restarts} allows, so the run stops (replicas "
                    "that keep dying: out of memory, a failing node?)"
                )
            ray.get(manager.servers[replica].lose.remote(f"its engine process died ({reason})"))
            ray.get([worker.replica_down.remote(replica) for worker in manager.workers])
            group = manager.worker_group
            group.replace_worker(replica)
            view = group.view([replica])
            setup = [view.init_model_async()]
            if self.weight_sync is not None:
                setup.append(self.weight_sync.init_rollout_workers(view))
            self.pending[replica] = setup
            manager.mark_not_serving(replica)
        print(
            f"hybridflow: {name} of the rollout pool died ({reason}); its requests go to the other "
            f"replicas and a new process takes its place (restart {self.restarts} of at most "
            f"{self.max_restarts}: {MAX_REPLICA_RESTARTS_KEY})",
            flush=True,
        )

    # ------------------------------------------------------------------ control calls between phases
    def call_each(self, method: str, ranks: list[int], *args) -> list:
        """``method`` (a worker-group method, e.g. ``rollout_sleep``) on each of ``ranks``, outside a
        serving phase, where no serve loop is watched: a rank whose process died meanwhile is replaced
        (:meth:`replica_died`) instead of ending the run. Returns the outputs of the ranks that
        answered, in ``ranks``' order. A method that raises (not a death) raises."""
        from hybridflow.single_controller.ray.base import WorkerDiedError

        group = self.manager.worker_group
        futures = {rank: getattr(group.view([rank]), f"{method}_async")(*args) for rank in ranks}
        outputs = []
        for rank, future in futures.items():
            try:
                outputs.append(group._get_one(future.rank_refs[0], rank, method))
            except WorkerDiedError as died:
                self.replica_died(rank, str(died).splitlines()[0][:300])
        return outputs

    # ------------------------------------------------------------------ weights (the trainer's thread)
    def load_pending(self, version: int) -> dict[str, float]:
        """The replicas waiting for weights get the trainer's current ones as parameter ``version``
        (the caller's promise: the actor's weights are that version) through the checkpoint engine, and
        serve again. Call from the thread that drives the actor (its collectives keep their order)."""
        from hybridflow.single_controller.ray.base import wait_futures

        with self.lock:
            ranks = sorted(self.pending)
            if not ranks or self.weight_sync is None:
                return {}
            view = self.manager.worker_group.view(ranks)
            setup = [call for r in ranks for call in self.pending[r]]
            if len(setup) == len(ranks):  # restarted before the checkpoint engine existed
                setup.append(self.weight_sync.init_rollout_workers(view))
            wait_futures(setup)
            metrics = self.weight_sync.update_weights(int(version), rollout=view)
            self.pending.clear()
        self.manager.join_replicas(ranks)
        return {"rollout/replica_load_s": metrics.get("timing_s/param_sync", 0.0)}

    def weights_loaded(self) -> None:
        """A parameter sync of the whole pool gave every replica, the pending ones too, the weights:
        they serve from the next serving phase on."""
        with self.lock:
            self.pending.clear()

    def serving_ranks(self) -> list[int]:
        """The replicas with weights (a pending one must not serve: it holds the model's initial
        weights)."""
        return [r for r in range(len(self.per_replica)) if r not in self.pending]
