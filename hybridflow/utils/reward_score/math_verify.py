r"""Math-Verify scorer, verl's ``verl.utils.reward_score.math_verify`` (opt-in for the MATH sources).

Hugging Face Math-Verify parses the gold answer (wrapped in ``\boxed{}``) as LaTeX and the whole
response as an expression or LaTeX, and decides equivalence symbolically (``\frac{2}{4}`` = ``0.5``).
Install it with ``pip install math-verify``.
"""

from __future__ import annotations


def compute_score(model_output: str, ground_truth: str, timeout_score: float = 0.0) -> float:
    """Math-Verify's score of ``model_output`` against ``ground_truth``: 1.0 or 0.0; ``timeout_score``
    when its parser times out, 0.0 on any other error (its LaTeX parser raises on odd input)."""
    try:
        from math_verify.errors import TimeoutException
        from math_verify.metric import math_metric
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    except ImportError as err:
        raise ImportError("use_math_verify needs Math-Verify: pip install math-verify") from err

    verify = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    try:
        score, _ = verify(["\\boxed{" + ground_truth + "}"], [model_output])
    except TimeoutException:
        return float(timeout_score)
    except Exception:
        return 0.0
    return float(score)
