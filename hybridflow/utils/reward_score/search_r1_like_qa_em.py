"""Search-R1's exact-match QA scorer, verl's ``verl.utils.reward_score.search_r1_like_qa_em`` (Search-R1,
Jin et al. 2025; the normalisation is SQuAD's official evaluation script).

The answer is the text of the last ``<answer>...</answer>`` of the response (stripped). It matches when,
after :func:`normalize_answer` (lower case, punctuation and the articles a/an/the dropped, whitespace
collapsed), it equals one of ``ground_truth["target"]`` (a string or a list of them). Scores as verl's:
no ``<answer>`` tag 0; a match ``score`` (1.0), divided by 4 when the response holds more than 10
opening or closing answer tags (spamming tags is not rewarded); a wrong answer ``format_score`` (0.0).
:func:`compute_score_subem` counts a golden answer contained in the prediction as a match.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

from hybridflow.utils.reward_score.registry import register_scorer

MAX_ANSWER_TAGS = 10  # more opening or closing <answer> tags than this quarter the score
SEARCH_R1_DATA_SOURCES = (
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golden(golden_answers: str | Iterable[str]) -> list[str]:
    return [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)


def em_check(prediction: str, golden_answers: str | Iterable[str]) -> int:
    """1 if the normalised prediction equals a normalised golden answer, else 0."""
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(golden) == pred for golden in _golden(golden_answers)))


def subem_check(prediction: str, golden_answers: str | Iterable[str]) -> int:
    """1 if a normalised golden answer is contained in the normalised prediction, else 0."""
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(golden) in pred for golden in _golden(golden_answers)))


def extract_solution(solution_str: str) -> str | None:
    """The stripped text of the last ``<answer>...</answer>``, or None without one."""
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def count_answer_tags(text: str) -> tuple[int, int]:
    """``(opening, closing)`` answer tag counts."""
    return text.count("<answer>"), text.count("</answer>")


def compute_score(
    solution_str: str, ground_truth: dict[str, Any], method: str = "strict", format_score=0.0, score=1.0
) -> float:
    """Exact-match score (module docstring); ``method`` is accepted for verl's signature and unused."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    if not em_check(answer, ground_truth["target"]):
        return format_score
    opening, closing = count_answer_tags(solution_str)
    if opening > MAX_ANSWER_TAGS or closing > MAX_ANSWER_TAGS:  # no reward for spamming </answer>
        return score / 4
    return score


def compute_score_subem(
    solution_str: str, ground_truth: dict[str, Any], method: str = "strict", format_score=0.0, score=1.0
) -> float:
    """Substring-match score: ``score`` when a golden answer is inside the answer, else as
    :func:`compute_score` (without the tag-count penalty, as in verl)."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if subem_check(answer, ground_truth["target"]) else format_score


@register_scorer(*SEARCH_R1_DATA_SOURCES)
def score_search_r1(
    data_source: str,
    solution_str: str,
    ground_truth: dict[str, Any],
    extra_info: dict | None = None,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """:func:`compute_score` under the dispatch signature (verl's ``searchR1_*`` branch)."""
    return compute_score(solution_str, ground_truth, format_score=format_score, score=score)
