"""verl's profiler in the worker processes: torch-profiler traces and CUDA memory snapshots of chosen steps.

The driver (:mod:`hybridflow.trainer.ppo.step_profiler`) reads verl's keys (``global_profiler`` and each
role's ``profiler`` section) and, around each step of ``global_profiler.steps``, calls the workers'
``start_profile`` / ``stop_profile`` with one :class:`RoleProfile` per enabled role. Each worker holds a
:class:`WorkerProfiler` that knows which roles live in it (``actor``, ``rollout``, ``ref``, ``critic``)
and its rank in the role's worker group; a role's profile selects ``all_ranks``, its ``ranks``, or rank 0.

Files (``{save_path}`` as the driver resolved it, absolute)::

    tool=torch                {save_path}/{role}/step{N}_prof_rank-{rank}.json.gz
      profile_continuous_steps  step{A}-{B}_prof_rank-{rank}.json.gz  (consecutive listed steps A..B)
      tool_config.torch.discrete  step{N}_{phase}_prof_rank-{rank}.json.gz  (a second call: {phase}-2, ...)
    tool=torch_memory (CUDA)  {save_path}/{role}/step{N}_memory_snapshot_rank-{rank}.pickle
    tool=nsys (CUDA)          Nsight Systems' reports, {save_path}/nsys/worker_process_{pid}*.nsys-rep

A torch trace is Chrome-trace JSON (gzipped): Perfetto (ui.perfetto.dev), chrome://tracing and
TensorBoard open it. A memory snapshot opens at pytorch.org/memory_viz.

Roles that share a process (the colocated default: actor, rollout, reference and critic in one process per
device) share its one torch profiler: the trace of a step (continuous mode) holds everything the process
ran in it, and is written once, then linked under every enabled role's directory. Phases are named with
``torch.profiler.record_function`` as the trainer names them in ``timing_s/*``: ``gen``,
``old_log_prob``, ``ref``, ``values``, ``update_actor``, ``update_critic`` (:func:`annotate`). In
discrete mode each call of an enabled role's phase gets a trace of its own, nothing between calls.

``tool=nsys``: the processes of the profiled roles' worker groups run under ``nsys profile`` (Ray's
nsight runtime_env plugin, with verl's ``worker_nsight_options``: :func:`nsight_options`), capturing
only between ``torch.cuda.profiler.start()`` and ``stop()`` (``capture-range=cudaProfilerApi``). A
session opens that range at its start and closes it at its finish (``discrete``: around each phase
call of an enabled role); phases are NVTX ranges with the same names. Nsight Systems writes the
reports itself, one per capture range, so no file is returned here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
import shutil
from dataclasses import dataclass

TOOLS = ("torch", "torch_memory", "nsys")
DISCRETE_TOOLS = ("torch", "nsys")  # the tools with a per-phase-call (``discrete``) mode
TORCH_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")
ROLES = ("actor", "rollout", "ref", "critic")
# the phases of the roles' calls (:func:`annotate`): a discrete capture opens one range per call
ROLE_PHASES = ("gen", "old_log_prob", "ref", "values", "update_actor", "update_critic")
# what Ray's nsight plugin can put unquoted into the shell command that starts a worker
SHELL_SAFE = re.compile(r"[\w@%+=:,./'-]*")


@dataclass(frozen=True)
class RoleProfile:
    """One role's profiler, resolved by the driver: what its ranks record at a profiled step.

    ``ranks`` None: every rank (``all_ranks``); ``save_path`` absolute; ``contents``: the torch
    profiler's (verl's ``tool_config.torch.contents``: empty = cpu, and cuda on CUDA)."""

    tool: str
    save_path: str
    ranks: tuple[int, ...] | None = (0,)
    contents: tuple[str, ...] = ()
    discrete: bool = False
    trace_alloc_max_entries: int = 100_000
    stack_depth: int = 32
    report: str = ""  # tool=nsys: where Nsight Systems writes this process's reports (printed)

    def selects(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def directory(self, role: str) -> str:
        return os.path.join(self.save_path, role)


def selected_ranks(all_ranks: bool, ranks) -> tuple[int, ...] | None:
    """verl's rank selection: every rank, the listed ranks, or rank 0 when none are listed."""
    if all_ranks:
        return None
    return tuple(int(r) for r in ranks) if ranks else (0,)


def nsight_options(options, save_path: str, steps, continuous: bool, discrete: bool) -> dict[str, str]:
    """verl's ``worker_nsight_options`` as Ray's nsight plugin gets them (``nsys profile --{key}={value}``,
    ``-{key} {value}`` for a one-letter key). ``o`` (the report) defaults to
    ``{save_path}/nsys/worker_process_%p``, absolute: Ray keeps an absolute ``o`` and puts a relative
    one under its session's ``logs/nsight/``. ``capture-range-end`` null becomes verl's
    ``repeat-shutdown:N``, N the capture ranges a worker process opens: one per profile (a listed step,
    or a run of consecutive ones with ``continuous``), or with ``discrete`` verl's ``len(steps) * 6``
    (one range per phase call, six phases). Other null options are left out."""
    options = dict(options or {})
    if options.get("o") is None and options.get("output") is None:
        options["o"] = os.path.join(save_path, "nsys", "worker_process_%p")
    if options.get("capture-range-end") is None:
        steps = sorted({int(s) for s in steps or ()})
        if discrete:
            ranges = len(steps) * len(ROLE_PHASES)  # verl: 6 * len(profile_steps)
        elif continuous:
            ranges = sum(1 for s in steps if s - 1 not in steps)
        else:
            ranges = len(steps)
        options["capture-range-end"] = f"repeat-shutdown:{max(ranges, 1)}"
    return {str(k): str(v) for k, v in options.items() if v is not None}


def nsight_reports(options: dict) -> str:
    """Where Nsight Systems writes the reports of a process started with ``options``."""
    out = str(options.get("o") or options.get("output"))
    where = out if os.path.isabs(out) else f"<Ray's session dir>/logs/nsight/{out}"
    return f"{where}*.nsys-rep (%p: the worker's process id)"


def torch_profiler(contents, device: str):
    """A ``torch.profiler.profile`` recording verl's ``contents`` (not started)."""
    import torch

    wanted = set(contents or ())
    activities = []
    if not wanted or "cpu" in wanted:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    if device == "cuda" and (not wanted or "cuda" in wanted):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        record_shapes="shapes" in wanted,
        profile_memory="memory" in wanted,
        with_stack="stack" in wanted,
    )


def truncate_stacks(snapshot: dict, depth: int) -> dict:
    """``snapshot`` (``torch.cuda.memory._snapshot()``) with at most ``depth`` frames per allocation."""
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if "frames" in block:
                block["frames"] = block["frames"][:depth]
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            if "frames" in entry:
                entry["frames"] = entry["frames"][:depth]
    return snapshot


def _write_everywhere(write, paths: list[str]) -> list[str]:
    """``write(paths[0])``, then the same file under the other paths (hard links where possible)."""
    os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
    write(paths[0])
    for path in paths[1:]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        try:
            os.link(paths[0], path)
        except OSError:
            shutil.copyfile(paths[0], path)
    for path in paths:
        print(f"hybridflow: profile written: {path}", flush=True)
    return paths


class _Session:
    """What one process records from the first role's ``start_profile`` to the last role's
    ``stop_profile`` (one profiler per process: colocated roles join the same session)."""

    def __init__(self, tool: str, step: int, rank: int, profile: RoleProfile, device: str) -> None:
        self.tool, self.first_step, self.rank, self.profile = tool, step, rank, profile
        self.members: set[int] = set()  # id() of the WorkerProfilers that joined and have not stopped
        self.directories: list[str] = []  # their enabled roles' directories: where the file goes
        self.prof = None
        self.device = device

    def join(self, owner: object, directories: list[str]) -> None:
        self.members.add(id(owner))
        self.directories += [d for d in directories if d not in self.directories]

    def start(self) -> None:
        if self.tool == "torch":
            self.prof = torch_profiler(self.profile.contents, self.device)  # the roles' (validated alike)
            self.prof.start()
        elif self.tool == "nsys":
            import torch

            torch.cuda.profiler.start()  # opens Nsight's capture range (capture-range=cudaProfilerApi)
        else:
            import torch

            torch.cuda.memory._record_memory_history(max_entries=self.profile.trace_alloc_max_entries)

    def finish(self, last_step: int) -> list[str]:
        """Stop recording and write the file under every member's directory."""
        directories = self.directories
        steps = f"{self.first_step}" if last_step == self.first_step else f"{self.first_step}-{last_step}"
        if self.tool == "torch":
            self.prof.stop()
            name = f"step{steps}_prof_rank-{self.rank}.json.gz"
            return _write_everywhere(
                self.prof.export_chrome_trace, [os.path.join(d, name) for d in directories]
            )
        import torch

        if self.tool == "nsys":
            torch.cuda.profiler.stop()
            _nsys_written(f"step{steps}", self.rank, self.profile)
            return []  # Nsight Systems writes the report

        torch.cuda.synchronize()
        snapshot = truncate_stacks(torch.cuda.memory._snapshot(), self.profile.stack_depth)
        torch.cuda.memory._record_memory_history(enabled=None)

        def write(path: str) -> None:
            with open(path, "wb") as f:
                pickle.dump(snapshot, f)

        name = f"step{steps}_memory_snapshot_rank-{self.rank}.pickle"
        return _write_everywhere(write, [os.path.join(d, name) for d in directories])


def _nsys_written(what: str, rank: int, profile: RoleProfile) -> None:
    print(
        f"hybridflow: nsys capture of {what} ended on rank {rank} (pid {os.getpid()}); Nsight Systems "
        f"writes the report: {profile.report or 'see worker_nsight_options.o'}",
        flush=True,
    )


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range named ``name`` (what Nsight Systems shows for a phase)."""
    import torch

    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def _named(name: str, tool: str):
    """The phase ``name`` marked as ``tool`` shows it: an NVTX range (nsys) or a record_function."""
    if tool == "nsys":
        return nvtx_range(name)
    import torch

    return torch.profiler.record_function(name)


_SESSION: _Session | None = None  # this process's open session (shared by its colocated roles)


class WorkerProfiler:
    """The profiler of one worker: the roles it holds, its rank in their worker group, its device."""

    def __init__(self, rank: int, roles: tuple[str, ...], device: str = "cpu") -> None:
        self.rank, self.roles, self.device = rank, tuple(roles), device
        self.step: int | None = None
        self.mine: dict[str, RoleProfile] = {}  # the roles of this worker profiled on this rank
        self.discrete = False
        self._calls: dict[str, int] = {}

    def start(self, step: int, profiles: dict[str, RoleProfile]) -> list[str]:
        """Begin profiling ``step`` for the roles of ``profiles`` this worker holds and whose ranks
        include this one; returns those roles."""
        global _SESSION
        self.step, self._calls = int(step), {}
        self.mine = {r: p for r, p in profiles.items() if r in self.roles and p.selects(self.rank)}
        if not self.mine:
            return []
        first = next(iter(self.mine.values()))
        self.discrete = first.tool in DISCRETE_TOOLS and first.discrete
        if self.discrete:  # each phase call records itself (phase())
            return list(self.mine)
        opening = _SESSION is None
        if opening:
            _SESSION = _Session(first.tool, self.step, self.rank, first, self.device)
        _SESSION.join(self, [p.directory(r) for r, p in self.mine.items()])
        if opening:
            _SESSION.start()
        return list(self.mine)

    def stop(self, step: int | None = None) -> list[str]:
        """End the profile begun by :meth:`start` (``step``: the last step it covers); returns the files
        written (by the last role of the process to stop)."""
        global _SESSION
        mine, self.mine, last = self.mine, {}, self.step
        self.step = None
        if mine and self.discrete:  # each phase call recorded itself
            first = next(iter(mine.values()))
            if first.tool == "nsys" and self._calls:
                _nsys_written(f"{sum(self._calls.values())} phase call(s) of step{last}", self.rank, first)
            return []
        if not mine or _SESSION is None:
            return []
        _SESSION.members.discard(id(self))
        if _SESSION.members:
            return []
        session, _SESSION = _SESSION, None
        return session.finish(int(step) if step is not None else session.first_step)

    @contextlib.contextmanager
    def phase(self, name: str, role: str | None):
        """Name ``name`` in the process's trace; in discrete mode, record it on its own (a file, or an
        Nsight capture range) when ``role`` is profiled on this rank."""
        import torch

        if _SESSION is not None:
            with _named(name, _SESSION.tool):
                yield
            return
        if not (self.discrete and role in self.mine):
            yield
            return
        self._calls[name] = self._calls.get(name, 0) + 1
        call = name if self._calls[name] == 1 else f"{name}-{self._calls[name]}"
        profile = self.mine[role]
        if profile.tool == "nsys":
            torch.cuda.profiler.start()
            try:
                with nvtx_range(name):
                    yield
            finally:
                torch.cuda.profiler.stop()
            return
        prof = torch_profiler(profile.contents, self.device)
        prof.start()
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            prof.stop()
            path = os.path.join(
                profile.directory(role), f"step{self.step}_{call}_prof_rank-{self.rank}.json.gz"
            )
            _write_everywhere(prof.export_chrome_trace, [path])


def annotate(phase: str, role: str | None = None):
    """Decorate a worker method: the call is the phase ``phase`` of ``role`` in profiles (the worker's
    ``profiler`` attribute, a :class:`WorkerProfiler`; nothing is recorded without one)."""

    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            profiler = getattr(self, "profiler", None)
            if profiler is None:
                return fn(self, *args, **kwargs)
            with profiler.phase(phase, role):
                return fn(self, *args, **kwargs)

        return wrapper

    return decorator
