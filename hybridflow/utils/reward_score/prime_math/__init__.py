r"""PRIME's math scorer, verl's ``verl.utils.reward_score.prime_math`` (the NuminaMath data sources).

:func:`compute_score` ``(model_output, ground_truth) -> (correct, format_correct, extracted)``:

1. :func:`match_answer` extracts the answer: the text after the last "answer:" / "answer is" /
   "answers are", before "is the answer"..., the content of the last ``\boxed{}``, then the part after
   the last "be ", "is ", "=", ": ", "get "...; it counts as matched only if it holds a digit.
2. :func:`grade_answer` (PRM800K's grader) accepts it when it equals the ground truth after Hendrycks'
   normalisation, or after PRM800K's (``\text{}``, units, ``%`` and ``$`` dropped, LaTeX turned into
   text by pylatexenc, case ignored), element by element for tuples and intervals, where sympy can
   simplify the difference to 0. Unreduced fractions must match exactly, and an integer ground truth
   wants an integer answer.
3. Otherwise :func:`.grader.math_equal` (numbers within 1e-4, also as a percentage, symbolic equality;
   with ``\pi`` in either answer, pi as 3.14159... or as 3.14).

``format_correct`` is verl's: the output holds "Step 2:" and ``\box``. The dispatcher scores
``float(correct)``. Needs sympy and pylatexenc (``pip install 'hybridflow[math]'``); they are imported
at the first call. Nothing from the model output is run as Python (see :mod:`.grader`).
"""

from __future__ import annotations

import math
import re
from functools import cache

from hybridflow.utils.reward_score.prime_math import math_normalize
from hybridflow.utils.reward_score.prime_math.grader import math_equal, parse_expr_safely, time_limit
from hybridflow.utils.reward_score.registry import register_scorer

NUMINA_DATA_SOURCES = (
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)
SYMPY_TIMEOUT_S = 10.0  # verl's limit on are_equal_under_sympy
BAD_SUBSTRINGS = ["^{", "^("]  # sympy might hang on these: not worth being lenient
BAD_REGEXES = [r"\^[0-9]+\^", r"\^[0-9][0-9]+"]
TUPLE_CHARS = "()[]"
UNITS = [
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
    "year", "foot", "feet", "inch", "yard", "liter",
]  # fmt: skip
_LATEX_SYMBOLS = {"√": "sqrt", "π": "pi", "∞": "inf", "∪": "U", "·": "*", "×": "*"}


@cache
def _latex_to_text():
    try:
        from pylatexenc import latex2text
    except ImportError as err:
        raise ImportError("prime_math and geo3k need pylatexenc: pip install 'hybridflow[math]'") from err
    return latex2text.LatexNodes2Text()


def _parse_latex(expr: str) -> str:
    """LaTeX as text sympy can read (``\\frac{1}{2}`` -> ``1/2``, ``\\sqrt{2}`` -> ``sqrt(2)``)."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # mixed numbers: 3\frac12 -> 3 1/2
    expr = _latex_to_text().latex_to_text(expr)
    for symbol, name in _LATEX_SYMBOLS.items():
        expr = expr.replace(symbol, name)
    return expr.strip()


def _is_float(num: str) -> bool:
    try:
        float(num)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # inf, nan
        return False


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def _str_is_int(x: str) -> bool:
    try:
        return _is_int(float(_strip_properly_formatted_commas(x)))
    except Exception:
        return False


def _str_to_int(x: str) -> int:
    return int(float(x.replace(",", "")))


def _inject_implicit_mixed_number(step: str) -> str:
    """``7 3/4`` -> ``7+3/4``."""
    return re.sub(r"([0-9]) +([0-9])", r"\1+\2", step)


def _strip_properly_formatted_commas(expr: str) -> str:
    """``1,000,000`` -> ``1000000``, leaving tuple commas (``(1,2)``) alone."""
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        next_expr = pattern.sub(r"\1\3\4", expr)
        if next_expr == expr:
            return next_expr
        expr = next_expr


def _normalize(expr: str | None, mathruler: bool = False) -> str | None:
    """PRM800K's normal form; ``mathruler``: MathRuler's variant (no "liter" unit; spaces and braces
    dropped at the end), which geo3k grades with."""
    if expr is None:
        return None
    match = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if match is not None:
        expr = match.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in UNITS[:-1] if mathruler else UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _parse_latex(expr)
        except ImportError:
            raise
        except Exception:  # pylatexenc gives up on some LaTeX: keep it as it is
            pass
    expr = re.sub("- *", "-", expr)  # mixed numbers with negative signs
    expr = _inject_implicit_mixed_number(expr)
    if mathruler:
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()  # text answers are not case sensitive
    if _str_is_int(expr):
        expr = str(_str_to_int(expr))
    return expr


def count_unknown_letters_in_expr(expr: str) -> int:
    expr = expr.replace("sqrt", "").replace("frac", "")
    return len({x for x in expr if x.isalpha()})


def should_allow_eval(expr: str) -> bool:
    """Not for unknown text, functions of more than two variables, or powers sympy may hang on."""
    if count_unknown_letters_in_expr(expr) > 2:
        return False
    if any(bad in expr for bad in BAD_SUBSTRINGS):
        return False
    return all(re.search(bad, expr) is None for bad in BAD_REGEXES)


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    """sympy simplifies ``(truth) - (given)`` to 0, within :data:`SYMPY_TIMEOUT_S`."""
    from sympy import simplify
    from sympy.parsing import sympy_parser

    expr = f"({ground_truth_normalized})-({given_normalized})"
    if not should_allow_eval(expr):
        return False
    implicit = (sympy_parser.implicit_multiplication_application,)
    transformations = sympy_parser.standard_transformations + implicit
    try:
        with time_limit(SYMPY_TIMEOUT_S):
            return simplify(parse_expr_safely(expr.replace("^", "**"), transformations)) == 0
    except Exception:  # a parse error, a timeout (TimeoutError), UnsafeExpression
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple or interval (``(1, 2]`` -> ``["1", "2"]``), else ``[expr]``."""
    expr = _strip_properly_formatted_commas(expr)
    if len(expr) == 0:
        return []
    if (
        len(expr) > 2
        and expr[0] in TUPLE_CHARS
        and expr[-1] in TUPLE_CHARS
        and all(ch not in expr[1:-1] for ch in TUPLE_CHARS)
    ):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def _elements_equal(truth: str, given: str) -> bool:
    if _is_frac(truth) and _is_frac(given):
        return truth == given  # an unreduced fraction is not the answer
    if _str_is_int(truth) != _str_is_int(given):
        return False  # an integer answer must match exactly
    return are_equal_under_sympy(truth, given)


def grade_answer(given_answer: str | None, ground_truth: str, mathruler: bool = False) -> bool:
    """PRM800K's check (module docstring, step 2); ``mathruler``: MathRuler's variant of it."""
    if given_answer is None:
        return False
    truth_mathd = math_normalize.normalize_answer(ground_truth, drop_percent=mathruler)
    if truth_mathd == math_normalize.normalize_answer(given_answer, drop_percent=mathruler):
        return True
    truth, given = _normalize(ground_truth, mathruler), _normalize(given_answer, mathruler)
    if truth is None:
        return False
    if truth == given:
        return True
    if len(given) == 0:
        return False
    truth_elems, given_elems = split_tuple(truth), split_tuple(given)
    if len(truth_elems) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # different brackets: (a, b) is not [a, b]
    if len(truth_elems) != len(given_elems):
        return False
    return all(_elements_equal(t, g) for t, g in zip(truth_elems, given_elems))


def remove_boxed(s: str) -> str | None:
    r"""``\boxed{x}`` -> ``x``; None for anything else."""
    left = "\\boxed{"
    return s[len(left) : -1] if s.startswith(left) and s.endswith("}") else None


def _last_boxed_only_string(string: str) -> str | None:
    r"""The stripped content of the last ``\boxed`` (or ``\fbox``) group, or None."""
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    left = right = None
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
            left = i if left is None else left
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                right = i
                break
    if left is None or right is None:
        return None
    return string[left + 1 : right].strip()


def _after_last(response: str, markers: list[str]) -> tuple[bool, str]:
    """For each marker in turn, keep what follows its last occurrence (a trailing newline clipped as verl
    does, two characters); ``(any found, text)``."""
    found = False
    for marker in markers:
        idx = response.lower().rfind(marker)
        if idx != -1:
            found = True
            response = response[idx + len(marker) :].strip()
            if response.endswith("\n"):
                response = response[:-2]
    return found, response


def match_answer(response: str) -> tuple[bool, str]:
    """``(matched, answer)`` extracted from a response (module docstring, step 1)."""
    matched, response = _after_last(response, ["answer:", "answer is", "answers are"])
    for marker in ["is answer", "is the answer", "are answers", "are the answers"]:
        idx = response.lower().rfind(marker)
        if idx != -1:
            matched = True
            response = response[:idx].strip()
            if response.endswith("\n"):
                response = response[:-2]
    boxed = _last_boxed_only_string(response)
    if boxed:
        matched, response = True, boxed
    if ". " in response:
        response = response[: response.lower().rfind(". ")].strip()
    markers = ["be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"]
    found, response = _after_last(response, markers)
    matched = (matched or found) and any(c.isdigit() for c in response)  # an answer has a digit
    return matched, response


def compute_score(model_output: str, ground_truth: str) -> tuple[bool, bool, str]:
    """``(correct, format_correct, extracted answer)`` (module docstring)."""
    model_output, ground_truth = str(model_output), str(ground_truth)
    _, extracted = match_answer(model_output)
    format_correctness = "Step 2:" in model_output and "\\box" in model_output
    if grade_answer(extracted, ground_truth):
        return True, True, extracted
    try:
        if "\\pi" in extracted or "\\pi" in ground_truth:
            pis = (math.pi, 3.14)
            is_correct = any(math_equal(extracted, ground_truth, timeout=True, pi=pi) for pi in pis)
        else:
            is_correct = math_equal(extracted, ground_truth, timeout=True)
    except ImportError:
        raise
    except Exception:  # verl: any failure of the lenient check is a wrong answer
        is_correct = False
    return is_correct, format_correctness, extracted


@register_scorer(*NUMINA_DATA_SOURCES)
def score_prime_math(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
    """verl's ``numina_*`` branch: ``float(correct)`` of :func:`compute_score`."""
    return float(compute_score(solution_str, ground_truth)[0])
