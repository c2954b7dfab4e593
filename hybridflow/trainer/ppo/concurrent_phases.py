"""Phases of a step that do not read each other's output, issued together (HybridFlow §4: models on
different devices run their stages at the same time).

After generation, the old policy's log-probs, the reference log-probs, the critic's values and the
reward model's scores all read only the rollout; after the advantages, the critic update and the
actor update read the same batch and nothing of each other. :func:`run_phases` submits every phase's
worker-group call without waiting, runs the driver's own work (the rule reward) meanwhile, then waits
for all of them.

Phases on one resource pool share its worker processes, which run calls one at a time in the order
they were submitted, so colocated phases still run one after the other (with the same results); phases
on different pools overlap. Each phase keeps its own ``timing_s/<phase>``: from when its pool started
it (its submission, or the end of the previous phase on the same pool) to when the driver saw its
result (a phase that finished while the driver was still submitting the next ones is seen late, and
the phase after it on the same pool is charged only from then on).
``timing_s/overlap_saved`` is the wall time the overlap saved: the phases' times summed, minus the
wall time of the whole group (0 when everything shares one pool).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DRIVER_LANE = "driver"


@dataclass
class Phase:
    """One phase: ``issue()`` submits a worker-group call and returns its future (``wg.<method>_async``);
    ``finish(output)`` turns the call's output into the phase's result. A driver phase has ``run``
    instead: plain work on the driver, done while the worker phases are in flight."""

    name: str
    issue: Callable[[], Any] | None = None
    finish: Callable[[Any], Any] = lambda output: output
    run: Callable[[], Any] | None = None


def _lane(future) -> str:
    """Which worker processes run the call: calls on one lane run one after the other."""
    pool = getattr(future.group, "resource_pool", None)
    return getattr(pool, "name_prefix", None) or str(id(future.group))


def run_phases(phases: list[Phase], timing: dict[str, float], concurrent: bool = True) -> list:
    """Every phase's result, in order; ``timing[<name>]`` per phase, ``timing["overlap_saved"]``.

    ``concurrent=False`` runs them one by one (issue, wait, next), as a plain sequential step."""
    if not concurrent:
        return [_run_one(phase, timing) for phase in phases]
    start = time.perf_counter()
    worker = [p for p in phases if p.run is None]
    futures, issued = [], []
    for phase in worker:
        futures.append(phase.issue())
        issued.append(time.perf_counter())
    results: dict[str, Any] = {}
    spans: dict[str, float] = {}
    for phase in phases:  # the driver's own work overlaps the workers'
        if phase.run is not None:
            t0 = time.perf_counter()
            results[phase.name] = phase.run()
            spans[phase.name] = time.perf_counter() - t0
    ready = [0.0] * len(futures)
    outputs = _wait(futures, on_ready=lambda i: ready.__setitem__(i, time.perf_counter()))
    lane_free: dict[str, float] = {}
    for i, phase in enumerate(worker):  # submission order = execution order on a lane
        lane = _lane(futures[i])
        began = max(issued[i], lane_free.get(lane, 0.0))
        spans[phase.name] = max(ready[i] - began, 0.0)
        lane_free[lane] = max(began, ready[i])  # results seen out of order still ran in order
        results[phase.name] = phase.finish(outputs[i])
    wall = time.perf_counter() - start
    for name, seconds in spans.items():
        timing[name] = timing.get(name, 0.0) + seconds
    timing["overlap_saved"] = timing.get("overlap_saved", 0.0) + max(sum(spans.values()) - wall, 0.0)
    return [results[phase.name] for phase in phases]


def _wait(futures: list, on_ready) -> list:
    """Every future's result; Ray groups' calls waited on together (the first failure raised at once)."""
    from hybridflow.single_controller.ray import RayWorkerGroup, wait_futures

    if all(isinstance(f.group, RayWorkerGroup) for f in futures):
        return wait_futures(futures, on_ready)
    results = []
    for i, future in enumerate(futures):  # another backend (e.g. an in-process test group): in order
        results.append(future.get())
        on_ready(i)
    return results


def _run_one(phase: Phase, timing: dict[str, float]):
    t0 = time.perf_counter()
    result = phase.run() if phase.run is not None else phase.finish(phase.issue().get())
    timing[phase.name] = timing.get(phase.name, 0.0) + time.perf_counter() - t0
    return result
