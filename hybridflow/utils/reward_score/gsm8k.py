"""GSM8K scorer with verl's semantics (ReFT, Trung et al., ACL 2024).

``method="strict"`` takes the number after the last ``#### `` (commas and ``$`` stripped);
``method="flexible"`` takes the last number anywhere in the text (commas and, unlike verl, a
sentence-final ``.`` stripped, so "The answer is 72." extracts ``72``). A match scores
``score`` (1.0), a wrong extracted answer ``format_score`` (0.0), no extractable answer 0.
"""

from __future__ import annotations

import re

from hybridflow.utils.reward_score import register_scorer

# Regexes on very long strings are slow and the answer sits at the end (verl clips the same way).
SOLUTION_CLIP_CHARS = 300

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def _strict(text: str) -> str | None:
    found = _STRICT.findall(text)
    return found[-1].replace(",", "").replace("$", "") if found else None


def _flexible(text: str) -> str | None:
    for candidate in reversed(_NUMBER.findall(text)):
        candidate = candidate.replace(",", "").rstrip(".")
        if candidate not in ("", "-"):
            return candidate
    return None


EXTRACTORS = {"strict": _strict, "flexible": _flexible}


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer string, or None when the text has none in the requested format."""
    if method not in EXTRACTORS:
        raise ValueError(f"gsm8k extract_solution: method={method!r}; choose one of {list(EXTRACTORS)}")
    return EXTRACTORS[method](solution_str[-SOLUTION_CLIP_CHARS:])


@register_scorer("openai/gsm8k")
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth`` (as strings), else ``format_score``/0."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth).replace(",", "") else float(format_score)
