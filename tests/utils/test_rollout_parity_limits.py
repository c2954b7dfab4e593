"""The rollout/trainer log-prob gap: per-backend tolerances and the limit that stops a run."""

import pytest
from omegaconf import OmegaConf

from hybridflow.utils.rollout_parity import (
    RolloutLogProbGapError,
    check_log_prob_gap,
    gap_limit,
    parity_tolerance,
)


def _rollout(**values):
    return OmegaConf.create({"name": "engine", "do_sample": True, "temperature": 1.0, **values})


def test_tolerance_is_the_backends_unless_configured():
    assert parity_tolerance(_rollout()) == 1e-5
    assert parity_tolerance(_rollout(name="vllm")) == 1e-3
    assert parity_tolerance(_rollout(name="vllm", log_prob_parity_tolerance=2e-4)) == 2e-4


def test_the_limit_follows_precision_and_is_off_where_log_probs_do_not_compare():
    assert gap_limit(_rollout(), all_fp32=True) == 1e-2
    assert gap_limit(_rollout(), all_fp32=False) == 1.0
    assert gap_limit(_rollout(log_prob_gap_limit=0.05), all_fp32=True) == 0.05
    assert gap_limit(_rollout(log_prob_gap_limit=-1), all_fp32=True) is None
    # greedy training rollouts report untempered log-probs; at T != 1 the recompute's differ
    assert gap_limit(_rollout(do_sample=False, temperature=0.7), all_fp32=True) is None
    assert gap_limit(_rollout(do_sample=False), all_fp32=True) == 1e-2


def test_a_gap_beyond_the_limit_names_the_step_and_the_backend():
    check_log_prob_gap({"training/rollout_log_probs_diff_max": 0.009}, 1e-2, 3, "vllm")
    check_log_prob_gap({}, 1e-2, 3, "vllm")  # no parity measured this step
    check_log_prob_gap({"training/rollout_log_probs_diff_max": 5.0}, None, 3, "vllm")  # check off
    with pytest.raises(
        RolloutLogProbGapError, match=r"step 3: the vllm rollout's log-probs differ .* by up to 0.53"
    ):
        check_log_prob_gap(
            {"training/rollout_log_probs_diff_max": 0.53, "training/rollout_log_probs_diff_mean": 0.1},
            1e-2,
            3,
            "vllm",
        )
