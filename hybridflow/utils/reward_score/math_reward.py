"""verl's newer module name for the MATH scorer (``verl.utils.reward_score.math_reward``): the same
functions as :mod:`hybridflow.utils.reward_score.math`."""

from hybridflow.utils.reward_score.math import (
    compute_score,
    fix_a_slash_b,
    fix_fracs,
    fix_sqrt,
    is_equiv,
    last_boxed_only_string,
    remove_boxed,
    remove_right_units,
    strip_string,
)

__all__ = [
    "compute_score",
    "fix_a_slash_b",
    "fix_fracs",
    "fix_sqrt",
    "is_equiv",
    "last_boxed_only_string",
    "remove_boxed",
    "remove_right_units",
    "strip_string",
]
