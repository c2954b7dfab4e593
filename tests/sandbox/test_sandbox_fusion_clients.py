"""verl's SandboxFusion clients against the real server process: ``check_correctness`` and
``compute_score`` (verl's result codes and metadata), ``default_compute_score`` for the code data
sources and the reward manager built from ``reward_model.sandbox_fusion``, the ``SandboxFusionTool``
loaded from verl's class path; and what a server that is down, slow or answering junk costs (one call,
an error string, counted in the tool's metrics)."""

import asyncio
import json
import pickle
import threading

import pytest
from omegaconf import OmegaConf

from hybridflow.utils.reward_score import default_compute_score
from hybridflow.utils.reward_score.sandbox_fusion import compute_score, extract_code
from hybridflow.utils.reward_score.sandbox_fusion.utils import call_sandbox_api, check_correctness
from hybridflow.workers.reward_manager import build_reward_manager
from hybridflow.workers.reward_manager.sandbox_fusion import SandboxFusionComputeScore
from hybridflow.workers.rollout.tools import sandbox_fusion_tool
from hybridflow.workers.rollout.tools.registry import load_tools
from hybridflow.workers.rollout.tools.sandbox_fusion_tool import SandboxFusionTool

ECHO_UPPER = "import sys\nprint(sys.stdin.read().strip().upper())\n"
VERL_TOOL_CONFIG = """
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "{url}"
      num_workers: 2
      enable_global_rate_limit: true
      rate_limit: 2
      default_timeout: {timeout}
      default_language: "python"
      memory_limit_mb: 256
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code: {{type: "string", description: "The code to execute."}}
          required: ["code"]
"""


@pytest.fixture(scope="module")
def run_code_url(sandbox_server):
    return f"{sandbox_server[0]}/run_code"


def make_tool(tmp_path, url, timeout=5):
    path = tmp_path / "tools.yaml"
    path.write_text(VERL_TOOL_CONFIG.format(url=url, timeout=timeout))
    tool = load_tools(str(path))["code_interpreter"]
    assert isinstance(tool, SandboxFusionTool)
    return tool


def call_tool(tool, parameters):
    async def go():
        instance = await tool.create(ground_truth=None)
        try:
            return await tool.execute(instance, parameters)
        finally:
            await tool.release(instance)

    return asyncio.run(go())


def test_check_correctness_results_and_metadata(run_code_url):
    semaphore = threading.Semaphore(2)
    in_outs = {"inputs": ["abc", "xyz", "q"], "outputs": ["ABC\n", "XYZ", "nope"]}
    results, metadata = check_correctness(
        run_code_url, in_outs, ECHO_UPPER, timeout=5, concurrent_semaphore=semaphore
    )
    assert results == [True, True, False]
    assert [m["status"] for m in metadata] == ["success", "success", "wrong_answer"]
    first = metadata[0]
    assert first["input"] == "abc" and first["stdout"] == "ABC\n" and first["exit_code"] == 0
    assert (first["api_status"], first["run_status"], first["api_request_error"]) == (
        "Success",
        "Finished",
        None,
    )
    assert first["api_response"]["run_result"]["stdout"] == "ABC\n"
    raising = "import sys\nprint('bad', file=sys.stderr)\nraise ValueError('x')"
    results, metadata = check_correctness(run_code_url, {"inputs": ["1"], "outputs": ["1"]}, raising)
    assert (
        results == [-2] and metadata[0]["status"] == "runtime_error" and "ValueError" in metadata[0]["stderr"]
    )
    results, metadata = check_correctness(
        run_code_url, {"inputs": ["1"], "outputs": ["1"]}, "while 1: pass", timeout=1
    )
    assert results == [-3] and metadata[0]["status"] == "timeout"
    results, metadata = check_correctness(
        run_code_url, {"inputs": [""], "outputs": [""]}, "x = bytearray(300 << 20)", memory_limit_mb=128
    )
    assert results == [-2] and "MemoryError" in metadata[0]["stderr"]
    assert check_correctness(run_code_url, {"inputs": ["1"]}, "print(1)") == (
        [-1],
        [{"error": "Invalid input/output data"}],
    )
    assert check_correctness(run_code_url, {"inputs": [], "outputs": []}, "print(1)") == ([], [])


def test_check_correctness_compile_errors_mark_every_later_case(run_code_url):
    results, metadata = check_correctness(
        run_code_url,
        {"inputs": ["1", "2"], "outputs": ["1", "2"]},
        "int main() { return nope; }",
        language="cpp",
    )
    if metadata[0]["status"] == "sandbox_error":
        pytest.skip("g++ is not installed where the sandbox sees it")
    assert results == [-4, -4] and metadata[0]["status"] == "compile_error"
    assert metadata[1]["status"] in ("compile_error", "compile_error_skipped")
    results, metadata = check_correctness(
        run_code_url, {"inputs": ["1"], "outputs": ["1"]}, "x", language="lean"
    )
    assert results == [-1] and metadata[0]["status"] == "sandbox_error"


def test_function_cases_and_assert_cases(run_code_url):
    solution = "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
    solution += "        seen = {}\n        for i, n in enumerate(nums):\n"
    solution += "            if target - n in seen:\n                return [seen[target - n], i]\n"
    solution += "            seen[n] = i\n"
    in_outs = {
        "fn_name": "twoSum",
        "inputs": ["[2, 7, 11, 15]\n9", "[3, 3]\n6"],
        "outputs": ["[0, 1]", "[1, 0]"],
    }
    results, _ = check_correctness(run_code_url, in_outs, solution)
    assert results == [True, False]
    tests = {"assert_case": ["assert add(1, 2) == 3", "assert add(1, 1) == 3"]}
    score, metadata = compute_score(
        run_code_url, None, 256, "```python\ndef add(a, b):\n    return a + b\n```", tests
    )
    assert score == 0.5 and [m["status"] for m in metadata] == ["success", "runtime_error"]


def test_compute_score_and_the_code_data_sources(run_code_url):
    completion = f"Here you go:\n```python\n{ECHO_UPPER}```\nDone."
    cases = json.dumps({"inputs": ["a", "b"], "outputs": ["A", "wrong"]})
    score, metadata = compute_score(run_code_url, threading.Semaphore(4), 256, completion, cases)
    assert score == 0.5 and len(metadata) == 2
    assert compute_score(run_code_url, None, 256, "no code here", cases) == (
        0.0,
        [{"error": "Invalid completion (missing code block)"}],
    )
    assert extract_code("```py\nprint(1)\n```") == "print(1)\n"
    assert default_compute_score("codecontests", completion, cases, sandbox_fusion_url=run_code_url) == 0.5
    # without a URL, verl's fallback: prime_code in the local sandbox, the same pass rate
    assert default_compute_score("apps", completion, cases) == 0.5
    assert default_compute_score("openai/gsm8k", "#### 72", "72", sandbox_fusion_url=run_code_url) == 1.0


def test_reward_manager_binds_the_configured_server(run_code_url):
    reward_model = OmegaConf.create(
        {
            "reward_manager": "naive",
            "sandbox_fusion": {"url": run_code_url, "max_concurrent": 3, "memory_limit_mb": 256},
        }
    )
    manager = build_reward_manager(
        reward_model, OmegaConf.create({"path": None}), tokenizer=None, num_examine=0
    )
    scorer = manager.compute_score
    assert isinstance(scorer, SandboxFusionComputeScore) and scorer.max_concurrent == 3
    copy = pickle.loads(pickle.dumps(scorer))
    completion = "```python\nprint(input())\n```"
    assert copy("taco", completion, {"inputs": ["7"], "outputs": ["7"]}) == 1.0
    off = build_reward_manager(
        OmegaConf.create({"reward_manager": "naive"}), None, tokenizer=None, num_examine=0
    )
    assert not isinstance(off.compute_score, SandboxFusionComputeScore)


def test_the_tool_runs_code_on_the_server(tmp_path, run_code_url):
    tool = make_tool(tmp_path, run_code_url)
    text, reward, metrics = call_tool(
        tool, {"code": "import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)"}
    )
    assert (text, reward) == ("42\nwarn\n", 0.0) and "error" not in metrics and metrics["exit_code"] == 0
    text, _, metrics = call_tool(tool, {"code": "raise SystemExit(5)"})
    assert text == "" and metrics["error"] == "exit code 5"
    text, _, metrics = call_tool(tool, {"code": "print('hi', flush=True)\nwhile True: pass", "timeout": 1})
    assert text == "hi\n[timed out after 1s]" and metrics["error"] == "timeout"
    text, _, metrics = call_tool(tool, {"code": "x", "language": "lean"})
    assert text.startswith("Error: the sandbox could not run the code") and "'lean'" in text
    assert metrics["error"] == "sandbox error"
    assert call_tool(tool, {})[2] == {"error": "bad arguments"}


def test_a_server_that_is_down_slow_or_junk_costs_one_call(tmp_path, junk_server, monkeypatch, run_code_url):
    from tests.sandbox.conftest import free_port

    down = f"http://127.0.0.1:{free_port()}/run_code"
    for url, expected in (
        (down, "ConnectError"),
        (f"{junk_server}/junk", "not JSON"),
        (f"{junk_server}/list", "not a SandboxFusion response"),
        (f"{junk_server}/error", "HTTP 500"),
    ):
        text, reward, metrics = call_tool(make_tool(tmp_path, url), {"code": "print(1)"})
        assert text.startswith("Error: the sandbox at") and expected in text, text
        assert reward == 0.0 and metrics["error"] == "sandbox unavailable"
    monkeypatch.setattr(sandbox_fusion_tool, "API_TIMEOUT", 0.5)
    text, _, metrics = call_tool(
        make_tool(tmp_path, f"{junk_server}/slow", timeout=0.25), {"code": "print(1)"}
    )
    assert "no answer within 1s" in text and metrics["error"] == "sandbox unavailable"
    # the same server keeps working for the next call, and verl's HTTP helper reports rather than raises
    assert call_tool(make_tool(tmp_path, run_code_url), {"code": "print(1)"})[0] == "1\n"
    response, error = call_sandbox_api(f"{junk_server}/junk", "print(1)", None, 1, 1, 128)
    assert response is None and error.startswith("API Call Failed") and "JSON" in error
    results, metadata = check_correctness(down, {"inputs": ["1"], "outputs": ["1"]}, "print(1)")
    assert results == [-1] and metadata[0]["status"] == "api_error" and metadata[0]["api_request_error"]


CODE_SCORER = """
from hybridflow.utils.reward_score import default_compute_score

def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    url = "{url}"
    return default_compute_score(data_source, solution_str, ground_truth, extra_info, sandbox_fusion_url=url)
"""


def test_a_down_or_junk_server_is_counted_in_the_reward_never_silent(
    tmp_path, junk_server, run_code_url, caplog
):
    """A codecontests row scored on a server nobody listens on, or one that answers junk: the failed
    cases score 0 as before, and the result carries ``sandbox_error`` into the reward's extra info (the
    reward manager's columns, the validation metrics, the reward loop's failure count), with one
    warning naming the URL. A healthy server's result is verl's float, unchanged."""
    from hybridflow.models.tiny import build_tokenizer
    from hybridflow.tasks.arithmetic import task_texts
    from hybridflow.trainer.ppo.metric_utils import process_validation_metrics
    from hybridflow.utils.ports import find_free_port
    from hybridflow.workers.reward_loop import RewardLoop
    from tests.workers.reward_manager.test_reward_managers import make_batch

    completion = "```python\nprint(input())\n```"
    cases = json.dumps({"inputs": ["7", "8"], "outputs": ["7", "8"]})
    down = f"http://127.0.0.1:{find_free_port()}/run_code"
    caplog.set_level("WARNING", logger="hybridflow.utils.reward_score.sandbox_fusion")
    for url in (down, f"{junk_server}/junk", f"{junk_server}/list", down):
        result = default_compute_score("codecontests", completion, cases, sandbox_fusion_url=url)
        assert result == {"score": 0.0, "sandbox_error": 2.0}, (url, result)
    warned = [r.getMessage() for r in caplog.records if down in r.getMessage()]
    assert len(warned) == 1 and "gave no verdict on 2 of 2 test cases" in warned[0], warned
    assert "ConnectError" in warned[0]
    # the success path is verl's: a float, no extra keys
    healthy = default_compute_score("codecontests", completion, cases, sandbox_fusion_url=run_code_url)
    assert healthy == 1.0 and type(healthy) is float

    # the reward manager bound to the down server: a column per sample; a row without code scores 0.0
    # as verl's (no call made), so the column holds None there
    tokenizer = build_tokenizer(task_texts(n=300))
    batch = make_batch(tokenizer, [completion, "no code"], [cases, cases], t_r=32, data_source="codecontests")
    reward_model = OmegaConf.create({"reward_manager": "naive", "sandbox_fusion": {"url": down}})
    manager = build_reward_manager(reward_model, None, tokenizer=tokenizer, num_examine=0)
    out = manager(batch, return_dict=True)
    assert out["reward_tensor"].sum().item() == 0.0
    assert out["reward_extra_info"]["sandbox_error"] == [2.0, None]
    # validation files it as an aux metric of the code source (the None row is no sample of it)
    metrics = process_validation_metrics(
        ["codecontests"] * 2, ["u0", "u0"], {"reward": [0.0, 0.0], **out["reward_extra_info"]}
    )
    assert metrics["codecontests"]["sandbox_error"]["mean@1"] == 2.0
    assert metrics["codecontests"]["reward"]["mean@2"] == 0.0

    # the reward loop counts the samples in reward/failures/sandbox_error
    path = tmp_path / "scorer.py"
    path.write_text(CODE_SCORER.format(url=down))
    config = OmegaConf.create(
        {
            "reward_model": {"reward_manager": "naive", "reward_kwargs": {}},
            "custom_reward_function": {"path": str(path), "name": "score"},
            "data": {"max_response_length": 32},
        }
    )
    loop = RewardLoop(config, tokenizer)
    assert loop(batch, return_dict=True)["reward_extra_info"]["sandbox_error"] == [2.0, None]
    failures = loop.pop_metrics()
    assert failures["reward/failures/sandbox_error"] == 1 and failures["reward/failures/error"] == 0


def test_verl_import_paths_reach_these_implementations():
    from hybridflow import verl_compat

    assert verl_compat.install()
    try:
        from verl.tools.sandbox_fusion_tools import SandboxFusionTool as VerlTool
        from verl.utils.reward_score.sandbox_fusion import compute_score as verl_compute_score
        from verl.utils.reward_score.sandbox_fusion.utils import _process_single_case
        from verl.utils.reward_score.sandbox_fusion.utils import check_correctness as verl_check

        from hybridflow.utils.reward_score.sandbox_fusion import utils as ours

        assert VerlTool is SandboxFusionTool and verl_compute_score is compute_score
        assert verl_check is ours.check_correctness and _process_single_case is ours._process_single_case
    finally:
        verl_compat.uninstall()
