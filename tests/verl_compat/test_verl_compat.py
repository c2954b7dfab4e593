"""The opt-in verl alias (hybridflow.verl_compat): verl's module paths resolve to ours by the table,
attribute writes reach our modules, our packages gain no verl names, a real verl is never shadowed."""

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hybridflow import verl_compat

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def alias():
    assert verl_compat.install()
    yield verl_compat
    verl_compat.uninstall()


def test_verl_paths_are_aliases_of_our_modules(alias):
    import verl
    import verl.trainer.ppo.core_algos as theirs
    from verl.protocol import DataProto

    import hybridflow.protocol
    import hybridflow.trainer.ppo.core_algos as ours

    assert DataProto is hybridflow.protocol.DataProto and verl.DataProto is DataProto
    assert theirs.register_adv_est is ours.register_adv_est
    assert sys.modules["verl.trainer.ppo.core_algos"] is not ours  # an alias module, not our module


def test_verls_tool_schemas_import_with_verls_fields(alias):
    """``from verl.tools.schemas import ...`` in a tool written for verl (verl/tools/schemas.py)."""
    from verl.tools.schemas import (
        OpenAIFunctionCallSchema,
        OpenAIFunctionParametersSchema,
        OpenAIFunctionParsedSchema,
        OpenAIFunctionPropertySchema,
        OpenAIFunctionSchema,
        OpenAIFunctionToolCall,
        OpenAIFunctionToolSchema,
        ToolResponse,
    )

    from hybridflow.workers.rollout.tools import schemas as ours
    from hybridflow.workers.rollout.tools.base_tool import ToolSchema

    assert OpenAIFunctionToolSchema is ours.OpenAIFunctionToolSchema and ToolResponse is ours.ToolResponse
    fields = {
        OpenAIFunctionPropertySchema: ["type", "description", "enum"],
        OpenAIFunctionParametersSchema: ["type", "properties", "required"],
        OpenAIFunctionSchema: ["name", "description", "parameters", "strict"],
        OpenAIFunctionToolSchema: ["type", "function"],
        OpenAIFunctionParsedSchema: ["name", "arguments"],
        OpenAIFunctionCallSchema: ["name", "arguments"],
        OpenAIFunctionToolCall: ["id", "type", "function"],
        ToolResponse: ["text", "image", "video"],
    }
    for model, names in fields.items():
        assert list(model.model_fields) == names, model
    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "look it up",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string", "description": "words"}},
                    "required": ["query"],
                },
            },
        }
    )
    assert schema.function.strict is False and schema.function.parameters.properties["query"].enum is None
    assert OpenAIFunctionSchema(name="f", description="").parameters.model_dump() == {
        "type": "object", "properties": {}, "required": [],
    }  # fmt: skip
    parsed = OpenAIFunctionParsedSchema(name="search", arguments='{"query": "x"}')
    call, bad = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(parsed)
    assert (call.arguments, bad) == ({"query": "x"}, False)
    for junk in ("{oops", "[1, 2]"):
        call, bad = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
            OpenAIFunctionParsedSchema(name="search", arguments=junk)
        )
        assert (call.arguments, bad) == ({}, True)
    assert OpenAIFunctionToolCall(id="c1", function=call).type == "function"
    assert ToolResponse().is_empty() and ToolResponse(text="hi").is_text_only()
    assert not ToolResponse(text="hi", image=["png"]).is_text_only()
    with pytest.raises(ValueError, match="image must be a list"):
        ToolResponse(image="png")
    # our tools' schema reads as verl's, and a verl schema builds one of ours
    ours_schema = ToolSchema.from_dict(schema.model_dump(exclude_none=True))
    assert ours_schema.function == schema.function and ours_schema.type == "function"
    assert ToolSchema.from_dict(schema) == ours_schema and ours_schema.model_dump() == ours_schema.to_dict()


def test_verls_bypass_mode_loss_is_the_registered_one(alias):
    from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode, get_policy_loss_fn

    assert compute_policy_loss_bypass_mode is get_policy_loss_fn("bypass_mode")


def test_writes_reach_our_module_and_children_stay_on_the_alias(alias):
    import verl.single_controller.base.decorator  # noqa: F401  (verl's base/ package is our package root)
    import verl.trainer.ppo.metric_utils as theirs

    import hybridflow.single_controller as sc
    import hybridflow.trainer.ppo.metric_utils as ours

    original = ours._compute_response_info
    theirs._compute_response_info = "patched"
    assert ours._compute_response_info == "patched"
    del theirs._compute_response_info
    assert not hasattr(ours, "_compute_response_info")
    ours._compute_response_info = original
    # importing verl.single_controller.base attached "base" to the alias, not to our package
    assert sc.base.__name__ == "hybridflow.single_controller.base"
    import hybridflow.trainer.config as config_module

    importlib.import_module("verl.trainer.config.algorithm")
    assert "algorithm" not in vars(config_module)


def test_table_targets_exist_and_a_missing_one_is_named(alias, monkeypatch):
    for verl_name in verl_compat.MODULE_TABLE:
        for target in verl_compat.targets_of(verl_name):
            assert importlib.util.find_spec(target) is not None, (verl_name, target)
    monkeypatch.setitem(verl_compat.MODULE_TABLE, "verl.experimental.later", "hybridflow.workers.later")
    with pytest.raises(
        ModuleNotFoundError, match="verl.experimental.later is aliased to hybridflow.workers.later"
    ):
        importlib.import_module("verl.experimental.later")


def test_one_verl_module_split_over_several_of_ours(alias):
    from verl.experimental.agent_loop import AgentLoopManager, SingleTurnAgentLoop
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopWorker, register

    from hybridflow.workers.rollout.agent_loop import base, manager, worker

    assert (AgentLoopBase, register, AgentLoopWorker) == (
        base.AgentLoopBase,
        base.register,
        worker.AgentLoopWorker,
    )
    assert AgentLoopManager is manager.AgentLoopManager and SingleTurnAgentLoop.__module__.endswith(
        "single_turn"
    )
    with pytest.raises(AttributeError, match="alias of hybridflow.workers.rollout.agent_loop.base, "):
        importlib.import_module("verl.experimental.agent_loop.agent_loop").NoSuchLoop  # noqa: B018


def test_unlisted_paths_fall_back_to_the_mirrored_module_or_are_not_found(alias):
    import verl.utils.timer

    import hybridflow.utils.timer

    assert verl.utils.timer.Timer is hybridflow.utils.timer.Timer
    with pytest.raises(ModuleNotFoundError, match="No module named 'verl.utils.no_such_module'"):
        importlib.import_module("verl.utils.no_such_module")


def test_a_real_verl_is_never_shadowed(tmp_path, monkeypatch):
    (tmp_path / "verl").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert verl_compat.real_verl_location() is None  # a folder without __init__.py is no install
    (tmp_path / "verl" / "__init__.py").write_text("")
    importlib.invalidate_caches()
    with pytest.warns(UserWarning, match="a real verl is installed"):
        assert verl_compat.install() is False
    assert not verl_compat.is_installed()


def _run(args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )


def test_environment_switch_and_script_runner():
    code = "import hybridflow, verl.utils.registry as r; print(r.Registry.__module__)"
    on = _run(["-c", code], {"HYBRIDFLOW_VERL_ALIAS": "1"})
    assert on.returncode == 0 and on.stdout.strip() == "hybridflow.utils.registry", on.stderr
    off = _run(["-c", code], {"HYBRIDFLOW_VERL_ALIAS": "0"})
    assert off.returncode != 0 and "No module named 'verl'" in off.stderr
    script = _run(["-m", "hybridflow.verl_compat", "tests/verl_compat/extension_written_for_verl.py"])
    # scores 1, 0, 0.5 in one group: 1 - max(0, 0.5), 0 - max(1, 0.5), 0.5 - max(1, 0)
    assert script.returncode == 0 and "best_of_rest [0.5, -1.0, -0.5]" in script.stdout, script.stderr


def test_install_is_idempotent_and_uninstall_forgets_the_aliases():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verl_compat.install() and verl_compat.install()
    importlib.import_module("verl.utils.metric")
    verl_compat.uninstall()
    assert not verl_compat.is_installed() and "verl.utils.metric" not in sys.modules
