"""Reward for the GSM8K / SmolLM2 recipe, usable as verl's custom reward function::

    custom_reward_function.path=examples/gsm8k_smollm2/reward.py custom_reward_function.name=compute_score

- ``reasoning_gym/*`` rows (numeric answers): the final answer is the number after the last
  ``####``; failing that (unless ``strict=True``) the content of the last ``\\boxed{...}``, the
  number after the last "answer is"/"answer:", or the last number in the response. It is compared
  numerically with the ground truth (commas, ``$`` and a trailing ``.`` ignored; ``-4`` == ``-4.0``);
  a non-numeric ground truth is compared as a whitespace-/case-normalised string. 1.0 or 0.0.
- ``openai/gsm8k`` rows go to hybridflow's built-in GSM8K scorer (``gsm8k_method="strict"`` by
  default, verl's headline; ``"flexible"`` = last number), so one reward file serves a mixed
  validation set.

Extra keyword arguments (``custom_reward_function.reward_kwargs``): ``strict`` (bool, reasoning-gym
rows: only a ``#### N`` answer counts) and ``gsm8k_method`` (``strict`` | ``flexible``).
"""

from __future__ import annotations

import re
from fractions import Fraction

CLIP_CHARS = 1000  # the answer sits at the end; keeps regexes cheap on runaway responses

_NUM = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUM + r")")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\**\s*\$?\s*(" + _NUM + r")", re.IGNORECASE)
_NUMBER = re.compile(_NUM)


def _normalize_text(text: str) -> str:
    return text.replace("\u2212", "-").replace("\u2013", "-")  # unicode minus / en dash


def extract_answer(solution_str: str, strict: bool = False) -> str | None:
    """The final answer string of a response, or None (see the module docstring for the order)."""
    text = _normalize_text(str(solution_str))[-CLIP_CHARS:]
    found = _HASHES.findall(text)
    if found:
        return found[-1]
    if strict:
        return None
    for pattern in (_BOXED, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def _to_number(text: str) -> Fraction | None:
    text = str(text).strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str, ground_truth) -> bool:
    """Numeric equality when both parse as numbers, else normalised string equality."""
    a, g = _to_number(answer), _to_number(str(ground_truth))
    if a is not None and g is not None:
        return a == g
    normalize = lambda s: " ".join(str(s).split()).rstrip(".").lower()  # noqa: E731
    return normalize(answer) == normalize(ground_truth)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth,
    extra_info: dict | None = None,
    strict: bool = False,
    gsm8k_method: str = "strict",
    **kwargs,
) -> float:
    """1.0 if the response's final answer equals ``ground_truth``, else 0.0."""
    if data_source == "openai/gsm8k":
        from hybridflow.utils.reward_score.gsm8k import compute_score as gsm8k_score

        return float(gsm8k_score(solution_str, ground_truth, method=gsm8k_method))
    answer = extract_answer(solution_str, strict=strict)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, ground_truth) else 0.0
