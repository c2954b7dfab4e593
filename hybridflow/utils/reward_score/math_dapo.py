r"""DAPO's math scorer, verl's ``verl.utils.reward_score.math_dapo`` (DAPO, Yu et al. 2025, after
Minerva's answer normalisation in lm-evaluation-harness's ``hendrycks_math``).

Only the last 300 characters of a response are read. The default grading (Minerva) takes the text after
the last ``Answer:`` (any case, up to the line's end) and compares it with the ground truth after
:func:`normalize_final_answer` (the part after the last ``=``; units, ``\text{}``, ``\boxed{}``, ``$``
and spaces dropped; ``\frac12`` -> ``\frac{1}{2}``; ``1,000`` -> ``1000``). ``strict_box_verify=True``
instead wants the last ``\boxed{...}`` of the last 100 characters to equal the ground truth verbatim.

:func:`compute_score` returns ``{"score": 1.0 or -1.0, "acc": bool, "pred": str}``: a wrong or missing
answer is -1, not 0, as DAPO trains it.
"""

from __future__ import annotations

import re

from hybridflow.utils.reward_score.registry import register_scorer, register_scorer_prefix

SOLUTION_CLIP_CHARS = 300  # the longest answer in MATH-500 has 159 characters
STRICT_BOX_CLIP_CHARS = 100
ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"
INVALID = "[INVALID]"

SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]  # fmt: skip

REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
]  # fmt: skip


def last_boxed_only_string(string: str) -> str | None:
    r"""The last ``\boxed{...}`` of ``string`` with balanced braces, or None (no ``\fbox``, no
    ``\boxed x``: this module's variant)."""
    idx = string.rfind("\\boxed{")
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
    r"""``\boxed{x}`` -> ``x``; ValueError for anything else."""
    left = "\\boxed{"
    if not (s.startswith(left) and s.endswith("}")):
        raise ValueError(f"math_dapo remove_boxed: {s!r} is not of the form \\boxed{{...}}")
    return s[len(left) : -1]


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalisation of a final answer (see the module docstring)."""
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expression in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expression, "")
    # keep the first $...$ span; unwrap \text{}, \textbf{}, \overline{}, \boxed{}
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    # shorthand TeX: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def is_correct_minerva(
    solution_str: str, gt: str, gt_need_extract: bool = False, answer_pattern: str = ANSWER_PATTERN
) -> tuple[bool, str]:
    """``(correct, normalised prediction)``: the last ``answer_pattern`` match against ``gt`` (itself
    unboxed first with ``gt_need_extract``); no match predicts ``[INVALID]``."""
    match = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(match[-1] if match else INVALID)
    if gt_need_extract:
        boxed = last_boxed_only_string(gt)
        if boxed is None:
            raise ValueError(f"math_dapo: gt_need_extract=True but the ground truth has no \\boxed: {gt!r}")
        gt = normalize_final_answer(remove_boxed(boxed))
    else:
        gt = normalize_final_answer(gt)
    return pred == gt, pred


def is_correct_strict_box(
    pred: str, gt: str, pause_tokens_index: list[int] | None = None
) -> tuple[int, str | None]:
    r"""``(1 or -1, boxed prediction)``: the last ``\boxed{}`` of the last 100 characters (after the
    last of four pause tokens, when their indices are given) equal to ``gt`` verbatim."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"math_dapo: pause_tokens_index needs 4 indices, got {pause_tokens_index!r}")
        pred = pred[pause_tokens_index[-1] - STRICT_BOX_CLIP_CHARS :]
    else:
        pred = pred[-STRICT_BOX_CLIP_CHARS:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(
    solution_str: str,
    answer: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> tuple[bool, str | None]:
    """``(correct, prediction)`` by strict-box or Minerva grading."""
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}`` for the last 300 characters."""
    clipped = solution_str[-SOLUTION_CLIP_CHARS:]
    correct, pred = verify(clipped, ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


@register_scorer("math_dapo", "math", "math_dapo_reasoning")
@register_scorer_prefix("aime")
def score_math_dapo(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict:
    """:func:`compute_score` under the dispatch signature (verl's ``math_dapo`` branch)."""
    return compute_score(solution_str, str(ground_truth), strict_box_verify, pause_tokens_index)
