"""GSM8K scorer, verl's ``verl.utils.reward_score.gsm8k`` (ReFT, Trung et al., ACL 2024).

Only the last 300 characters of a response are searched (regexes on very long strings are slow and
the answer sits at the end). ``method="strict"`` takes the number after the last ``#### `` (the
space is required; commas stripped); ``method="flexible"`` takes the last number-like token anywhere,
verbatim (``"1,000"`` and ``"72."`` stay as written, so they do not equal ``"1000"`` / ``"72"``).
A match with the ground truth scores ``score``, a wrong extracted answer ``format_score``, and no
extractable answer 0.
"""

from __future__ import annotations

import re

from hybridflow.utils.reward_score.registry import register_scorer

_SOLUTION_CLIP_CHARS = 300

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer string, or None when the text has none in the requested format."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extract_solution: method={method!r}; choose 'strict' or 'flexible'")
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(solution_str)
    for candidate in reversed(found):
        if candidate not in ("", "."):
            return candidate
    # verl's loop variable survives a loop without a valid token: the first token (a lone ".").
    return found[0] if found else None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth`` exactly (as strings), ``format_score``
    if an answer was extracted but differs, 0 if none was found (verl's signature)."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    # verl compares with the ground truth as given; str() lets an int ground truth match too.
    return score if answer == str(ground_truth) else format_score


@register_scorer("openai/gsm8k")
def score_gsm8k(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """:func:`compute_score` under the dispatch signature. Its keywords are named (not ``**kwargs``)
    so the dispatcher passes this scorer only those (``reward_kwargs`` meant for other scorers stay out)."""
    return compute_score(solution_str, ground_truth, method=method, format_score=format_score, score=score)
