r"""verl's scorers (issue 49 item 5): math_dapo, prime_math, geo3k, search_r1_like_qa_em, and the
``data_source`` table of ``default_compute_score``. Every expected value is worked out by hand from
verl's code (``verl/utils/reward_score/``)."""

import inspect

import pytest

from hybridflow.utils.registry import RegistryError
from hybridflow.utils.reward_score import (
    default_compute_score,
    geo3k,
    math_dapo,
    prime_math,
    sandbox_fusion,
    scorer_for,
    search_r1_like_qa_em,
)
from hybridflow.utils.reward_score.prime_math import grader

# --- the dispatch table --------------------------------------------------------------------------

DISPATCH = {
    prime_math.score_prime_math: [
        "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
        "numina_cn_k12", "numina_olympiads",
    ],
    sandbox_fusion.code_contests_score: ["codecontests", "apps", "codeforces", "taco"],
    math_dapo.score_math_dapo: ["math_dapo", "math", "math_dapo_reasoning", "aime", "aime2024", "aime_2025"],
    geo3k.score_geo3k: ["hiyouga/geometry3k"],
    search_r1_like_qa_em.score_search_r1: [
        "searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
        "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle",
    ],
}  # fmt: skip


def test_every_verl_data_source_reaches_its_scorer():
    for scorer, data_sources in DISPATCH.items():
        for data_source in data_sources:
            assert scorer_for(data_source) is scorer, data_source
    # verl lists the numina and searchR1 names one by one: other names of the family are not scored
    for unknown in ("numina_other", "searchR1_other", "xaime"):
        with pytest.raises(RegistryError, match="aime\\*"):
            scorer_for(unknown)


def test_default_compute_score_has_verls_signature_and_return_conventions():
    params = list(inspect.signature(default_compute_score).parameters)
    assert params[:7] == [
        "data_source", "solution_str", "ground_truth", "extra_info",
        "sandbox_fusion_url", "concurrent_semaphore", "memory_limit_mb",
    ]  # fmt: skip
    # dict results as they are, numbers as float; the sandbox settings reach only the code scorers
    result = default_compute_score("aime2024", "Answer: 33", "33", None, "http://127.0.0.1:9/run_code")
    assert result == {"score": 1.0, "acc": True, "pred": "33"}
    score = default_compute_score("searchR1_nq", "<answer>Paris</answer>", {"target": ["paris"]})
    assert score == 1.0 and type(score) is float


def test_verl_module_paths_import_through_the_alias():
    from hybridflow import verl_compat

    assert verl_compat.install()
    try:
        from verl.utils.reward_score import default_compute_score as verl_default
        from verl.utils.reward_score import geo3k as verl_geo3k
        from verl.utils.reward_score import math_dapo as verl_math_dapo
        from verl.utils.reward_score import prime_code as verl_prime_code
        from verl.utils.reward_score import prime_math as verl_prime_math
        from verl.utils.reward_score import search_r1_like_qa_em as verl_search
        from verl.utils.reward_score.prime_code.utils import check_correctness
        from verl.utils.reward_score.prime_math.grader import math_equal

        assert verl_default is default_compute_score and math_equal is grader.math_equal
        assert verl_math_dapo.compute_score is math_dapo.compute_score
        assert verl_prime_math.compute_score is prime_math.compute_score
        assert verl_geo3k.compute_score is geo3k.compute_score
        assert verl_search.compute_score is search_r1_like_qa_em.compute_score
        assert list(inspect.signature(verl_prime_code.compute_score).parameters) == [
            "completion", "test_cases", "continuous",
        ]  # fmt: skip
        check_params = ["in_outs", "generation", "timeout", "debug"]
        assert list(inspect.signature(check_correctness).parameters) == check_params
        assert verl_math_dapo.compute_score("Answer: 2", "2")["score"] == 1.0
    finally:
        verl_compat.uninstall()


# --- math_dapo -----------------------------------------------------------------------------------


def test_math_dapo_answer_parsing_and_minus_one_for_wrong():
    assert math_dapo.compute_score("so the result.\nAnswer: $\\frac{1}{2}$", "\\frac12") == {
        "score": 1.0, "acc": True, "pred": "\\frac{1}{2}",
    }  # fmt: skip
    # the last "Answer:" line wins, any case; units and thousands separators are normalised away
    assert math_dapo.compute_score("Answer: 3\nanswer: 1,000 dollars", "1000")["acc"] is True
    assert math_dapo.compute_score("Answer: x = 5 cm", "5")["acc"] is True
    wrong = math_dapo.compute_score("Answer: 4", "5")
    assert wrong == {"score": -1.0, "acc": False, "pred": "4"}
    # no Answer: line predicts [INVALID]; only the last 300 characters are read
    assert math_dapo.compute_score("\\boxed{5}", "5") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert math_dapo.compute_score("Answer: 5" + " " * 300, "5")["acc"] is False


def test_math_dapo_strict_box_and_normalisation():
    assert math_dapo.compute_score("so \\boxed{7}", "7", strict_box_verify=True) == {
        "score": 1.0, "acc": True, "pred": "7",
    }  # fmt: skip
    # verbatim comparison: \boxed{7.0} is not 7; the box must sit in the last 100 characters
    assert math_dapo.compute_score("\\boxed{7.0}", "7", strict_box_verify=True)["acc"] is False
    assert math_dapo.compute_score("\\boxed{7}" + "." * 100, "7", strict_box_verify=True)["pred"] is None
    assert math_dapo.last_boxed_only_string("a \\boxed{\\frac{1}{2}} b") == "\\boxed{\\frac{1}{2}}"
    assert math_dapo.normalize_final_answer("\\text{(A)}") == "(A)"
    assert math_dapo.normalize_final_answer("\\sqrt3") == "\\sqrt{3}"
    with pytest.raises(ValueError, match="4 indices"):
        math_dapo.compute_score("x", "1", strict_box_verify=True, pause_tokens_index=[1])


# --- prime_math ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "truth", "correct", "extracted"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", True, "\\frac{1}{2}"),  # Hendrycks: 0.5 -> 1/2
        ("so x = 1/2", "\\frac{1}{2}", True, "1/2"),  # "=" marker, a/b -> \frac{a}{b}
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True, "\\sqrt{8}"),  # sympy: sqrt(8) - 2*sqrt(2) = 0
        ("\\boxed{x^2+2x+1}", "(x+1)^2", True, "x^2+2x+1"),
        ("\\boxed{(1,2)}", "(1, 2)", True, "(1,2)"),
        ("\\boxed{50\\%}", "50", True, "50\\%"),
        ("\\boxed{6.28}", "2\\pi", True, "6.28"),  # math_equal with pi = 3.14
        ("\\boxed{2/4}", "\\frac{1}{2}", False, "2/4"),  # unreduced fractions must match as written
        ("\\boxed{3}", "4", False, "3"),
        ("no answer here", "3", False, "no answer here"),
    ],
)
def test_prime_math_extraction_and_equivalence(output, truth, correct, extracted):
    is_correct, _, answer = prime_math.compute_score(output, truth)
    assert (is_correct, answer) == (correct, extracted)


def test_prime_math_format_flag_and_dispatch():
    assert prime_math.compute_score("Step 1: x\nStep 2: \\boxed{4}", "5")[1] is True  # format only
    assert prime_math.compute_score("\\boxed{4}", "5")[1] is False
    assert prime_math.match_answer("The answer is 42.") == (True, "42.")
    assert prime_math.match_answer("no digits") == (False, "no digits")
    assert default_compute_score("numina_cn_k12", "answer: 7", "7") == 1.0
    assert default_compute_score("numina_olympiads", "answer: 8", "7") == 0.0


def test_prime_math_never_runs_model_output_as_python(tmp_path):
    marker = tmp_path / "ran"
    attack = f"().__class__.__base__.__subclasses__() or open({str(marker)!r}, 'w')"
    assert prime_math.compute_score(f"\\boxed{{{attack}}}", "1")[0] is False
    assert not marker.exists()
    for text in ("__import__('os')", "lambda: 1", "x.real", "10**100000", "'a'"):
        with pytest.raises(grader.UnsafeExpression):
            grader.parse_expr_safely(text)
    assert str(grader.parse_expr_safely("open(1) + 1")) == "open(1) + 1"  # an unknown function, not a call
    assert grader.handle_pi("2\\pi", 3.0) == 6.0 and grader.handle_pi("x\\pi", 3.0) == "x1*3.0"


# --- geo3k ---------------------------------------------------------------------------------------


def test_geo3k_accuracy_and_format():
    right = "<think>angles sum to 180</think> The answer is \\boxed{30}"
    assert geo3k.compute_score(right, "30") == pytest.approx(1.0)  # 0.9 * 1 + 0.1 * 1
    assert geo3k.compute_score("\\boxed{30}", "30") == pytest.approx(0.9)  # no <think>: no format
    assert geo3k.compute_score("<think>x</think>\\boxed{31}", "30") == pytest.approx(0.1)
    assert geo3k.compute_score("30", "30") == 0.0  # no box: "None" is graded
    assert geo3k.extract_boxed_content("\\boxed{\\frac{1}{2}} and \\boxed{2\\sqrt{3}}") == "2\\sqrt{3}"
    assert geo3k.extract_boxed_content("\\boxed{1") == "None"
    assert geo3k.compute_score("<think>.</think>\\boxed{2 \\sqrt{3}}", "2\\sqrt{3}") == pytest.approx(1.0)
    assert default_compute_score("hiyouga/geometry3k", "\\boxed{30}", "30") == pytest.approx(0.9)


# --- search_r1_like_qa_em ------------------------------------------------------------------------


def test_search_r1_exact_match_and_format_scores():
    truth = {"target": ["The Beatles", "Beatles"]}
    assert search_r1_like_qa_em.compute_score("<answer> the beatles! </answer>", truth) == 1.0
    # the last <answer> counts; no tag scores 0; a wrong answer scores format_score
    assert search_r1_like_qa_em.compute_score("<answer>x</answer><answer>Beatles</answer>", truth) == 1.0
    assert search_r1_like_qa_em.compute_score("Beatles", truth) == 0
    assert search_r1_like_qa_em.compute_score("<answer>Queen</answer>", truth, format_score=0.2) == 0.2
    # more than 10 answer tags: a quarter of the score
    spam = "<answer>a</answer>" * 10 + "<answer>Beatles</answer>"
    assert search_r1_like_qa_em.compute_score(spam, truth) == 0.25
    assert search_r1_like_qa_em.compute_score_subem("<answer>they were the Beatles</answer>", truth) == 1.0
    assert search_r1_like_qa_em.normalize_answer("  An  Apple, the pie.") == "apple pie"
    assert search_r1_like_qa_em.em_check("paris", "Paris") == 1
