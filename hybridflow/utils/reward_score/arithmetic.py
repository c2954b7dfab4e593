"""Scorer for the built-in arithmetic task (``hybridflow.tasks.arithmetic``)."""

from __future__ import annotations

import re

from hybridflow.utils.reward_score.registry import register_scorer

# An integer with an optional minus that is not the middle of a longer number ("5-3" yields 5 and 3).
_INTEGER = re.compile(r"(?<!\d)-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer in ``text`` (a leading minus counts), or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


@register_scorer("hybridflow/arithmetic")
def compute_score(
    data_source: str, solution_str: str, ground_truth: str | int, extra_info: dict | None = None
) -> float:
    """1.0 if the last integer in the response equals ``ground_truth``, else 0.0."""
    answer = last_integer(solution_str)
    return 1.0 if answer is not None and answer == int(ground_truth) else 0.0
