r"""verl's ``verl.utils.reward_score.prime_math.math_normalize``: PRM800K's copy of Hendrycks' MATH
answer normalisation (the rules of :func:`hybridflow.utils.reward_score.math.strip_string`, which this
reuses), with an enclosing ``\text{...}`` removed first and the answer returned as it was when the
rules fail on it."""

from __future__ import annotations

import re

from hybridflow.utils.reward_score.math import strip_string

_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_PLAIN_PERCENT = re.compile(r"(?<!\\)%")


def normalize_answer(answer: str | None, drop_percent: bool = False) -> str | None:
    r"""Hendrycks' normal form of ``answer`` (None stays None); ``drop_percent``: also drop a plain
    ``%`` (MathRuler's variant, used by geo3k; ``\%`` is always dropped)."""
    if answer is None:
        return None
    answer = answer.strip()
    try:
        match = _TEXT.search(answer)
        if match is not None:
            answer = match.group("text").strip()
        if drop_percent:
            answer = _PLAIN_PERCENT.sub("", answer)
        return strip_string(answer)
    except Exception:  # the rules index and assert on odd input: keep the answer as it is
        return answer
