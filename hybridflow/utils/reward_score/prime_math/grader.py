r"""verl's ``verl.utils.reward_score.prime_math.grader``: ``math_equal``, the second, more lenient check.

After Hendrycks' MATH, ToRA's and PRM800K's graders, as PRIME uses them: two answers are equal when they
match as strings (case and spaces aside), as numbers (relative tolerance 1e-4, also x/100 and x*100 of
the reference, so ``50`` matches ``0.5``), element by element as intervals, tuples or matrices, or
symbolically (``simplify(a - b) == 0`` or numerically close).

Model output is never evaluated as Python here, where verl calls ``eval`` and sympy's ``parse_expr``
(itself ``eval``) on it: :func:`parse_expr_safely` refuses underscores, quotes, attribute access and
keywords, and evaluates with only sympy's mathematical names in scope (any other name becomes a
symbol); ``\pi`` products are computed by :func:`_arithmetic` (numbers and + - * / ** only); matrices
are read with ``ast.literal_eval``. LaTeX goes to sympy's ``parse_latex`` as in verl (it needs antlr4
4.11; with the 4.9.3 that hydra pins it fails and the answer stays a string, in verl too).

Each parse and simplification has its time limit (:func:`time_limit`: SIGALRM, in the main thread
only). verl's ``symbolic_equal`` means the same but uses its ``timeout_limit`` decorator as a context
manager, which raises, so in verl this symbolic step never succeeds; here it does what verl's code says.
"""

from __future__ import annotations

import ast
import contextlib
import keyword
import math
import operator
import re
import signal
import threading
from collections.abc import Iterator
from functools import cache
from math import isclose
from typing import Any

MAX_PARSE_CHARS = 1000  # verl clips predictions to this many characters
# sympy's names that stay names when parsing (anything else becomes a Symbol): the mathematical ones
SYMPY_NAMES = (
    "Abs", "E", "Float", "Function", "I", "Integer", "Interval", "Matrix", "N", "O", "Point", "Q",
    "Rational", "S", "Symbol", "Union", "acos", "acot", "asin", "atan", "binomial", "cbrt", "ceiling",
    "cos", "cosh", "cot", "csc", "exp", "factorial", "floor", "gamma", "im", "ln", "log", "nan", "oo",
    "pi", "re", "root", "sec", "sin", "sinh", "sqrt", "tan", "tanh", "zoo",
)  # fmt: skip
_UNSAFE_CHARS = frozenset("_'\"`;:@#$\\")
_ATTRIBUTE = re.compile(r"\.\s*[A-Za-z]")
_POWER_BOMB = re.compile(r"(\*\*|\^)\s*\(?\s*[0-9]{4,}|[0-9]{5,}\s*!")  # 10**10000, 99999!
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_ARITHMETIC = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


class UnsafeExpression(ValueError):
    """Text that :func:`parse_expr_safely` will not hand to sympy's evaluator."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``TimeoutError`` in the block after ``seconds`` (SIGALRM; elsewhere than the main thread, or
    with ``None``, no limit: the reward manager's own per-sample limit still applies)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"prime_math: timed out after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@cache
def _sympy_globals() -> dict[str, Any]:
    import sympy

    return {"__builtins__": {}, **{name: getattr(sympy, name) for name in SYMPY_NAMES}}


def parse_expr_safely(text: str, transformations: Any = None):
    """sympy's ``parse_expr`` on model output without running anything but arithmetic: ``UnsafeExpression``
    for text with underscores, quotes, attribute access, Python keywords or huge powers."""
    from sympy.parsing import sympy_parser

    if len(text) > MAX_PARSE_CHARS:
        raise UnsafeExpression(f"more than {MAX_PARSE_CHARS} characters")
    if _UNSAFE_CHARS.intersection(text) or _ATTRIBUTE.search(text) or _POWER_BOMB.search(text):
        raise UnsafeExpression(f"not a plain expression: {text[:80]!r}")
    if any(keyword.iskeyword(name) for name in _NAME.findall(text)):
        raise UnsafeExpression(f"a Python keyword in {text[:80]!r}")
    transformations = transformations or sympy_parser.standard_transformations
    return sympy_parser.parse_expr(text, global_dict=dict(_sympy_globals()), transformations=transformations)


def _arithmetic(text: str) -> float:
    """The value of a numbers-only expression (``2*3.14``); ValueError for anything else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _ARITHMETIC:
            return _ARITHMETIC[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _ARITHMETIC[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")

    return value(ast.parse(text, mode="eval").body)


def is_digit(s: Any) -> tuple[bool, float | None]:
    """``(True, value)`` when ``s`` reads as a number (``,`` and ``{,}`` thousands separators allowed)."""
    try:
        if "{,}" in str(s):
            return True, float(str(s).replace("{,}", ""))
        return True, float(str(s).replace(",", ""))
    except ValueError:
        return False, None


def normalize(answer: Any, pi: float) -> Any:
    r"""``$5`` -> ``5``, ``50%`` / ``50\%`` -> ``50``, ``101_2`` -> ``101`` (base dropped), ``2\pi`` -> a
    number."""
    if isinstance(answer, str) and re.match(r"\$\d+(\.\d+)?", answer):
        return answer[1:]
    if isinstance(answer, str) and re.match(r"^\d+(\.\d+)?(%|\\%)$", answer):
        return answer.replace("\\%", "").replace("%", "")
    return handle_pi(handle_base(answer), pi)


def handle_base(x: Any) -> Any:
    """``"101_2"`` -> ``101`` (the digits before ``_``, as a number; ValueError when they are not)."""
    if isinstance(x, str) and "_" in x:
        return int(float(x.split("_")[0]))
    return x


def handle_pi(string: Any, pi: float) -> Any:
    r"""Each ``\pi`` becomes ``*pi`` (after a digit) or ``1*pi``; the result is computed when it is
    plain arithmetic, else the substituted string is returned."""
    if not (isinstance(string, str) and "\\pi" in string):
        return string
    idx = string.find("\\pi")
    while idx != -1:
        factor = "*" if idx > 0 and string[idx - 1].isdigit() else "1*"
        string = string[:idx] + f"{factor}{pi}" + string[idx + 3 :]
        idx = string.find("\\pi", idx + 1)
    with contextlib.suppress(Exception):
        string = _arithmetic(string)
    return string


def _numbers_equal(prediction: float, reference: float, include_percentage: bool, tolerance: float) -> bool:
    candidates = [reference / 100, reference, reference * 100] if include_percentage else [reference]
    return any(isclose(item, prediction, rel_tol=tolerance) for item in candidates)


def _all_equal(pred_parts, ref_parts, include_percentage: bool, tolerance: float) -> bool:
    return len(pred_parts) == len(ref_parts) and all(
        math_equal(p, r, include_percentage, tolerance) for p, r in zip(pred_parts, ref_parts)
    )


def math_equal(
    prediction: bool | float | str,
    reference: float | str,
    include_percentage: bool = True,
    tolerance: float = 1e-4,
    timeout: float = 10.0,
    pi: float = math.pi,
) -> bool:
    """Whether ``prediction`` equals ``reference`` as strings, numbers, intervals/tuples, matrices or
    expressions (module docstring). ``timeout`` bounds each symbolic step in seconds (verl's
    ``compute_score`` passes ``True``: 1 s)."""
    prediction, reference = normalize(prediction, pi), normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > MAX_PARSE_CHARS:
        prediction = prediction[:MAX_PARSE_CHARS]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    pred_digit, ref_digit = is_digit(prediction), is_digit(reference)
    if pred_digit[0] and ref_digit[0]:
        return _numbers_equal(pred_digit[1], ref_digit[1], include_percentage, tolerance)
    if not prediction and prediction not in [0, False]:
        return False

    reference, prediction = str(reference).strip(), format_intervals(str(prediction).strip())
    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for bracket in "{}()":
        ref_str, pred_str = ref_str.replace(bracket, ""), pred_str.replace(bracket, "")
    if pred_str == ref_str:
        return True
    decided = _sequences_equal(prediction, reference, include_percentage, tolerance)
    if decided is not None:
        return decided
    if r"\begin{pmatrix}" in reference:
        if _matrix_equal(prediction, reference, include_percentage, tolerance):
            return True
    return symbolic_equal(prediction, reference, tolerance, timeout)


def _sequences_equal(
    prediction: str, reference: str, include_percentage: bool, tolerance: float
) -> bool | None:
    """Intervals ``[a, b]`` vs ``[c, d]`` with the same brackets, comma lists of the same length (these
    decide, equal or not, as in verl), ``Point(..)`` vs a tuple; None: undecided, look further."""
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and prediction[0] == reference[0]
        and prediction[-1] == reference[-1]
    ):
        if _all_equal(prediction[1:-1].split(","), reference[1:-1].split(","), include_percentage, tolerance):
            return True
    if "," in prediction and "," in reference:
        pred_parts = [item.strip() for item in prediction.split(",")]
        ref_parts = [item.strip() for item in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return _all_equal(pred_parts, ref_parts, include_percentage, tolerance)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pred_parts = prediction[prediction.find("(") + 1 : -1].split(",")
        if _all_equal(pred_parts, reference[1:-1].split(","), include_percentage, tolerance):
            return True
    return None


def _matrix_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
    r"""A ``Matrix(...)`` or ``[[...]]`` prediction against a ``\begin{pmatrix}`` reference."""
    if prediction.startswith("Matrix"):
        try:
            pred_matrix = parse_expr_safely(prediction)
            ref_items = reference.split()[1:-1:2]
            return len(pred_matrix) == len(ref_items) and all(
                math_equal(p, r, include_percentage, tolerance) for r, p in zip(ref_items, pred_matrix)
            )
        except Exception:
            return False
    if not (prediction.startswith("[") and prediction.endswith("]")):
        return False
    pred_matrix = ast.literal_eval(prediction)  # raises on a non-literal, as verl's eval does
    if not isinstance(pred_matrix, list):
        return False
    body = reference.removeprefix(r"\\begin{pmatrix}").removeprefix(r"\begin{pmatrix}")
    body = body.removesuffix(r"\\end{pmatrix}").removesuffix(r"\end{pmatrix}")
    rows = [row.split("&") if "&" in row else row for row in body.split("\\")]
    try:
        return len(pred_matrix) == len(rows) and all(
            math_equal(p, r, include_percentage, tolerance) for r, p in zip(rows, pred_matrix)
        )
    except Exception:
        return False


def symbolic_equal(a: str, b: str, tolerance: float, timeout: float = 10.0) -> bool:
    """``simplify(a - b) == 0`` or ``N(a) ≈ N(b)``, each parsed as an expression, else as LaTeX."""
    from sympy import N, simplify

    def parse(s: str):
        for parser in (parse_expr_safely, _latex_parser()):
            try:
                with time_limit(timeout):
                    return parser(s)
            except Exception:  # TimeoutError, UnsafeExpression, a parse error
                continue
        return s

    a, b = parse(a), parse(b)
    with contextlib.suppress(Exception):
        with time_limit(timeout):
            if simplify(a - b) == 0:
                return True
    with contextlib.suppress(Exception):
        with time_limit(timeout):
            if isclose(N(a), N(b), rel_tol=tolerance):
                return True
    return False


@cache
def _latex_parser():
    """sympy's ``parse_latex`` when its antlr4 runtime loads, else a parser that always fails (looked up
    once: a failed import is retried, slowly, at every call)."""
    from sympy.parsing.latex import parse_latex

    try:
        parse_latex("1")
    except ImportError:
        return _no_latex_parser
    return parse_latex


def _no_latex_parser(text: str):
    raise ValueError("sympy's LaTeX parser needs antlr4-python3-runtime 4.11")


def format_intervals(prediction: str) -> str:
    """sympy's ``Interval(a, b)`` (``.Ropen``, ``.Lopen``, ``.open``) written with brackets."""
    patterns = {
        r"^Interval\((.*)\)$": "[{}]",
        r"^Interval\.Ropen\((.*)\)$": "[{})",
        r"^Interval\.Lopen\((.*)\)$": "({}]",
        r"^Interval\.open\((.*)\)$": "({})",
    }
    for pattern, form in patterns.items():
        match = re.match(pattern, prediction)
        if match:
            return form.format(match.group(1))
    return prediction
