"""MATH scorer: compare the last ``\\boxed{...}`` of a response with the ground truth.

When ``math_verify`` (Hugging Face Math-Verify) is importable, equivalence is decided by its
``parse``/``verify`` (symbolic); otherwise, and whenever it errors, by verl's string normalisation
(Hendrycks et al., "Measuring Mathematical Problem Solving With the MATH Dataset", 2021):
strip spaces, ``\\left``/``\\right``, units in ``\\text{}``, degrees, dollars, percent; rewrite
``\\dfrac``/``\\tfrac``, ``\\frac12``, ``a/b`` and ``\\sqrt2`` to one canonical form; then ``==``.
"""

from __future__ import annotations

import re

from hybridflow.utils.reward_score import register_scorer


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``) with balanced braces, or None."""
    idx = text.rfind("\\boxed")
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    if text.startswith("\\boxed ", idx):
        return "\\boxed " + text[idx + len("\\boxed ") :].split("$")[0]
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : i + 1]
    return None


def remove_boxed(boxed: str) -> str | None:
    """``\\boxed{x}`` → ``x`` (also ``\\fbox{x}`` and ``\\boxed x``); None if not of that form."""
    for left in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(left):
            inner = boxed[len(left) :]
            if left.endswith("{"):
                return inner[:-1] if inner.endswith("}") else None
            return inner
    return None


def _fix_fracs(s: str) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\frac1{72}`` → ``\\frac{1}{72}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{"):
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` (plain integers) → ``\\frac{3}{4}``."""
    match = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}" if match else s


def _remove_right_units(s: str) -> str:
    """``5\\text{ cm}`` → ``5`` (units written as a trailing ``\\text{ ...}``)."""
    return s.split("\\text{ ")[0] if "\\text{ " in s else s


def _fix_sqrt(s: str) -> str:
    """``\\sqrt2`` → ``\\sqrt{2}``."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def strip_string(s: str) -> str:
    """verl/Hendrycks MATH answer normalisation (see the module docstring)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = _remove_right_units(s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    lhs_rhs = s.split("=")
    if len(lhs_rhs) == 2 and len(lhs_rhs[0]) <= 2:  # "k = 3" -> "3"
        s = lhs_rhs[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    """String equivalence after :func:`strip_string`."""
    if a is None or b is None:
        return a is None and b is None
    return strip_string(a) == strip_string(b)


def _math_verify_equiv(answer: str, ground_truth: str) -> bool | None:
    """Math-Verify's verdict, or None when the package is missing or fails on these strings."""
    try:
        import math_verify
    except ImportError:
        return None
    try:
        gold = math_verify.parse("\\boxed{" + ground_truth + "}")
        pred = math_verify.parse("\\boxed{" + answer + "}")
        return bool(math_verify.verify(gold, pred)) if gold and pred else None
    except Exception:  # its parser raises on odd LaTeX and times out via signals: fall back
        return None


@register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    use_math_verify: bool = True,
) -> float:
    """1.0 if the last boxed answer equals ``ground_truth`` (Math-Verify, else normalised strings)."""
    boxed = last_boxed_only_string(solution_str)
    answer = remove_boxed(boxed) if boxed is not None else None
    if answer is None:
        return 0.0
    verdict = _math_verify_equiv(answer, str(ground_truth)) if use_math_verify else None
    if verdict is None:
        verdict = is_equiv(answer, str(ground_truth))
    return 1.0 if verdict else 0.0
