r"""MATH scorer, verl's ``verl.utils.reward_score.math``: the last ``\boxed{...}`` of a response against
the ground truth after Hendrycks et al.'s string normalisation ("Measuring Mathematical Problem
Solving With the MATH Dataset", 2021, as in lm-evaluation-harness).

:func:`strip_string` removes line breaks, ``\!``, ``\left``/``\right``, degrees, ``\$``, ``\%`` and
a trailing ``\text{ unit}``; rewrites ``tfrac``/``dfrac``, ``\frac12``, ``\sqrt2``, integer ``a/b``,
``0.5``, a leading ``.`` and a short ``k = `` prefix to one canonical form. Plain ``$`` and ``%``
are kept, as in verl. When normalising raises (odd inputs verl's code asserts on), :func:`is_equiv`
falls back to comparing the raw strings, and :func:`compute_score` scores an answer it cannot
unbox (``\fbox{...}``) as 0 — both as verl does.

This string match is the default. Math-Verify (symbolic equivalence) is opt-in: pass
``use_math_verify=True`` through ``default_compute_score`` / ``reward_kwargs``, or call
:func:`hybridflow.utils.reward_score.math_verify.compute_score` (verl's ``math_verify`` module).
"""

from __future__ import annotations

from hybridflow.utils.reward_score.registry import register_scorer


def last_boxed_only_string(string: str) -> str | None:
    r"""The last ``\boxed{...}`` (or ``\fbox{...}``) with balanced braces, or None.

    As in verl, a ``\boxed `` (with a space) anywhere wins: everything after the last one, up to a
    ``$``, is returned as ``"\boxed " + rest``."""
    if "\\boxed " in string:
        return "\\boxed " + string.split("\\boxed ")[-1].split("$")[0]
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[idx : i + 1]
    return None


def remove_boxed(s: str) -> str:
    r"""``\boxed{x}`` → ``x`` and ``\boxed x`` → ``x``; ValueError for anything else (``\fbox`` too)."""
    if "\\boxed " in s:
        if not s.startswith("\\boxed "):
            raise ValueError(f"remove_boxed: {s!r} does not start with '\\boxed '")
        return s[len("\\boxed ") :]
    if not (s.startswith("\\boxed{") and s.endswith("}")):
        raise ValueError(f"remove_boxed: {s!r} is not of the form \\boxed{{...}}")
    return s[len("\\boxed{") : -1]


def fix_fracs(string: str) -> str:
    r"""``\frac12`` → ``\frac{1}{2}``, ``\frac1{72}`` → ``\frac{1}{72}`` (not ``\frac{72}1``)."""
    parts = string.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part[0] == "{":  # an empty part (a trailing \frac) raises IndexError, as in verl
            out += part
            continue
        if len(part) < 2:
            return string
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def fix_a_slash_b(string: str) -> str:
    r"""``3/4`` → ``\frac{3}{4}`` when both sides are integers written canonically; else unchanged."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    return f"\\frac{{{a}}}{{{b}}}" if string == f"{a}/{b}" else string


def remove_right_units(string: str) -> str:
    r"""``5\text{ cm}`` → ``5``; two or more ``\text{ `` raise ValueError (verl asserts)."""
    if "\\text{ " not in string:
        return string
    splits = string.split("\\text{ ")
    if len(splits) != 2:
        raise ValueError(f"remove_right_units: more than one '\\text{{ ' in {string!r}")
    return splits[0]


def fix_sqrt(string: str) -> str:
    r"""``\sqrt3`` → ``\sqrt{3}`` (one character); a trailing ``\sqrt`` raises IndexError as in verl."""
    if "\\sqrt" not in string:
        return string
    splits = string.split("\\sqrt")
    out = splits[0]
    for split in splits[1:]:
        out += "\\sqrt" + split if split[0] == "{" else "\\sqrt{" + split[0] + "}" + split[1:]
    return out


def strip_string(string: str) -> str:
    """verl's (Hendrycks') answer normalisation; see the module docstring for the rules."""
    string = string.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "")
    string = remove_right_units(string)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> " 3"
        string = sides[1]
    string = fix_sqrt(string).replace(" ", "")
    string = fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return fix_a_slash_b(string)


def is_equiv(str1: str | None, str2: str | None, verbose: bool = False) -> bool:
    """Equal after :func:`strip_string` (raw equality if normalising fails); two Nones are equal."""
    if str1 is None or str2 is None:
        return str1 is None and str2 is None
    try:
        ss1, ss2 = strip_string(str1), strip_string(str2)
    except Exception:  # verl's normaliser asserts/indexes on odd input: compare the raw strings
        return str1 == str2
    if verbose:
        print(ss1, ss2)
    return ss1 == ss2


def compute_score(solution_str: str, ground_truth: str) -> float:
    r"""1.0 if the last ``\boxed{...}`` of ``solution_str`` is equivalent to ``ground_truth``, else 0.0
    (verl's signature; an answer that cannot be unboxed scores 0)."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = remove_boxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0


@register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def score_math(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    use_math_verify: bool = False,
) -> float:
    """:func:`compute_score` under the dispatch signature; ``use_math_verify=True`` scores with
    Math-Verify instead (:mod:`hybridflow.utils.reward_score.math_verify`)."""
    if use_math_verify:
        from hybridflow.utils.reward_score import math_verify

        return math_verify.compute_score(solution_str, str(ground_truth))
    return compute_score(solution_str, str(ground_truth))
