"""Rule-based scorers (gsm8k, MATH, arithmetic) and the data_source registry."""

import pytest

from hybridflow.utils.reward_score import SCORERS, arithmetic, default_compute_score, gsm8k, register_scorer
from hybridflow.utils.reward_score import math as math_score


# --------------------------------------------------------------------------------------------- gsm8k
@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("so #### 72", "strict", "72"),
        ("#### 1 then fixed: #### 1,234", "strict", "1234"),  # last occurrence, commas stripped
        ("#### -5", "strict", "-5"),
        ("the answer is 72", "strict", None),
        ("####72", "strict", None),  # verl's strict format needs the space
        ("I think 12, no 1,000.", "flexible", "1,000."),  # verl's flexible: the last token, verbatim
        ("no digits here", "flexible", None),
        ("x = 3. Then 4 .", "flexible", "4"),
        ("costs 2.50 dollars", "flexible", "2.50"),
        ("only . here", "flexible", "."),  # verl: with no valid token its loop leaves the first one
        ("#### 72" + " filler" * 60, "strict", None),  # 420 chars after the answer: outside the last 300
        ("x" * 1000 + "#### 5", "strict", "5"),
    ],
)
def test_gsm8k_extract_solution(text, method, expected):
    assert gsm8k.extract_solution(text, method=method) == expected


def test_gsm8k_scores():
    assert default_compute_score("openai/gsm8k", "12 + 60 = 72\n#### 72", "72") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 71", "72") == 0.0
    assert default_compute_score("openai/gsm8k", "72", "72") == 0.0  # strict: no #### -> 0
    assert default_compute_score("openai/gsm8k", "72", "72", method="flexible") == 1.0
    # verl's signature: compute_score(solution_str, ground_truth, method, format_score, score)
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no answer", "72", format_score=0.1) == 0.0  # nothing extracted: 0
    assert gsm8k.compute_score("#### 72", 72, score=2.0) == 2.0  # an int ground truth compares as str
    # verl's strictness: the flexible answer is compared verbatim, so "72." and "1,000" do not match.
    assert gsm8k.compute_score("The answer is 72.", "72", method="flexible") == 0.0
    assert gsm8k.compute_score("So 1,000 apples", "1000", method="flexible") == 0.0
    assert gsm8k.compute_score("#### 1,000", "1000") == 1.0  # strict strips commas
    with pytest.raises(ValueError, match="strict.*flexible"):
        gsm8k.extract_solution("#### 1", method="loose")


# ---------------------------------------------------------------------------------------------- math
def test_last_boxed_only_string_balances_braces():
    text = r"first \boxed{1} then \boxed{\frac{a}{b+{c}}} tail"
    assert math_score.last_boxed_only_string(text) == r"\boxed{\frac{a}{b+{c}}}"
    assert math_score.remove_boxed(r"\boxed{\frac{a}{b+{c}}}") == r"\frac{a}{b+{c}}"
    assert math_score.last_boxed_only_string(r"\boxed{unclosed") is None
    assert math_score.last_boxed_only_string("no box") is None
    assert math_score.last_boxed_only_string(r"\fbox{7}") == r"\fbox{7}"
    assert math_score.remove_boxed(r"\boxed 5") == "5"
    # verl: a "\boxed " (space form) anywhere wins, cut at the next "$".
    assert math_score.last_boxed_only_string(r"\boxed{1} and \boxed 5$ tail") == r"\boxed 5"
    with pytest.raises(ValueError, match="not of the form"):
        math_score.remove_boxed(r"\fbox{7}")
    assert math_score.compute_score(r"\fbox{7}", "7") == 0.0  # verl cannot unbox \fbox: no score


@pytest.mark.parametrize(
    "answer, truth",
    [
        (r"\frac12", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        (r"\dfrac{3}{4}", "3/4"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^\circ", "90"),
        (r"\$18.90", "18.90"),
        (r"x = 5", "5"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"5\text{ cm}", "5"),
        (r"50\%", "50"),
    ],
)
def test_math_string_normalisation_equivalences(answer, truth):
    assert math_score.is_equiv(answer, truth)
    solution = f"We get $\\boxed{{{answer}}}$."
    assert math_score.compute_score(solution, truth) == 1.0  # verl's signature


def test_math_fallback_scores():
    score = lambda text, truth: default_compute_score("lighteval/MATH", text, truth, use_math_verify=False)  # noqa: E731
    assert score(r"\boxed{1} no wait \boxed{2}", "2") == 1.0
    assert score(r"\boxed{1} no wait \boxed{2}", "1") == 0.0
    assert score("the answer is 2", "2") == 0.0  # no box, no score
    assert score(r"\boxed{3", "3") == 0.0
    assert not math_score.is_equiv("2", None) and math_score.is_equiv(None, None)


@pytest.mark.parametrize(
    "answer, truth, expected",
    [
        ("50%", "50", False),  # verl removes "\%" only, not a plain "%"
        ("$5", "5", False),  # ... and "\$" only, not a plain "$"
        (r"5\text{ cm}\text{ s}", "5", False),  # two "\text{ ": verl asserts -> raw strings compared
        (r"5\text{ cm}\text{ s}", r"5\text{ cm}\text{ s}", True),
        (r"2\sqrt", r"2\sqrt", True),  # a trailing \sqrt raises in verl's fix_sqrt -> raw equality
        ("x/2", r"\frac{x}{2}", False),  # only integer a/b is rewritten
        ("-1/2", r"\frac{-1}{2}", True),
        (r"k = \frac{1}{4}", "1/4", True),
    ],
)
def test_math_is_equiv_follows_verl_strictness(answer, truth, expected):
    assert math_score.is_equiv(answer, truth) is expected


def test_math_aliases_dispatch_to_the_same_scorer():
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert SCORERS.get(source) is math_score.score_math


def test_math_string_match_is_default_and_math_verify_is_opt_in():
    # 2/4 and 0.5 normalise to different strings (\frac{2}{4} vs \frac{1}{2}): the default says no.
    assert default_compute_score("lighteval/MATH", r"\boxed{\frac{2}{4}}", "0.5") == 0.0
    pytest.importorskip("math_verify")
    from hybridflow.utils.reward_score import math_verify

    assert default_compute_score("lighteval/MATH", r"\boxed{\frac{2}{4}}", "0.5", use_math_verify=True) == 1.0
    assert math_verify.compute_score(r"\boxed{3}", "4") == 0.0
    assert math_verify.compute_score(r"so the answer is $\boxed{\frac{2}{4}}$", "0.5") == 1.0


def test_math_reward_module_is_verl_alias():
    from hybridflow.utils.reward_score import math_reward

    assert math_reward.compute_score is math_score.compute_score


# ---------------------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    "text, truth, expected",
    [
        ("132", "132", 1.0),
        ("The answer is 132.", "132", 1.0),
        ("12, no: 132", "132", 1.0),
        ("132 or maybe 12", "132", 0.0),  # the last integer counts
        ("-17", "-17", 1.0),
        ("5-3 gives 2", "2", 1.0),
        ("no number", "1", 0.0),
        ("1320", "132", 0.0),
    ],
)
def test_arithmetic_scorer(text, truth, expected):
    assert default_compute_score("hybridflow/arithmetic", text, truth) == expected


def test_arithmetic_last_integer():
    assert arithmetic.last_integer("a -12 b 7-3") == 3
    assert arithmetic.last_integer("") is None


# ------------------------------------------------------------------------------------------ registry
def test_unknown_data_source_lists_registered_ones():
    with pytest.raises(KeyError, match="'nope/data'.*hybridflow/arithmetic.*openai/gsm8k"):
        default_compute_score("nope/data", "1", "1")


def test_register_scorer_dict_results_and_conflicts():
    @register_scorer("tests/dict_scorer")
    def dict_scorer(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1, "acc": solution_str == ground_truth, "seen_extra": extra_info}

    result = default_compute_score("tests/dict_scorer", "a", "a", {"k": 1})
    assert result == {"score": 1, "acc": True, "seen_extra": {"k": 1}}

    @register_scorer("tests/no_score_key")
    def bad(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    with pytest.raises(ValueError, match="without 'score'"):
        default_compute_score("tests/no_score_key", "a", "a")
    with pytest.raises(ValueError, match="already registered"):
        register_scorer("openai/gsm8k")(bad)


def test_numbers_come_back_as_float():
    @register_scorer("tests/bool_scorer")
    def bool_scorer(data_source, solution_str, ground_truth, extra_info=None):
        return solution_str == ground_truth

    value = default_compute_score("tests/bool_scorer", "x", "x")
    assert value == 1.0 and type(value) is float


# ------------------------------------------------------------------------------------ reward kwargs
def test_reward_kwargs_reach_only_the_scorers_that_take_them():
    """A run mixing MATH, gsm8k and arithmetic rows with use_math_verify and gsm8k's method: each scorer
    gets only its own keywords (gsm8k used to crash on use_math_verify)."""
    kwargs = {"use_math_verify": True, "method": "flexible"}
    # Math-Verify's equivalence: 2/4 == 0.5 (verl's string equivalence says 0, tested above)
    assert default_compute_score("lighteval/MATH", r"\boxed{\frac{2}{4}}", "0.5", **kwargs) == 1.0
    # flexible: the last number counts without '####' (strict gives 0, tested above)
    assert default_compute_score("openai/gsm8k", "so 72", "72", **kwargs) == 1.0
    assert default_compute_score("hybridflow/arithmetic", "it is 9", "9", **kwargs) == 1.0
    assert default_compute_score("openai/gsm8k", "#### 71", "72", format_score=0.25) == 0.25


def test_reward_kwarg_that_no_scorer_takes_is_an_error():
    from hybridflow.utils.reward_score import ScoreKwargsError

    with pytest.raises(ScoreKwargsError) as err:
        default_compute_score("openai/gsm8k", "#### 72", "72", use_math_verify=True, math_verfy=True)
    message = str(err.value)
    assert "'math_verfy' is accepted by no registered scorer" in message
    assert "openai/gsm8k accepts format_score, method, score" in message
    assert "lighteval/MATH accepts use_math_verify" in message
    assert "hybridflow/arithmetic accepts none" in message
    assert "use_math_verify'" not in message  # taken by the MATH scorer: not a problem


def test_score_kwargs_problems_name_the_run_scorers():
    from hybridflow.utils.reward_score import score_kwargs_problems

    assert score_kwargs_problems(["use_math_verify", "method"], ["openai/gsm8k", "lighteval/MATH"]) == []
    run = ["openai/gsm8k", "hybridflow/arithmetic"]
    (problem,) = score_kwargs_problems(["use_math_verify", "method"], run)
    assert problem.startswith("reward kwarg 'use_math_verify' is accepted by no scorer of this run's data")
    others = "DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, lighteval/MATH"
    assert f"other data sources take it: {others}" in problem
    assert "hybridflow/arithmetic accepts none; openai/gsm8k accepts format_score, method, score" in problem
    # a data source with no scorer is left to the dispatcher's own error
    assert score_kwargs_problems(["method"], ["openai/gsm8k", "no/such_source"]) == []


def test_a_scorer_with_var_kwargs_takes_every_keyword():
    from hybridflow.utils.reward_score import accepted_kwargs, kwargs_for_scorer

    def open_scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return kwargs

    def named_scorer(data_source, solution_str, ground_truth, extra_info=None, *, scale=1.0):
        return scale

    assert accepted_kwargs(open_scorer) is None
    assert accepted_kwargs(named_scorer) == frozenset({"scale"})
    assert kwargs_for_scorer(open_scorer, {"a": 1, "method": "x"}) == {"a": 1, "method": "x"}
    assert kwargs_for_scorer(named_scorer, {"scale": 2.0, "method": "x"}) == {"scale": 2.0}
