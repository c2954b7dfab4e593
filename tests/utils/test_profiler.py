"""verl's profiler in a worker process (hybridflow/utils/profiler.py), without Ray: which roles and ranks
record, where the files go, what they are named, and that the phases are named in the traces. The nsys
tool's CUDA entry points (torch.cuda.profiler.start/stop, NVTX ranges) are recorded, not run: there is
no GPU here."""

import gzip
import json

import pytest
import torch

from hybridflow.utils.profiler import (
    RoleProfile,
    WorkerProfiler,
    annotate,
    nsight_options,
    nsight_reports,
    selected_ranks,
    torch_profiler,
    truncate_stacks,
)


@pytest.fixture(autouse=True)
def no_session_left_open():
    """Each test closes the profile it opens (a session left open would leak into the next test)."""
    import hybridflow.utils.profiler as profiler

    yield
    session, profiler._SESSION = profiler._SESSION, None
    if session is not None and session.prof is not None:
        session.prof.stop()
    assert session is None, "a profile was left open"


class FakeWorker:
    """A worker with the phases of two roles (as the hybrid actor worker and the critic worker)."""

    def __init__(self, roles, rank=0):
        self.profiler = WorkerProfiler(rank, roles)

    @annotate("update_actor", role="actor")
    def update_actor(self):
        return (torch.ones(8, 8) @ torch.ones(8, 8)).sum()

    @annotate("gen", role="rollout")
    def generate(self):
        return torch.ones(4).cumsum(0)

    @annotate("values", role="critic")
    def values(self):
        return torch.ones(4).sum()


def _names(path) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {event.get("name") for event in json.load(f)["traceEvents"]}


def _files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_rank_selection_follows_verl():
    assert selected_ranks(True, [1]) is None  # all_ranks wins
    assert selected_ranks(False, [1, 3]) == (1, 3)
    assert selected_ranks(False, []) == (0,)  # enabled without ranks: rank 0
    assert RoleProfile("torch", "/p", ranks=None).selects(7)
    assert not RoleProfile("torch", "/p", ranks=(0,)).selects(1)


def test_colocated_roles_share_one_trace_written_under_each_role(tmp_path):
    actor, critic = FakeWorker(("actor", "rollout")), FakeWorker(("critic",))
    profiles = {
        "actor": RoleProfile("torch", str(tmp_path)),
        "critic": RoleProfile("torch", str(tmp_path), ranks=None),
    }
    assert actor.profiler.start(2, profiles) == ["actor"]
    assert critic.profiler.start(2, profiles) == ["critic"]
    actor.generate(), actor.update_actor(), critic.values()
    assert actor.profiler.stop(2) == []  # the critic still records in this process
    written = critic.profiler.stop(2)
    assert _files(tmp_path) == ["actor/step2_prof_rank-0.json.gz", "critic/step2_prof_rank-0.json.gz"]
    assert len(written) == 2
    assert (tmp_path / "actor/step2_prof_rank-0.json.gz").samefile(
        tmp_path / "critic/step2_prof_rank-0.json.gz"
    )
    assert {"gen", "update_actor", "values"} <= _names(tmp_path / "critic/step2_prof_rank-0.json.gz")
    actor.update_actor()  # after the profile: nothing recorded, nothing written
    assert len(_files(tmp_path)) == 2


def test_unselected_rank_records_nothing(tmp_path):
    worker = FakeWorker(("actor",), rank=1)
    assert worker.profiler.start(1, {"actor": RoleProfile("torch", str(tmp_path))}) == []  # rank 0 only
    worker.update_actor()
    assert worker.profiler.stop(1) == []
    assert _files(tmp_path) == []


def test_continuous_steps_name_the_range(tmp_path):
    worker = FakeWorker(("actor",), rank=3)
    worker.profiler.start(4, {"actor": RoleProfile("torch", str(tmp_path), ranks=(3,))})
    worker.update_actor()
    worker.update_actor()
    worker.profiler.stop(5)
    assert _files(tmp_path) == ["actor/step4-5_prof_rank-3.json.gz"]


def test_discrete_mode_writes_one_trace_per_phase_call_of_enabled_roles(tmp_path):
    worker = FakeWorker(("actor", "rollout"))
    worker.profiler.start(1, {"actor": RoleProfile("torch", str(tmp_path), discrete=True)})
    worker.update_actor()
    worker.generate()  # the rollout is not enabled: not recorded
    worker.update_actor()
    assert worker.profiler.stop(1) == []
    assert _files(tmp_path) == [
        "actor/step1_update_actor-2_prof_rank-0.json.gz",
        "actor/step1_update_actor_prof_rank-0.json.gz",
    ]
    assert "update_actor" in _names(tmp_path / "actor/step1_update_actor_prof_rank-0.json.gz")


def test_annotate_without_a_profiler_just_calls():
    class Plain:
        @annotate("gen")
        def run(self, x):
            return x + 1

    assert Plain().run(1) == 2


def test_contents_pick_the_torch_profiler_options():
    prof = torch_profiler(["cpu", "memory", "shapes"], device="cpu")
    assert prof.activities == {torch.profiler.ProfilerActivity.CPU}  # no CUDA activity on the CPU
    assert prof.profile_memory and prof.record_shapes and not prof.with_stack


@pytest.mark.parametrize("depth", [1, 2])
def test_memory_snapshot_stacks_are_cut_to_stack_depth(depth):
    frames = [{"name": f"f{i}"} for i in range(5)]
    snapshot = {
        "segments": [{"blocks": [{"size": 8, "frames": list(frames)}]}],
        "device_traces": [[{"action": "alloc", "frames": list(frames)}]],
    }
    cut = truncate_stacks(snapshot, depth)
    assert cut["segments"][0]["blocks"][0]["frames"] == frames[:depth]
    assert cut["device_traces"][0][0]["frames"] == frames[:depth]


@pytest.fixture()
def cuda_calls(monkeypatch):
    """torch.cuda.profiler.start/stop and the NVTX range calls, recorded instead of run (no CUDA here)."""
    calls: list = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    return calls


def test_nsys_opens_one_capture_range_per_profile_with_the_phases_named(tmp_path, cuda_calls, capsys):
    actor, critic = FakeWorker(("actor", "rollout")), FakeWorker(("critic",))
    profile = RoleProfile("nsys", str(tmp_path), report="/r/worker_process_%p*.nsys-rep")
    profiles = {"actor": profile, "critic": profile}
    actor.profiler.start(3, profiles), critic.profiler.start(3, profiles)  # colocated: one range
    actor.generate(), actor.update_actor(), critic.values()
    assert actor.profiler.stop(3) == [] and critic.profiler.stop(3) == []  # nsys writes the report
    assert cuda_calls == [
        "start",
        "push gen",
        "pop",
        "push update_actor",
        "pop",
        "push values",
        "pop",
        "stop",
    ]
    assert _files(tmp_path) == []
    assert "nsys capture of step3 ended on rank 0" in capsys.readouterr().out
    actor.update_actor()  # after the profile: nothing
    assert len(cuda_calls) == 8


def test_nsys_discrete_opens_a_capture_range_per_phase_call_of_enabled_roles(tmp_path, cuda_calls, capsys):
    worker = FakeWorker(("actor", "rollout"))
    worker.profiler.start(1, {"actor": RoleProfile("nsys", str(tmp_path), discrete=True, report="/r")})
    worker.update_actor()
    worker.generate()  # the rollout is not enabled: not captured
    worker.update_actor()
    assert worker.profiler.stop(1) == []
    assert cuda_calls == ["start", "push update_actor", "pop", "stop"] * 2
    assert "nsys capture of 2 phase call(s) of step1 ended on rank 0" in capsys.readouterr().out


def test_nsight_options_complete_verls_worker_options():
    verls = {"trace": "cuda", "capture-range-end": None, "x": None}  # null: computed, or left out
    options = nsight_options(verls, "/p", [5, 1], continuous=False, discrete=False)
    assert options == {
        "trace": "cuda",
        "o": "/p/nsys/worker_process_%p",
        "capture-range-end": "repeat-shutdown:2",
    }
    assert nsight_reports(options).startswith("/p/nsys/worker_process_%p*.nsys-rep")
    assert nsight_reports({"o": "w_%p"}).startswith("<Ray's session dir>/logs/nsight/w_%p")
