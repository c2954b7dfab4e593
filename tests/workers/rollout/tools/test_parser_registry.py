"""Tool-call parsing (hermes), tool YAML loading, and the GSM8K tool."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import yaml

from hybridflow.utils.registry import RegistryError
from hybridflow.utils.reward_score.gsm8k import compute_score
from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema
from hybridflow.workers.rollout.tools.gsm8k_tool import Gsm8kTool
from hybridflow.workers.rollout.tools.parser import (
    TOOL_CALL_PARSERS,
    HermesParser,
    ParseError,
    ToolCall,
    get_tool_call_parser,
    short_repr,
)
from hybridflow.workers.rollout.tools.registry import (
    VERL_CLASS_ALIASES,
    ToolConfigError,
    load_tools,
    tool_schemas,
)

EXAMPLE_CONFIG = Path(__file__).resolve().parents[4] / "examples" / "tools" / "gsm8k_tool_config.yaml"
GSM8K_CLASS = "hybridflow.workers.rollout.tools.gsm8k_tool.Gsm8kTool"
SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The answer"}},
            "required": ["answer"],
        },
    },
}


def block(payload) -> str:
    return f"<tool_call>\n{json.dumps(payload)}\n</tool_call>"


# ----------------------------------------------------------------------------------------- parser


def test_hermes_one_call():
    content, calls, errors = HermesParser().parse(block({"name": "f", "arguments": {"x": 1}}))
    assert (content, calls, errors) == ("", [ToolCall("f", {"x": 1})], [])


def test_hermes_two_calls_with_text_around():
    text = (
        "Let me check.\n"
        + block({"name": "a", "arguments": {}})
        + "\nand "
        + block({"name": "b", "arguments": {"y": "2"}})
        + "\nDone."
    )
    content, calls, errors = get_tool_call_parser("hermes").parse(text)
    assert [c.name for c in calls] == ["a", "b"]
    assert calls[1].arguments == {"y": "2"}
    assert errors == []
    assert content == "Let me check.\n\nand \nDone."
    assert "<tool_call>" not in content


def test_hermes_no_calls_returns_stripped_text():
    assert HermesParser().parse("  just an answer \n") == ("just an answer", [], [])


def test_hermes_arguments_as_json_string_are_decoded():
    text = block({"name": "f", "arguments": json.dumps({"answer": "72"})})
    _, calls, errors = HermesParser().parse(text)
    assert calls == [ToolCall("f", {"answer": "72"})] and errors == []


def test_hermes_missing_or_null_arguments_mean_no_arguments():
    text = block({"name": "f"}) + block({"name": "g", "arguments": None})
    _, calls, errors = HermesParser().parse(text)
    assert calls == [ToolCall("f", {}), ToolCall("g", {})] and errors == []


def test_hermes_malformed_json_is_an_error_with_raw_text():
    bad = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    text = "before " + bad + " " + block({"name": "ok", "arguments": {}})
    content, calls, errors = HermesParser().parse(text)
    assert calls == [ToolCall("ok", {})]
    assert len(errors) == 1 and isinstance(errors[0], ParseError)
    assert errors[0].raw == bad
    assert errors[0].message.startswith("tool call is not valid JSON")
    assert content == "before"


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"arguments": {"x": 1}}, "tool call has no 'name'"),
        ({"name": "", "arguments": {}}, "tool call has no 'name'"),
        ({"name": 3, "arguments": {}}, "'name' must be a string"),
        ({"name": "f", "arguments": [1, 2]}, "arguments must be a JSON object"),
        ({"name": "f", "arguments": "[1, 2]"}, "arguments must be a JSON object"),
        ({"name": "f", "arguments": "{not json"}, "not valid JSON"),
        (["f", {}], "tool call must be a JSON object"),
    ],
)
def test_hermes_invalid_call_shapes(payload, message):
    text = block(payload)
    content, calls, errors = HermesParser().parse(text)
    assert calls == [] and content == ""
    assert len(errors) == 1
    assert message in errors[0].message
    assert errors[0].raw == text


def test_hermes_unterminated_final_block_is_an_error():
    text = "Answer: " + block({"name": "a", "arguments": {}}) + ' then <tool_call>{"name": "b", "argum'
    content, calls, errors = HermesParser().parse(text)
    assert calls == [ToolCall("a", {})]
    assert len(errors) == 1
    assert errors[0].raw == '<tool_call>{"name": "b", "argum'
    assert "not terminated" in errors[0].message
    assert content == "Answer:  then"


def test_hermes_never_raises_on_odd_input():
    parser = HermesParser()
    for text in ["", "</tool_call>", "<tool_call></tool_call>", "<tool_call>", None, "[" * 100000]:
        content, calls, errors = parser.parse(text)
        assert isinstance(content, str) and calls == []
        if text and text.startswith("<tool_call>"):
            assert len(errors) == 1  # an empty or unterminated block is reported, not dropped


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" * 100_000,  # no closing tag: took > 300 s with the old regex scan
        "<tool_call></tool_call>" * 100_000,
        '<tool_call>{"name": "f"}</tool_call>' * 100_000,
        "<tool_call>" + "[" * 900_000 + "</tool_call>",
        "x" * 5_000_000 + "<tool_call>",
    ],
)
def test_hermes_parsing_is_linear_with_a_size_cap(text):
    started = time.perf_counter()
    content, calls, errors = HermesParser().parse(text)
    assert time.perf_counter() - started < 0.5
    assert len(calls) <= HermesParser.max_calls and 1 <= len(errors) <= HermesParser.max_calls + 2


def test_hermes_caps_say_what_was_not_read():
    class Small(HermesParser):
        max_chars, max_calls = 200, 2

    three = block({"name": "a"}) * 3
    content, calls, errors = Small().parse(three)
    assert calls == [ToolCall("a", {})] * 2 and content == ""
    assert [e.message for e in errors] == ["more than 2 tool calls in one message: the last 1 were not read"]
    content, calls, errors = Small().parse("x" * 300 + block({"name": "late"}))
    assert calls == [] and content.startswith("x" * 300)
    assert errors[0].message.endswith("tool calls after its first 200 characters are not read")


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "f", "arguments": {"a": ' + "1" * 5000 + "}}", "Exceeds the limit (4300 digits)"),
        ('{"name": "f", "arguments": ' + "[" * 100_000 + "}", "not valid JSON"),
        ('{"name": "f", "arguments": "' + "{" * 5000 + '"}', "not valid JSON"),
    ],
)
def test_hermes_hostile_json_is_an_error_not_an_exception(body, message):
    _, calls, errors = HermesParser().parse(f"<tool_call>{body}</tool_call>")
    assert calls == [] and len(errors) == 1 and message in errors[0].message


def test_odd_names_parse_exactly_and_print_safely():
    names = ["\udc80", "\x00", "../../etc/passwd", "\udc00\ud800", "n" * 1000]  # reversed pair: two lone ones
    text = "".join(f'<tool_call>{{"name": {json.dumps(name)}}}</tool_call>' for name in names)
    _, calls, errors = HermesParser().parse(text)
    assert [c.name for c in calls] == names and errors == []
    shown = [short_repr(name) for name in names]
    assert shown[:4] == ["'\\udc80'", "'\\x00'", "'../../etc/passwd'", "'\\udc00\\ud800'"]
    assert shown[4] == "'" + "n" * 64 + "'... (1000 characters)"
    assert all(s.isascii() for s in shown)


def test_unknown_format_lists_registered():
    assert "hermes" in TOOL_CALL_PARSERS
    with pytest.raises(RegistryError, match="hermes") as info:
        get_tool_call_parser("nope")
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------------------------------- registry


def write_config(tmp_path, entries) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": entries}))
    return str(path)


@pytest.mark.parametrize("class_name", [GSM8K_CLASS, "verl.tools.gsm8k_tool.Gsm8kTool"])
def test_load_tools(tmp_path, class_name):
    path = write_config(
        tmp_path, [{"class_name": class_name, "config": {"type": "native"}, "tool_schema": SCHEMA}]
    )
    tools = load_tools(path)
    assert list(tools) == ["calc_gsm8k_reward"]
    tool = tools["calc_gsm8k_reward"]
    assert isinstance(tool, Gsm8kTool) and tool.config == {"type": "native"}
    assert tool_schemas(tools) == [SCHEMA]
    assert tool_schemas(list(tools.values())) == [SCHEMA]


def test_example_config_loads():
    tools = load_tools(str(EXAMPLE_CONFIG))
    assert isinstance(tools["calc_gsm8k_reward"], Gsm8kTool)
    assert tools["calc_gsm8k_reward"].tool_schema.required == ["answer"]


def test_sandbox_alias_points_at_the_http_client():
    target = VERL_CLASS_ALIASES["verl.tools.sandbox_fusion_tools.SandboxFusionTool"]
    assert target == "hybridflow.workers.rollout.tools.sandbox_fusion_tool.SandboxFusionTool"


def test_missing_file(tmp_path):
    with pytest.raises(ToolConfigError, match="not found"):
        load_tools(str(tmp_path / "absent.yaml"))


@pytest.mark.parametrize("text", ["other: 1\n", "tools: 3\n", "- a\n", ""])
def test_no_tools_list(tmp_path, text):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError, match="tools"):
        load_tools(str(path))


def entry(**overrides):
    base = {"class_name": GSM8K_CLASS, "tool_schema": SCHEMA}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize(
    "bad_entry, message",
    [
        ({"tool_schema": SCHEMA}, "missing required key 'class_name'"),
        ({"class_name": GSM8K_CLASS}, "missing required key 'tool_schema'"),
        (entry(class_name="no_such_pkg_xyz.Tool"), "cannot import module 'no_such_pkg_xyz'"),
        (entry(class_name="hybridflow.workers.rollout.tools.gsm8k_tool.Nope"), "has no attribute 'Nope'"),
        (entry(class_name="NoDots"), "dotted path"),
        (
            entry(class_name="hybridflow.workers.rollout.tools.parser.HermesParser"),
            "not a subclass of BaseTool",
        ),
        (entry(class_name="verl.tools.image_zoom_in_tool.ImageZoomInTool"), "no counterpart"),
        (entry(tool_schema={"type": "function", "function": {"description": "x"}}), "invalid tool_schema"),
        (entry(config=[1]), "'config' must be a mapping"),
        ("just a string", "must be a mapping"),
    ],
)
def test_entry_errors_name_file_and_index(tmp_path, bad_entry, message):
    path = write_config(tmp_path, [entry(), bad_entry])
    with pytest.raises(ToolConfigError) as info:
        load_tools(path)
    assert f"{path}: tools[1]" in str(info.value)
    assert message in str(info.value)


def test_duplicate_tool_names(tmp_path):
    path = write_config(tmp_path, [entry(), entry(class_name="verl.tools.gsm8k_tool.Gsm8kTool")])
    with pytest.raises(ToolConfigError, match=r"tools\[1\]: duplicate tool name 'calc_gsm8k_reward'"):
        load_tools(path)


def test_invalid_yaml(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: [unclosed\n")
    with pytest.raises(ToolConfigError, match="cannot read"):
        load_tools(str(path))


# ------------------------------------------------------------------------------------- gsm8k tool


def make_tool() -> Gsm8kTool:
    return Gsm8kTool({"type": "native"}, ToolSchema.from_dict(SCHEMA))


def test_gsm8k_tool_flow():
    async def scenario():
        tool = make_tool()
        assert isinstance(tool, BaseTool)
        iid = await tool.create("s1", ground_truth="72")
        assert iid == "s1"

        wrong_text, wrong_step, metrics = await tool.execute(iid, {"answer": "71"})
        expected_wrong = compute_score("#### 71", "72", method="flexible")
        assert expected_wrong == 0.0 and metrics == {}
        assert wrong_text == f"Current parsed answer='71' reward={expected_wrong}"
        assert wrong_step == -0.05  # 0.0 does not beat the initial 0.0
        assert await tool.calc_reward(iid) == expected_wrong

        right_text, right_step, _ = await tool.execute(iid, {"answer": 72})  # coerced to "72"
        expected_right = compute_score("#### 72", "72", method="flexible")
        assert expected_right == 1.0
        assert right_text == f"Current parsed answer='72' reward={expected_right}"
        assert right_step == 0.0
        assert await tool.calc_reward(iid) == 1.0

        again_text, again_step, _ = await tool.execute(iid, {"answer": "#### 72"})  # no double prefix
        assert again_text == "Current parsed answer='#### 72' reward=1.0"
        assert again_step == -0.05  # not an improvement over the best (1.0)

        await tool.release(iid)
        text, step, _ = await tool.execute(iid, {"answer": "72"})
        assert text.startswith("Error") and "unknown instance" in text and step == 0.0
        assert await tool.calc_reward(iid) == 0.0

    asyncio.run(scenario())


def test_gsm8k_tool_bad_calls_return_error_text():
    async def scenario():
        tool = make_tool()
        text, step, metrics = await tool.execute("never-created", {"answer": "1"})
        assert "unknown instance id 'never-created'" in text and step == 0.0
        assert metrics == {"error": "unknown instance"}  # counted as a failed call by the agent loop
        iid = await tool.create(ground_truth="5")
        assert isinstance(iid, str) and iid
        text, step, metrics = await tool.execute(iid, {"value": "5"})
        assert "requires the argument 'answer'" in text and step == 0.0 and metrics["error"]
        text, step, _ = await tool.execute(iid, "5")
        assert text.startswith("Error") and step == 0.0
        await tool.release(iid)
        await tool.release(iid)  # releasing twice is harmless

    asyncio.run(scenario())


def test_gsm8k_tool_instances_are_independent():
    async def scenario():
        tool = make_tool()
        a = await tool.create("a", ground_truth="3")
        b = await tool.create("b", ground_truth="4")
        await tool.execute(a, {"answer": "3"})
        await tool.execute(b, {"answer": "3"})
        assert await tool.calc_reward(a) == 1.0 and await tool.calc_reward(b) == 0.0

    asyncio.run(scenario())
