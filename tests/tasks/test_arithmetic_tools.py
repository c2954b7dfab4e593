"""The built-in tool task: rows in verl's schema with tools_kwargs, and a scripted conversation
through the real engine and the real sandboxed Python tool earns the full reward."""

import asyncio

import pyarrow.parquet as pq
import torch

from hybridflow.tasks.arithmetic_tools import TOOL_NAME, task_config, write_tool_task
from hybridflow.utils.reward_score.arithmetic import compute_score
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.multi_turn import MultiTurnLimits, ToolAgentLoop
from hybridflow.workers.rollout.tools.parser import get_tool_call_parser
from hybridflow.workers.rollout.tools.registry import load_tools
from tests.workers.rollout.test_multi_turn import EOS, Script


def test_rows_carry_the_tool_instructions_and_kwargs(tmp_path):
    train, test, tools = write_tool_task(tmp_path, task_config(num_train=20, num_test=5))
    rows = pq.read_table(train).to_pylist()
    assert len(rows) == 20 and len(pq.read_table(test).to_pylist()) == 5
    row = rows[0]
    a, b = (int(x) for x in row["prompt"][1]["content"].removeprefix("What is ").rstrip("?").split(" * "))
    assert int(row["reward_model"]["ground_truth"]) == a * b and a >= 10_000
    assert TOOL_NAME in row["prompt"][0]["content"] and row["extra_info"]["need_tools_kwargs"]
    assert TOOL_NAME in load_tools(str(tools))


def test_a_scripted_model_solves_a_problem_with_the_python_tool(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer

    _, _, tools_path = write_tool_task(tmp_path, task_config(num_train=4, num_test=2))
    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = LLMEngine(EngineModel.from_hf_module(model, 1024), 4, 1024, eos_token_ids=[EOS])
    limits = MultiTurnLimits(response_length=600)
    loop = ToolAgentLoop(
        engine, tokenizer, load_tools(str(tools_path)), get_tool_call_parser(), limits, [EOS]
    )
    a, b = 48213, 9172
    call = f'<tool_call>{{"name": "{TOOL_NAME}", "arguments": {{"code": "print({a} * {b})"}}}}</tool_call>'
    script = Script(tokenizer, [call, str(a * b)])
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} * {b}?"}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    conv = asyncio.run(loop.run(prompt, SamplingParams(logits_processor=script)))
    tool_text = tokenizer.decode([t for t, m in zip(conv.response_ids, conv.response_mask) if not m])
    assert str(a * b) in tool_text  # the sandbox really ran the code
    response = tokenizer.decode(conv.response_ids, skip_special_tokens=True)
    assert compute_score("hybridflow/arithmetic", response, str(a * b)) == 1.0
    assert conv.tool_calls == 1 and conv.tool_failures == 0 and torch.tensor(conv.response_mask).sum() > 0
