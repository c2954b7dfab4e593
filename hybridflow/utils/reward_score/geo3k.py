r"""Geometry3K's scorer, verl's ``verl.utils.reward_score.geo3k`` (a vision-language task).

``(1 - format_score) * accuracy + format_score * format``: accuracy is 1 when the last ``\boxed{}``
answer grades equal to the ground truth by MathRuler's ``grade_answer`` (PRM800K's grader, which
:func:`hybridflow.utils.reward_score.prime_math.grade_answer` implements with ``mathruler=True``);
format is 1 when the whole response is ``<think>...</think>`` followed by a ``\boxed{...}``.
"""

from __future__ import annotations

import re

from hybridflow.utils.reward_score.prime_math import grade_answer
from hybridflow.utils.reward_score.registry import register_scorer

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def extract_boxed_content(text: str) -> str:
    r"""MathRuler's: the stripped content of the last ``\boxed{...}``, or the string ``"None"``."""
    start = text.rfind(r"\boxed{")
    if start == -1:
        return "None"
    content = text[start + len(r"\boxed{") :]
    depth = 0
    for i, char in enumerate(content):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == -1:
                return content[:i].strip()
    return "None"


def format_reward(predict_str: str) -> float:
    r"""1.0 when the response is ``<think>...</think>...\boxed{...}...``, else 0.0."""
    return 1.0 if _FORMAT.fullmatch(predict_str) else 0.0


def acc_reward(predict_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    r"""1.0 when the ``\boxed{}`` answer (the whole response without ``use_boxed``) is right, else 0.0."""
    answer = extract_boxed_content(predict_str) if use_boxed else predict_str
    return 1.0 if grade_answer(answer, ground_truth, mathruler=True) else 0.0


def compute_score(
    predict_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1
) -> float:
    """``(1 - format_score) * acc_reward + format_score * format_reward``."""
    accuracy = acc_reward(predict_str, ground_truth, use_boxed)
    return (1.0 - format_score) * accuracy + format_score * format_reward(predict_str)


@register_scorer("hiyouga/geometry3k")
def score_geo3k(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    use_boxed: bool = True,
) -> float:
    """:func:`compute_score` under the dispatch signature (verl's ``hiyouga/geometry3k`` branch)."""
    return compute_score(solution_str, str(ground_truth), use_boxed=use_boxed)
