"""The rollout trace in this process (``hybridflow.utils.rollout_trace``, the jsonl backend, the reader):
calls are recorded only inside a traced sample, with inputs, outputs, errors and order; writes happen on
the writer's thread while the loop goes on; ``max_samples_per_step_per_worker`` takes whole groups and
keeps its choice for a resumed group; a tool conversation aborted and resumed keeps every turn in the
trace; verl's import path is ours; the config refuses what cannot run here."""

import asyncio
import io
import json
import subprocess
import sys
import threading

import pytest

from hybridflow.trace import main as trace_main
from hybridflow.trace import show
from hybridflow.utils import rollout_trace_backends as backends
from hybridflow.utils.rollout_trace import (
    RolloutTraceConfig,
    record_event,
    rollout_trace_attr,
    rollout_trace_op,
)


@pytest.fixture
def trace(tmp_path):
    """Tracing on (jsonl into ``tmp_path``) for one test; the directory is returned."""
    RolloutTraceConfig.reset()
    RolloutTraceConfig.init("p", "e", "jsonl", directory=str(tmp_path))
    yield tmp_path
    RolloutTraceConfig.reset()


def _records(directory, step=1, validate=False):
    RolloutTraceConfig.flush()
    path = backends.step_file(directory, step, validate)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Service:
    @rollout_trace_op
    async def generate(self, request_id, *, prompt_ids, sampling_params=None):
        await asyncio.sleep(0)
        if request_id == "bad":
            raise RuntimeError("replica 0 is gone")
        return {"token_ids": [p + 1 for p in prompt_ids], "stop_reason": "completed"}

    @rollout_trace_op
    def lookup(self, key, **options):
        return f"{key}={options}"


def test_calls_are_recorded_inside_a_traced_sample_only(trace):
    service = Service()

    async def go():
        await service.generate("outside", prompt_ids=[1])  # no sample: not recorded
        with rollout_trace_attr(sample_index=7, step=1, rollout_n=1):
            out = await service.generate("r", prompt_ids=[1, 2], sampling_params={"t": 1.0})
            service.lookup("k", depth=2)
            with pytest.raises(RuntimeError, match="gone"):
                await service.generate("bad", prompt_ids=[3])
            record_event("reward", "worker.reward", output={"score": 1.0})
        with rollout_trace_attr(sample_index=8, step=1, rollout_n=0, trace=False):
            await service.generate("off", prompt_ids=[4])  # a sample left out of the trace
        return out

    assert asyncio.run(go()) == {"token_ids": [2, 3], "stop_reason": "completed"}  # results unchanged
    records = _records(trace)
    assert [(r["seq"], r["kind"], r["call"]) for r in records] == [
        (1, "generate", "Service.generate"),
        (2, "call", "Service.lookup"),
        (3, "generate", "Service.generate"),
        (4, "reward", "worker.reward"),
    ]
    first, lookup, failed, reward = records
    assert {k: first[k] for k in ("step", "sample_index", "rollout_n", "validate")} == {
        "step": 1,
        "sample_index": 7,
        "rollout_n": 1,
        "validate": False,
    }
    assert first["inputs"] == {"request_id": "r", "prompt_ids": [1, 2], "sampling_params": {"t": 1.0}}
    assert first["output"] == {"token_ids": [2, 3], "stop_reason": "completed"} and first["error"] is None
    assert lookup["inputs"] == {"key": "k", "depth": 2}  # **kwargs flattened
    assert failed["output"] is None and failed["error"] == "RuntimeError: replica 0 is gone"
    assert reward["output"] == {"score": 1.0}


def test_a_record_is_a_snapshot_of_the_call(trace):
    """The caller may change its lists after the call: the record keeps what the call saw."""

    class Growing:
        @rollout_trace_op
        async def generate(self, prompt_ids):
            return prompt_ids

    ids = [1, 2]

    async def go():
        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
            await Growing().generate(ids)
            ids.append(3)

    asyncio.run(go())
    assert _records(trace)[0]["inputs"] == {"prompt_ids": [1, 2]}


def test_writes_happen_on_the_writer_thread_while_the_loop_goes_on(tmp_path):
    """A backend write that blocks (a slow disk) holds neither the traced call nor the event loop."""
    release, writing_threads = threading.Event(), []

    class SlowDisk(backends.JsonlTraceBackend):
        def write(self, records):
            writing_threads.append(threading.current_thread().name)
            release.wait(30)
            super().write(records)

    RolloutTraceConfig.reset()
    RolloutTraceConfig.init("p", "e", None)
    config = RolloutTraceConfig.get_instance()
    config.backend, config.client = "jsonl", backends.TraceWriter(SlowDisk(str(tmp_path)))
    try:

        async def go():
            with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
                for i in range(5):
                    await asyncio.wait_for(Service().generate(f"r{i}", prompt_ids=[i]), timeout=5)

        asyncio.run(go())  # returns while the first write is still blocked
        assert not backends.step_file(tmp_path, 1).exists()
        release.set()
        assert RolloutTraceConfig.flush(30)
        assert len(_records(tmp_path)) == 5
        assert set(writing_threads) == {"rollout-trace-writer"}
    finally:
        release.set()
        RolloutTraceConfig.reset()


def test_max_samples_per_step_per_worker_takes_whole_groups():
    """verl's rule: N dataset prompts a step in a worker, each with all its rollout.n rows; a prompt
    seen before in the step (a resumed or later call) keeps its decision; a new step starts over."""
    RolloutTraceConfig.reset()
    RolloutTraceConfig.init("p", "e", None, max_samples_per_step_per_worker=2)
    config = RolloutTraceConfig.get_instance()
    index = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    rows = config.traced_rows(index, step=1)
    chosen = {index[r] for r in rows}
    assert len(chosen) == 2 and rows == {r for r, i in enumerate(index) if i in chosen}  # whole groups
    assert config.traced_rows([4, 4, 5, 5], step=1) == set()  # the step's budget is spent
    resumed = [i for i in index if i in chosen][:3]
    assert config.traced_rows(resumed, step=1) == {0, 1, 2}  # a resumed group is traced again
    assert len({index[r] for r in config.traced_rows(index, step=2)}) == 2
    assert config.traced_rows(index, step=1, validate=True) != set()  # validation has its own budget
    config.max_samples_per_step_per_worker = 0
    assert config.traced_rows(index, step=3) == set()
    config.max_samples_per_step_per_worker = None
    assert config.traced_rows(index, step=3) == set(range(len(index)))
    RolloutTraceConfig.reset()


def test_token2text_decodes_ids_on_the_writer_thread(tmp_path, tiny_model_dir):
    from hybridflow.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode("12+7=19", add_special_tokens=False)
    RolloutTraceConfig.reset()
    RolloutTraceConfig.init("p", "e", "jsonl", token2text=True, directory=str(tmp_path), tokenizer=tokenizer)
    try:

        async def go():
            with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
                await Service().generate("r", prompt_ids=ids)

        asyncio.run(go())
        (record,) = _records(tmp_path)
        assert record["inputs"]["prompt_text"] == tokenizer.decode(ids)
        assert record["output"]["text"] == tokenizer.decode([i + 1 for i in ids])
    finally:
        RolloutTraceConfig.reset()


# ---------------------------------------------------------------------- abort and resume
def test_an_aborted_and_resumed_tool_conversation_keeps_every_turn(trace, tiny_model_dir, monkeypatch):
    """``tool_agent`` cut mid-turn by an abort (partial rollout), then resumed from its partial output:
    the trace holds both runs of the loop, every generation (the cut one marked aborted), each tool call
    once, in order; the reader prints them turn by turn."""
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.workers.rollout.agent_loop import tool_agent
    from hybridflow.workers.rollout.agent_loop.tool_agent import ToolAgentLoop
    from tests.workers.rollout.test_agent_loops import (
        CountingAddTool,
        ScriptedServers,
        _config,
        _run,
        _turns,
    )

    class TracedServers(ScriptedServers):  # the scripted replica, traced as the server manager is
        generate = rollout_trace_op(ScriptedServers.generate)

    tokenizer = load_tokenizer(tiny_model_dir)
    tools = {"add": CountingAddTool()}
    monkeypatch.setattr(tool_agent, "_tools", lambda path: tools)
    servers = TracedServers(_turns(tokenizer), cut={2: 6})  # inside the second tool call

    def run(**fields):
        with rollout_trace_attr(sample_index=5, step=1, rollout_n=0):
            return _run(
                ToolAgentLoop, _config(), servers, tokenizer, raw_prompt_ids=[1], sample_id="s", **fields
            )

    partial = run()
    assert partial.extra_fields["is_partial"]
    final = run(partial_output=partial)
    assert not final.extra_fields["is_partial"] and tools["add"].executed == 2

    records = sorted(_records(trace), key=lambda r: (r["t_start"], r["seq"]))
    kinds = [(r["kind"], r["call"].rsplit(".", 1)[-1]) for r in records]
    assert kinds == [
        ("agent_loop", "run"),  # the first run: generate, tool, generate (cut)
        ("generate", "generate"),
        ("tool", "call"),
        ("generate", "generate"),
        ("agent_loop", "run"),  # the resumed run: the cut turn continued, the tool, the answer
        ("generate", "generate"),
        ("tool", "call"),
        ("generate", "generate"),
    ]
    generations = [r for r in records if r["kind"] == "generate"]
    assert [g["output"]["stop_reason"] for g in generations] == [
        "completed",
        "aborted",
        "completed",
        "completed",
    ]
    traced_tokens = [t for g in generations for t in g["output"]["token_ids"]]
    generated = [t for t, m in zip(final.response_ids, final.response_mask, strict=True) if m]
    assert traced_tokens == generated  # no generated token is missing from the trace
    tool_calls = [r for r in records if r["kind"] == "tool"]
    assert [c["inputs"]["call"]["arguments"] for c in tool_calls] == [{"a": 2, "b": 3}, {"a": 5, "b": 10}]
    assert [c["output"] for c in tool_calls] == [["5", True], ["15", True]]
    assert sorted(r["seq"] for r in records) == list(range(1, 9))  # the numbering went on after the resume

    out = io.StringIO()
    show(str(trace), 1, "5:0", False, False, out=out)
    text = out.getvalue()
    assert text.index("stopped: aborted") < text.index("resumed from its partial output")
    assert text.count("tool: ") == 2 and 'add({"a": 5, "b": 10})' in text


# ---------------------------------------------------------------------- the reader, the alias, the config
def test_the_reader_lists_steps_and_samples_and_names_what_is_missing(trace, capsys):
    async def go():
        for step in (1, 2):
            for index, n in ((3, 0), (3, 1)):
                with rollout_trace_attr(sample_index=index, step=step, rollout_n=n):
                    await Service().generate("r", prompt_ids=[1])
                    record_event("reward", "worker.reward", output={"score": 0.5 * n})

    asyncio.run(go())
    RolloutTraceConfig.flush()
    assert trace_main(["show", str(trace)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "step 1: 4 calls, 2 samples",
        "step 2: 4 calls, 2 samples",
    ]
    assert trace_main(["show", str(trace), "--step", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "sample 3:0  2 calls (generate x1, reward x1), reward 0.0",
        "sample 3:1  2 calls (generate x1, reward x1), reward 0.5",
    ]
    assert trace_main(["show", str(trace), "--step", "9"]) == 2
    assert "traced steps: 1, 2" in capsys.readouterr().err
    assert trace_main(["show", str(trace), "--step", "1", "--sample", "4"]) == 2
    assert "traced samples: 3:0, 3:1" in capsys.readouterr().err
    # the module runs as a program
    shown = subprocess.run(
        [sys.executable, "-m", "hybridflow.trace", "show", str(trace), "--step", "1", "--sample", "3:1"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "sample 3:1" in shown.stdout and "reward" in shown.stdout


def test_verl_import_path_is_ours():
    from hybridflow import verl_compat
    from hybridflow.utils import rollout_trace

    verl_compat.install()
    try:
        from verl.utils.rollout_trace import RolloutTraceConfig as VerlConfig
        from verl.utils.rollout_trace import rollout_trace_attr as verl_attr
        from verl.utils.rollout_trace import rollout_trace_op as verl_op

        assert (verl_op, verl_attr, VerlConfig) == (
            rollout_trace.rollout_trace_op,
            rollout_trace.rollout_trace_attr,
            rollout_trace.RolloutTraceConfig,
        )
    finally:
        verl_compat.uninstall()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor_rollout_ref.rollout.trace.backend=weave"], "weave logs to the Weights & Biases service"),
        (["actor_rollout_ref.rollout.trace.backend=mlflow"], "MLFLOW_ALLOW_FILE_STORE"),
        (["actor_rollout_ref.rollout.trace.backend=csv"], "'csv' is unknown; use one of jsonl, tensorboard"),
        (["actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=-1"], "integer >= 0 or null"),
        (
            ["actor_rollout_ref.rollout.trace.backend=jsonl", "actor_rollout_ref.rollout.mode=sync"],
            "mode=async",
        ),
    ],
)
def test_the_config_refuses_what_cannot_run_here(overrides, message):
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.config.honesty import honesty_problems

    if "mode=sync" not in overrides[-1]:
        overrides = [*overrides, "actor_rollout_ref.rollout.mode=async"]
    assert any(message in line for line in honesty_problems(load_config(overrides)))
    assert not any(
        "trace" in line
        for line in honesty_problems(
            load_config(
                ["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.trace.backend=jsonl"]
            )
        )
    )


def test_the_tensorboard_backend_writes_one_text_summary_per_call(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    RolloutTraceConfig.reset()
    RolloutTraceConfig.init("p", "e", "tensorboard", directory=str(tmp_path))
    try:

        async def go():
            with rollout_trace_attr(sample_index=4, step=3, rollout_n=1):
                await Service().generate("r", prompt_ids=[1, 2])
                Service().lookup("k")

        asyncio.run(go())
    finally:
        RolloutTraceConfig.reset()  # closes the writer
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("rollout_trace/sample_4_1/text_summary")
    assert [t.step for t in texts] == [3, 3]
    shown = [t.tensor_proto.string_val[0].decode() for t in texts]
    assert "Service.generate" in shown[0] and '"token_ids": [\n   2,\n   3\n  ]' in shown[0]
    assert "Service.lookup" in shown[1]
