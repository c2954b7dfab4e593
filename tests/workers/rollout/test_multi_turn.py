"""Multi-turn tool rollouts through the real engine, with the model's turns scripted by a logits
processor (a real tiny model whose outputs are forced token by token)."""

import asyncio
import threading

import pytest
import torch

from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.multi_turn import MultiTurnLimits, ToolAgentLoop, truncate_text
from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema
from hybridflow.workers.rollout.tools.parser import get_tool_call_parser
from hybridflow.workers.rollout.tools.python_tool import PythonTool

EOS = 2  # <|im_end|>


class AddTool(BaseTool):
    def __init__(self):
        super().__init__({}, ToolSchema("add", "a + b", {"type": "object", "required": ["a", "b"]}))
        self.created, self.released = [], []

    async def create(self, instance_id=None, **kwargs):
        instance = await super().create(instance_id)
        self.created.append(instance)
        return instance

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0.01)  # a tool that takes time: other conversations keep generating
        return str(int(parameters["a"]) + int(parameters["b"])), 0.5, {}

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


class BrokenTool(BaseTool):
    def __init__(self):
        super().__init__({}, ToolSchema("broken"))

    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("disk on fire")


class EchoTool(BaseTool):
    """Answers with the model's own string, so whatever the model wrote reaches the tool turn."""

    def __init__(self):
        super().__init__({}, ToolSchema("echo", "echo text", {"type": "object", "required": ["text"]}))

    async def execute(self, instance_id, parameters, **kwargs):
        return str(parameters["text"]), 0.0, {}


class RefusingTool(BaseTool):
    """Returns normally but reports an error in its metrics: the call must count as failed."""

    def __init__(self):
        super().__init__({}, ToolSchema("refuse"))

    async def execute(self, instance_id, parameters, **kwargs):
        return "cannot do that", 0.0, {"error": "refused"}


class Script:
    """Forces the model to write ``turns[k]`` then EOS on its k-th turn."""

    def __init__(self, tokenizer, turns: list[str]):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) + [EOS] for t in turns]
        self.turn = 0

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        script = self.turns[min(self.turn, len(self.turns) - 1)]
        position = len(generated)
        token = script[position] if position < len(script) else EOS
        if position == len(script) - 1:
            self.turn += 1
        forced = torch.full_like(logits, float("-inf"))
        forced[token] = 0.0
        return forced


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return tokenizer, EngineModel.from_hf_module(model, 1024)


def _loop(setup, tools, **limits):
    tokenizer, engine_model = setup
    engine = LLMEngine(engine_model, 8, 1024, eos_token_ids=[EOS])
    limits = MultiTurnLimits(**{"response_length": 200, "max_parallel_calls": 2, **limits})
    loop = ToolAgentLoop(
        engine, tokenizer, {t.name: t for t in tools}, get_tool_call_parser("hermes"), limits, [EOS]
    )
    return tokenizer, loop


def _prompt(tokenizer, text="What is 2 + 3 + 10?"):
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(rendered, add_special_tokens=False)


def _call(a, b, name="add"):
    return f'<tool_call>{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def test_two_tool_calls_then_an_answer_and_the_mask_marks_exactly_the_generated_tokens(setup):
    add = AddTool()
    tokenizer, loop = _loop(setup, [add])
    turns = [_call(2, 3), _call(5, 10), "The answer is 15"]
    params = SamplingParams(logits_processor=Script(tokenizer, turns))
    conv = asyncio.run(loop.run(_prompt(tokenizer), params))

    generated = [tokenizer.encode(t, add_special_tokens=False) + [EOS] for t in turns]
    tool_5, tool_15 = loop.renderer.tool_turn_ids(["5"]), loop.renderer.tool_turn_ids(["15"])
    assert conv.response_ids == generated[0] + tool_5 + generated[1] + tool_15 + generated[2]
    expected_mask = [1] * len(generated[0]) + [0] * len(tool_5) + [1] * len(generated[1])
    expected_mask += [0] * len(tool_15) + [1] * len(generated[2])
    assert conv.response_mask == expected_mask
    assert all(lp == 0.0 for lp in conv.log_probs)  # forced tokens have probability 1
    assert "5" in tokenizer.decode(tool_5) and "tool" in tokenizer.decode(tool_5)
    assert (conv.assistant_turns, conv.user_turns, conv.tool_calls, conv.tool_failures) == (3, 2, 2, 0)
    assert conv.finish_reason == "stop" and conv.state.value == "completed"
    assert conv.tool_reward == pytest.approx(1.0)  # two step rewards of 0.5
    assert add.created == add.released and len(add.created) == 1  # one instance per sample, released


def test_malformed_json_unknown_tool_and_a_raising_tool_become_error_turns(setup):
    tokenizer, loop = _loop(setup, [AddTool(), BrokenTool()], response_length=900)
    turns = [
        '<tool_call>{"name": "add", "arguments": {bad</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "broken", "arguments": {}}</tool_call>',
        _call(1, 1).replace(', "b": 1', ""),  # missing a required argument
        "I give up",
    ]
    conv = asyncio.run(
        loop.run(_prompt(tokenizer), SamplingParams(logits_processor=Script(tokenizer, turns)))
    )
    tool_turns = tokenizer.decode([t for t, m in zip(conv.response_ids, conv.response_mask) if m == 0])
    assert "not valid JSON" in tool_turns
    assert "unknown tool 'nope'" in tool_turns
    assert "RuntimeError: disk on fire" in tool_turns
    assert "missing required argument(s): b" in tool_turns
    assert conv.tool_failures == 4 and conv.assistant_turns == 5 and conv.finish_reason == "stop"


def test_odd_strings_from_the_model_become_error_turns_never_a_crash(setup):
    tools = [EchoTool(), RefusingTool(), PythonTool()]
    tokenizer, loop = _loop(setup, tools, response_length=900, max_tool_response_length=120)
    turns = [  # the model writes JSON escapes; json.loads turns them into lone surrogates and NUL
        r'<tool_call>{"name": "\udc80", "arguments": {}}</tool_call>',
        r'<tool_call>{"name": "\u0000../../etc/passwd", "arguments": {}}</tool_call>',
        r'<tool_call>{"name": "echo", "arguments": {"text": "a\ud800b\u0000c"}}</tool_call>',
        r'<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(\"\udc80\")"}}</tool_call>',
        '<tool_call>{"name": "refuse"}</tool_call>',
        "I give up",
    ]
    conv = asyncio.run(
        loop.run(_prompt(tokenizer), SamplingParams(logits_processor=Script(tokenizer, turns)))
    )
    assert conv.finish_reason == "stop" and conv.assistant_turns == 6 and conv.user_turns == 5
    tool_turns = tokenizer.decode([t for t, m in zip(conv.response_ids, conv.response_mask) if m == 0])
    assert r"unknown tool '\udc80'" in tool_turns
    assert r"unknown tool '\x00../../etc/passwd'" in tool_turns
    assert "a\\ud800b\x00c" in tool_turns  # the echo succeeded; its surrogate went in escaped
    assert "is not valid Unicode (a lone surrogate at character 7)" in tool_turns
    assert "cannot do that" in tool_turns
    # unknown, unknown, bad code, refused: failures; only the echo succeeded
    assert (conv.tool_calls, conv.tool_failures) == (5, 4)


def test_long_messages_are_parsed_off_the_event_loop(setup, monkeypatch):
    from hybridflow.workers.rollout import multi_turn
    from hybridflow.workers.rollout.tools.parser import HermesParser

    class RecordingParser(HermesParser):
        threads = []

        def parse(self, text):
            self.threads.append(threading.current_thread())
            return super().parse(text)

    monkeypatch.setattr(multi_turn, "PARSE_IN_THREAD_CHARS", 0)  # every message counts as long
    tokenizer, loop = _loop(setup, [AddTool()])
    loop.parser = RecordingParser()
    script = Script(tokenizer, [_call(2, 3), "The answer is 5"])
    conv = asyncio.run(loop.run(_prompt(tokenizer), SamplingParams(logits_processor=script)))
    assert (conv.tool_calls, conv.tool_failures, conv.finish_reason) == (1, 0, "stop")
    assert len(RecordingParser.threads) == 2
    assert all(thread is not threading.main_thread() for thread in RecordingParser.threads)


def test_turn_and_length_limits(setup):
    tokenizer, loop = _loop(setup, [AddTool()], max_assistant_turns=2)
    script = Script(tokenizer, [_call(1, 2), _call(3, 4), _call(5, 6), "done"])
    conv = asyncio.run(loop.run(_prompt(tokenizer), SamplingParams(logits_processor=script)))
    assert conv.assistant_turns == 2 and conv.finish_reason == "max_assistant_turns"

    tokenizer, loop = _loop(setup, [AddTool()], response_length=30)
    script = Script(tokenizer, [_call(1, 2), _call(3, 4), "done"])
    conv = asyncio.run(loop.run(_prompt(tokenizer), SamplingParams(logits_processor=script)))
    assert len(conv.response_ids) == 30 == len(conv.response_mask) and conv.finish_reason == "length"


def test_concurrent_conversations_keep_their_order(setup):
    tokenizer, loop = _loop(setup, [AddTool()])
    pairs = [(i, 10 * i) for i in range(1, 6)]
    params = [
        SamplingParams(logits_processor=Script(tokenizer, [_call(a, b), f"The answer is {a + b}"]))
        for a, b in pairs
    ]
    prompts = [_prompt(tokenizer, f"What is {a} + {b}?") for a, b in pairs]
    convs = asyncio.run(loop.run_batch(prompts, params, [None] * len(pairs)))
    for (a, b), prompt, conv in zip(pairs, prompts, convs, strict=True):
        assert conv.prompt_ids == prompt
        assert tokenizer.decode(conv.response_ids, skip_special_tokens=True).endswith(
            f"The answer is {a + b}"
        )


VERL_TOOL_YAML = """
tools:
  - class_name: "tests.workers.rollout.tools.verl_written_tool.MultiplyTool"
    config: {type: native}
    tool_schema:
      type: "function"
      function:
        name: "multiply"
        description: "a * b"
        parameters:
          type: "object"
          properties:
            a: {type: "integer", description: "first factor"}
            b: {type: "integer", description: "second factor"}
          required: ["a", "b"]
"""


def test_a_tool_written_for_verl_runs_unchanged_through_the_alias(setup, tmp_path):
    """verl's tool contract: the schema read as an OpenAIFunctionToolSchema, ``create`` returning
    ``(instance_id, ToolResponse)``, ``execute`` a ``ToolResponse`` whose text is the tool turn."""
    from hybridflow import verl_compat
    from hybridflow.workers.rollout.multi_turn import response_text
    from hybridflow.workers.rollout.tools.registry import load_tools, tool_schemas

    path = tmp_path / "tools.yaml"
    path.write_text(VERL_TOOL_YAML)
    assert verl_compat.install()
    try:
        from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

        tools = load_tools(str(path))
    finally:
        verl_compat.uninstall()
    tool = tools["multiply"]
    assert tool.described == "multiply: a * b"
    schema = tool_schemas(tools)[0]  # a dict for the chat template, as verl's model_dump gives it
    assert OpenAIFunctionToolSchema.model_validate(schema).function.parameters.required == ["a", "b"]
    properties = schema["function"]["parameters"]["properties"]
    assert properties["a"] == {"type": "integer", "description": "first factor"}
    assert response_text(ToolResponse()) == "" and response_text("plain") == "plain"

    tokenizer, loop = _loop(setup, list(tools.values()))
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
    params = SamplingParams(logits_processor=Script(tokenizer, [call, "The answer is 42"]))
    tools_kwargs = {"multiply": {"create_kwargs": {"expected": 42}}}
    conv = asyncio.run(loop.run(_prompt(tokenizer, "What is 6 * 7?"), params, tools_kwargs))
    tool_turn = tokenizer.decode([t for t, m in zip(conv.response_ids, conv.response_mask) if m == 0])
    assert "product=42" in tool_turn and "ToolResponse" not in tool_turn and "text=" not in tool_turn
    assert (conv.tool_calls, conv.tool_failures) == (1, 0)
    assert conv.tool_reward == pytest.approx(1.25)  # the step reward, then calc_reward on the instance
    assert len(tool.released) == 1 and isinstance(tool.released[0], str)  # the id, not verl's tuple


def test_truncate_text_sides():
    text = "abcdefghijklmnopqrstuvwxyz" * 4
    for side in ("left", "right", "middle"):
        out = truncate_text(text, 40, side)
        assert len(out) == 40 and "truncated" in out
    assert truncate_text("short", 40) == "short"


def test_the_reference_chat_is_rendered_once_per_tokenizer_and_settings(tiny_model_dir, monkeypatch):
    """A conversation starts without rendering the reference chat again: a renderer for a tokenizer,
    end-of-turn ids and template kwargs seen before reuses that chat's ids (and renders the same turns);
    the ids are forgotten with their tokenizer."""
    import gc

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.workers.rollout import multi_turn

    tokenizer = load_tokenizer(tiny_model_dir)
    first = multi_turn.ToolTurnRenderer(tokenizer, [EOS])
    renders = []
    real = multi_turn.ToolTurnRenderer._reference_prefix
    monkeypatch.setattr(
        multi_turn.ToolTurnRenderer, "_reference_prefix", lambda self: renders.append(1) or real(self)
    )
    again = multi_turn.ToolTurnRenderer(tokenizer, [EOS])
    assert renders == [] and again._prefix == first._prefix
    assert again.tool_turn_ids(["value: 5"]) == first.tool_turn_ids(["value: 5"])
    thinking = multi_turn.ToolTurnRenderer(tokenizer, [EOS], {"enable_thinking": False})
    assert renders == [1] and thinking.template_kwargs == {"enable_thinking": False}
    key = id(tokenizer)
    assert key in multi_turn._PREFIXES
    del tokenizer, first, again, thinking
    gc.collect()
    assert key not in multi_turn._PREFIXES
