"""A traced 2-step tool rollout end to end (``rollout.mode=async``, ``rollout.trace.backend=jsonl``), read
back turn by turn with ``python -m hybridflow.trace``. The agent loop is written for verl and traced with
verl's ``rollout_trace_op`` (``verl_traced_tool_loop.py``): through the verl alias it runs unchanged, in
the driver and in the agent-loop workers, and its calls are in the trace next to ours."""

import json
import subprocess
import sys
from collections import defaultdict

import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from tests.tiny_run import as_overrides, tiny_run_values
from tests.trainer.ppo.test_agent_loop_e2e import _with_agent_name

TARGET = "tests.trace.verl_traced_tool_loop.TracedToolAgentLoop"


@pytest.mark.slow  # make test-slow (~40-60 s, a whole run); tests/trace/test_rollout_trace.py stays fast
def test_a_traced_two_step_tool_rollout_reads_back_turn_by_turn(
    ray_session, tiny_model_dir, arithmetic_data, tmp_path
):
    from hybridflow import verl_compat

    (tmp_path / "loops.yaml").write_text(f"- name: traced_tool_agent\n  _target_: {TARGET}\n")
    values = tiny_run_values(
        tiny_model_dir,
        _with_agent_name(arithmetic_data, tmp_path, "traced_tool_agent"),
        tmp_path / "ckpt",
        **{
            "trainer.experiment_name": "traced",
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 2,
            "data.max_response_length": 48,
            "actor_rollout_ref.rollout.mode": "async",
            "actor_rollout_ref.rollout.agent.num_workers": 2,
            "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(tmp_path / "loops.yaml"),
            "actor_rollout_ref.rollout.trace.backend": "jsonl",
            "actor_rollout_ref.rollout.trace.token2text": True,
            "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker": 1,
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    verl_compat.install()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(tmp_path)
            run_ppo(config)
    finally:
        verl_compat.uninstall()
    run_dir = tmp_path / "outputs" / "hybridflow" / "traced"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]

    for step in (1, 2):
        records = [
            json.loads(line)
            for line in (run_dir / "rollout_trace" / f"step_{step}.jsonl").read_text().splitlines()
        ]
        samples = defaultdict(list)
        for record in records:
            assert record["step"] == step and record["validate"] is False
            samples[(record["sample_index"], record["rollout_n"])].append(record)
        # one prompt per agent-loop worker (2 workers), with both of its rollout.n=2 samples
        prompts = {index for index, _ in samples}
        assert len(prompts) == 2 and set(samples) == {(i, n) for i in prompts for n in (0, 1)}
        for key, calls in samples.items():
            calls.sort(key=lambda r: (r["t_start"], r["seq"]))
            assert [c["kind"] for c in calls] == ["agent_loop", "generate", "tool", "generate", "reward"], key
            assert [c["call"] for c in calls[:4]] == [
                "TracedToolAgentLoop.run",
                "AsyncLLMServerManager.generate",
                "CheckTool.execute",
                "AsyncLLMServerManager.generate",
            ]
            run, first, tool, second, reward = calls
            assert first["inputs"]["prompt_text"] and isinstance(first["output"]["text"], str)  # token2text
            assert (
                tool["inputs"]["parameters"]["answer"] in tool["output"][0] and "Check." in tool["output"][0]
            )
            # the second turn's prompt: the first's, the first answer, the tool's turn
            prompt, answer = first["inputs"]["prompt_ids"], first["output"]["token_ids"]
            assert second["inputs"]["prompt_ids"][: len(prompt) + len(answer)] == prompt + answer
            assert run["output"]["response_ids"][: len(answer)] == answer
            assert reward["output"]["score"] in (0.0, 1.0)

    index = sorted(prompts)[0]
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.trace",
            "show",
            str(run_dir),
            "--step",
            "2",
            "--sample",
            f"{index}:1",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = shown.splitlines()
    assert lines[0].startswith(f"=== step 2, sample {index}:1  5 calls")
    order = [
        next(i for i, line in enumerate(lines) if i and marker in line)  # after the summary line
        for marker in ("user:", "assistant:", "tool:", "] reward")
    ]
    assert order == sorted(order)
    assert sum("assistant:" in line for line in lines) == 2
    print(shown)  # what a user sees (pytest -s)
