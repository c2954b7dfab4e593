"""verl's prime_code scorer (issue 49 item 5): test cases run in the project's sandbox, never in the
test process; result codes and scores as verl's ``prime_code`` gives them (hand-derived)."""

import asyncio
import json

import pytest

from hybridflow.utils.reward_score import default_compute_score, prime_code
from hybridflow.utils.reward_score.prime_code.utils import check_correctness, stdout_matches
from hybridflow.utils.sandbox import run_python

DOUBLE = "n = int(input())\nprint(n * 2)\n"
CASES = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["2\n", "4\n", "6\n"]}


@pytest.fixture(scope="module", autouse=True)
def sandbox_available():
    result = asyncio.run(run_python("print('ok')"))
    if "cannot create the sandbox's namespaces" in result.isolation.get("error", ""):
        pytest.skip(f"the sandbox cannot run on this machine: {result.isolation['error']}")


def test_stdin_programs_pass_and_score_continuously():
    completion = f"Here:\n```python\n{DOUBLE}```"
    assert prime_code.compute_score(completion, CASES) == (True, {})
    # wrong on cases 2 and 3: the full run fails, then each of the first 10 cases runs alone -> 1/3
    half = "n = int(input())\nprint(2 if n == 1 else 5)\n"
    score, per_case = prime_code.compute_score(half, json.dumps(CASES), continuous=True)
    assert score == pytest.approx(1 / 3) and [c["test_case"]["res"] for c in per_case] == [
        "[True]", "[False]", "[False]",
    ]  # fmt: skip
    assert prime_code.compute_score(half, CASES)[0] is False  # without continuous: pass or fail


def test_result_codes_cut_after_the_first_failure():
    results, metadata = check_correctness(CASES, "n = int(input())\nprint(2 if n == 1 else 0)", timeout=5)
    assert results == [True, False] and metadata[0]["error_message"] == "Wrong Answer"
    assert check_correctness(CASES, "def broken(:", timeout=5)[0] == [-2]
    results, metadata = check_correctness(CASES, "raise ValueError('boom')", timeout=5)
    assert results == [-1] and "boom" in metadata[0]["error"]
    assert check_correctness(CASES, "while True:\n    pass", timeout=1)[0] == [-1]  # the case's timeout


def test_call_based_problems_compare_return_values():
    cases = {"fn_name": "solve", "inputs": ["1\n2", "[1]\n[2, 3]"], "outputs": ["3", "[1, 2, 3]"]}
    noisy = "def solve(a, b):\n    print('thinking')\n    return a + b\n"  # prints do not count
    assert check_correctness(cases, noisy, timeout=5) == ([True, True], [{}])
    method = "class Solution:\n    def solve(self, a, b):\n        return a + b\n"
    assert check_correctness(cases, method, timeout=5)[0] == [True, True]
    assert check_correctness(cases, "def other(a, b):\n    return 0\n", timeout=5)[0] == [-2]


def test_the_code_runs_in_the_sandbox_not_here(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("42")
    cases = {"inputs": [""], "outputs": ["42"]}
    results, metadata = check_correctness(cases, f"print(open({str(secret)!r}).read())", timeout=5)
    assert results == [-1] and "FileNotFoundError" in metadata[0]["error"]
    # without a SandboxFusion URL the code data sources fall back to prime_code, as in verl
    assert default_compute_score("codeforces", f"```python\n{DOUBLE}```", CASES) == 1.0


def test_stdout_comparison_rules():
    assert stdout_matches("1 2 \n3 \n", "1 2\n3")  # lines stripped
    assert stdout_matches("1 2\n\n3\n", "1 2\n3")  # blank lines dropped
    assert not stdout_matches("1 2\n\n3 \n", "1 2\n3")  # not both at once: verl's cascade
    assert stdout_matches("0.3333333\n", "0.33333334")  # numbers within allclose's tolerance
    assert not stdout_matches("3\n", "4")  # integers are never compared as floats
    assert stdout_matches("10\n", "10.000001")  # a float token: allclose (rtol 1e-5)
    assert stdout_matches("x\ny", ["x", "y"])  # a list of expected lines
