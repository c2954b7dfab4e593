"""The rollouter: streams prompt groups through the agent loops on the rollout pool, on its own thread.

It takes prompts in data order, one group (a prompt and its ``rollout.n`` responses) at a time, and
runs each as soon as it is admitted, so the replicas always hold as many requests as the budget
allows; finished groups go to the :class:`~.message_queue.GroupQueue` with the parameter versions that
generated them.

**Admission (verl's staleness bound).** Since the last parameter sync at most
``(1 + staleness_threshold) x trigger_parameter_sync_step x require_batches x ppo_mini_batch_size``
groups may be admitted, counting those still in flight or queued at the sync; past it the rollouter
waits. With ``staleness_threshold=0`` and a sync every update, a step's groups are exactly the ones
generated with the weights of the step before (on-policy).

**Pause for a sync.** With ``partial_rollout`` every request in flight is aborted (each returns what it
generated, with its log-probs) and the groups wait to be resumed under the new weights, where they
stopped; without it the groups in flight finish first (drain). Then the serve loops stop, the weights
move (:mod:`.param_sync`), and :meth:`Rollouter.resume` starts serving again.

**Elastic replicas.** A replica whose process dies while serving is replaced (the manager's watcher,
:mod:`hybridflow.workers.rollout.agent_loop.elastic`): its requests go to the other replicas, the groups
go on, and ``rollout/replica_restarts`` / ``rollout/requests_rerouted`` count it in :meth:`metrics`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque

from hybridflow.protocol import DataProto
from hybridflow.trainer.fully_async.message_queue import GroupQueue, RolloutGroup, RolloutStopped
from hybridflow.trainer.ppo.rollouts import join_rollout, rollout_input
from hybridflow.workers.rollout.agent_loop.elastic import ReplicaRestartLimit


class Rollouter:
    """``manager``: an :class:`~hybridflow.workers.rollout.agent_loop.manager.AgentLoopManager` over the
    rollout pool; ``prompts``: an iterator of ``(one-prompt DataProto, epoch)`` in data order;
    ``max_groups``: the admission bound per parameter version."""

    def __init__(
        self, manager, prompts, queue: GroupQueue, n: int, max_groups: int, partial_rollout: bool
    ) -> None:
        self.manager, self.prompts, self.queue = manager, prompts, queue
        self.n, self.max_groups, self.partial_rollout = int(n), int(max_groups), bool(partial_rollout)
        self.version = 0
        self.admitted = 0  # groups admitted in all (the next group's seq)
        self.admitted_since_sync = 0  # verl's staleness_samples
        self.in_flight: dict[int, asyncio.Task] = {}
        self.to_resume: deque = (
            deque()
        )  # groups aborted mid-flight: (seq, rows, gen_input, preempted, outputs)
        self.paused = False
        self.stopping = False
        self.stats = {"generated": 0, "partial_samples": 0, "idle_s": 0.0, "window_start": time.monotonic()}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: list = []  # the serve loops' futures while serving
        self._serving_ended = threading.Event()  # set before a normal stop_serving (the watcher's cue)
        self._thread = threading.Thread(target=self._thread_main, name="rollouter", daemon=True)
        self._started = threading.Event()

    # ------------------------------------------------------------------ the trainer's side (other thread)
    def start(self, version: int, start_seq: int = 0) -> None:
        """Start serving and streaming; the first group gets number ``start_seq`` (a resumed run)."""
        self.version, self.admitted = int(version), int(start_seq)
        self._thread.start()
        self._started.wait()

    def pause(self) -> None:
        """Stop admitting, abort (partial rollout) or drain what is in flight, stop serving."""
        self._call(self._pause())

    def resume(self, version: int, synced: bool = True) -> None:
        """Serve again with the replicas' weights ``version``. After a parameter sync (``synced``) the
        staleness budget starts over (the groups still outstanding count against it); after a pause
        that moved no weights (validation) it goes on where it stood, so the groups admitted since the
        last sync still count."""
        self._call(self._resume(int(version), bool(synced)))

    def stop(self) -> None:
        """End streaming (the run is over or failed): abort what is in flight, stop serving. A
        rollouter whose thread is ending on its own (it failed) is only waited for: the error that
        ended the run is the one to report, not its closed event loop."""
        if self._loop is None or not self._thread.is_alive():
            return
        request = self._request_stop()
        try:
            asyncio.run_coroutine_threadsafe(request, self._loop)
        except RuntimeError:  # the loop closed since the check: the thread is ending
            request.close()
        self._thread.join(timeout=120)

    def _call(self, coroutine):
        """Run ``coroutine`` on the rollouter's loop and return its result. When the loop has ended
        (the rollouter failed: a replica died), raises :class:`RolloutStopped` with that failure."""
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("the rollouter is not running")
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        except RuntimeError:  # "Event loop is closed": the rollouter's thread has ended
            coroutine.close()
            raise self._ended() from None
        try:
            return future.result()
        except concurrent.futures.CancelledError:  # the loop ended before or while running it
            raise self._ended() from None

    def _ended(self) -> RolloutStopped:
        error = self.queue.error
        return RolloutStopped(str(error) if error is not None else "the rollouter's thread has ended")

    def metrics(self) -> dict[str, float]:
        """``fully_async/*`` counters of the rollouter (verl's names)."""
        window = max(time.monotonic() - self.stats["window_start"], 1e-9)
        return {
            "fully_async/count/total_generated_samples": float(self.stats["generated"]),
            "fully_async/count/staleness_samples": float(self.admitted_since_sync),
            "fully_async/count/current_param_version": float(self.version),
            "fully_async/count/queued_groups": float(self.queue.size()),
            "fully_async/count/in_flight_groups": float(len(self.in_flight)),
            "fully_async/partial/total_partial_num": float(self.stats["partial_samples"]),
            "fully_async/rollouter/idle_ratio": min(self.stats["idle_s"] / window, 1.0),
            "agent_loop/stuck_scorers": float(self.stats.get("stuck_scorers", 0)),
            **(self.manager.elastic_metrics() if hasattr(self.manager, "elastic_metrics") else {}),
        }

    # ------------------------------------------------------------------ the rollouter's thread
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # the trainer learns why at its next take
            self.queue.fail(RuntimeError(f"the rollouter failed: {type(error).__name__}: {error}"))
        finally:
            self._serving_ended.set()  # the serve-loop watcher ends with the rollouter

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._cond = asyncio.Condition()
        try:
            await self._start_serving()
        finally:
            self._started.set()
        exhausted = False
        while not self.stopping:
            async with self._cond:
                idle_from = time.monotonic()
                await self._cond.wait_for(self._can_admit)
                self.stats["idle_s"] += time.monotonic() - idle_from
            if self.stopping:
                break
            if self.to_resume:
                seq, rows, gen_input, preempted, outputs = self.to_resume.popleft()
                self._launch(seq, rows, gen_input, preempted, outputs)
                continue
            if exhausted:
                async with self._cond:
                    await self._cond.wait_for(lambda: self.stopping or bool(self.to_resume))
                continue
            try:
                prompt, epoch = next(self.prompts)
            except StopIteration:
                exhausted = True
                continue
            rows, gen_input = rollout_input(
                prompt, self.n, {"epoch": epoch, "global_steps": self.version}, True
            )
            seq = self.admitted
            self.admitted += 1
            self.admitted_since_sync += 1
            self._launch(seq, rows, gen_input, 0, None)
        if self._serving:  # stopping: what is in flight ends where it stands
            await asyncio.to_thread(self.manager.abort_all)
            await asyncio.gather(*list(self.in_flight.values()), return_exceptions=True)
            await self._stop_serving()

    async def _start_serving(self) -> None:
        """Wake the replicas and start their serve loops, watched: a loop that ends while serving (its
        rank died) fails its server, so the groups waiting on it raise naming the replica. The watcher
        itself is watched too (:meth:`_watcher_ended`): without it a replica's death would go unseen."""
        self._serving = (await asyncio.to_thread(self.manager.start_serving))[1]
        self._serving_ended = ended = threading.Event()
        self._watcher = asyncio.get_running_loop().run_in_executor(
            None, self.manager.watch_serving, self._serving, ended.is_set
        )
        self._watcher.add_done_callback(self._watcher_ended)

    def _watcher_ended(self, watcher: asyncio.Future) -> None:
        """The serve-loop watcher returned. Normally because serving ended; if it raised, nothing
        would notice a replica dying from now on (only ``generate_timeout_s`` later), so the run
        ends now: the queue fails with the watcher's error, naming the replicas it watched, and the
        servers fail, so that every sample waiting on them (and a pause draining them) returns."""
        if watcher.cancelled() or watcher.exception() is None:
            return
        error = watcher.exception()
        names = ", ".join(getattr(self.manager, "server_names", None) or ["the replicas"])
        reason = (
            f"the serve-loop watcher of {names} failed: {type(error).__name__}: {error}; a replica "
            "that died would go unnoticed, so the run stops"
        )
        if isinstance(error, ReplicaRestartLimit):  # replicas kept dying: the message says it all
            reason = str(error)
        self.queue.fail(RuntimeError(reason))
        self._loop.create_task(self._fail_servers(reason))

    async def _fail_servers(self, reason: str) -> None:
        try:
            await asyncio.to_thread(self.manager.fail_servers, reason)
        finally:
            await self._request_stop()

    async def _stop_serving(self) -> None:
        self._serving_ended.set()  # a serve loop returning from here on is the normal end
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:  # a replica restart it began is complete (the sync then sees the new one)
            await asyncio.wait({watcher})
        serving, self._serving = self._serving, []
        await asyncio.to_thread(self.manager.stop_serving, serving)

    def _can_admit(self) -> bool:
        if self.stopping:
            return True
        if self.paused:
            return False
        return bool(self.to_resume) or self.admitted_since_sync < self.max_groups

    def _launch(self, seq: int, rows: DataProto, gen_input: DataProto, preempted: int, outputs) -> None:
        task = asyncio.get_running_loop().create_task(
            self._run_group(seq, rows, gen_input, preempted, outputs)
        )
        self.in_flight[seq] = task

    async def _run_group(self, seq, rows, gen_input, preempted, outputs) -> None:
        """Generate one group (resuming its aborted samples when ``outputs`` is given) and queue it,
        or keep it for a resume when a pause aborted it."""
        try:
            call_input = gen_input.select()  # a copy: the group may be sent again after an abort
            call_input.meta_info = {**gen_input.meta_info, "partial_outputs": outputs or {}}
            output = await self.manager.generate_async(call_input, worker=seq)
            loop_outputs = output.meta_info.pop("loop_outputs", None)
            if loop_outputs is not None:  # aborted mid-flight: resume it under the next weights
                self.stats["partial_samples"] += sum(
                    bool(o.extra_fields.get("is_partial")) for o in loop_outputs
                )
                self.to_resume.append((seq, rows, gen_input, preempted + 1, dict(enumerate(loop_outputs))))
            else:
                self.stats["stuck_scorers"] = int(output.meta_info.get("stuck_scorers", 0))
                output.meta_info = {}  # per-call details (the samples' loop timings): the groups concatenate
                batch = join_rollout(rows.select(), output)
                versions = [list(v) for v in batch.non_tensor_batch.get("weight_versions", [[]] * len(batch))]
                group = RolloutGroup(
                    seq, batch, int(gen_input.meta_info["global_steps"]), versions, preempted
                )
                await asyncio.to_thread(self.queue.put, group)
                self.stats["generated"] += 1
        except BaseException as error:
            self.queue.fail(RuntimeError(f"rollout group {seq} failed: {type(error).__name__}: {error}"))
            raise
        finally:
            self.in_flight.pop(seq, None)
            async with self._cond:
                self._cond.notify_all()

    async def _pause(self) -> None:
        async with self._cond:
            self.paused = True
        if self.partial_rollout:
            await asyncio.to_thread(self.manager.abort_all)
        await asyncio.gather(*list(self.in_flight.values()), return_exceptions=True)
        await self._stop_serving()

    async def _resume(self, version: int, synced: bool) -> None:
        self.version = version
        await self._start_serving()
        async with self._cond:
            if synced:  # verl's reset, at a sync only: what is not yet trained counts against the budget
                self.admitted_since_sync = len(self.in_flight) + len(self.to_resume) + self.queue.size()
            self.paused = False
            self.stats["idle_s"], self.stats["window_start"] = 0.0, time.monotonic()
            self._cond.notify_all()

    async def _request_stop(self) -> None:
        async with self._cond:
            self.stopping = True
            self._cond.notify_all()
