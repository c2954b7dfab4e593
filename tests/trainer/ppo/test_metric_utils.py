import math

import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_rollout_probs_diff,
    compute_throughput_metrics,
    compute_timing_metrics,
    process_validation_metrics,
    reduce_metrics,
)

X = 99.0  # garbage on padding / aborted rows: must never enter a statistic


def _batch(with_response_mask=True, meta_info=None):
    """3 rows, T_p = 3, T_r = 4.

    row 0: prompt 2 tokens, response 4 (hits the limit: clipped)
    row 1: prompt 3 (full: clipped), response 2
    row 2: prompt 1, response 0 (aborted)
    """
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0, 0]])
    returns = torch.tensor([[1.0, 2, 3, 4], [5, 6, X, X], [X, X, X, X]])
    tensors = {
        "prompts": torch.zeros(3, 3, dtype=torch.long),
        "responses": torch.zeros(3, 4, dtype=torch.long),
        "attention_mask": attention_mask,
        "token_level_scores": torch.tensor([[0, 0, 0, 1.0], [0, 0.5, 0, 0], [0, 0, 0, 0]]),
        "token_level_rewards": torch.tensor([[-0.1, -0.1, 0, 1.0], [0, 0.2, 0, 0], [0, 0, 0, 5.0]]),
        "advantages": torch.tensor([[-1.0, 0, 1, 2], [3, -2, X, X], [X, X, X, X]]),
        "returns": returns,
        # returns - values = +1, -1, +1, -1, +1, -1 on the six valid tokens
        "values": returns - torch.tensor([[1.0, -1, 1, -1], [1, -1, 0, 0], [0, 0, 0, 0]]),
    }
    if with_response_mask:
        tensors["response_mask"] = attention_mask[:, 3:]
    return DataProto.from_dict(tensors, meta_info=meta_info)


@pytest.mark.parametrize("with_response_mask", [True, False])
def test_data_metrics_by_hand(with_response_mask):
    m = compute_data_metrics(_batch(with_response_mask), use_critic=True)
    expected = {
        # sequence sums over the non-aborted rows 0 and 1: scores 1.0, 0.5; rewards 0.8, 0.2
        "critic/score/mean": 0.75,
        "critic/score/max": 1.0,
        "critic/score/min": 0.5,
        "critic/rewards/mean": 0.5,
        "critic/rewards/max": 0.8,
        "critic/rewards/min": 0.2,
        # valid advantages -1, 0, 1, 2, 3, -2; returns 1..6; values 0, 3, 2, 5, 4, 7
        "critic/advantages/mean": 0.5,
        "critic/advantages/max": 3.0,
        "critic/advantages/min": -2.0,
        "critic/returns/mean": 3.5,
        "critic/returns/max": 6.0,
        "critic/returns/min": 1.0,
        "critic/values/mean": 3.5,
        "critic/values/max": 7.0,
        "critic/values/min": 0.0,
        # Var(returns - values) = 6 / 5 = 1.2; Var(returns) = 17.5 / 5 = 3.5 (unbiased)
        "critic/vf_explained_var": 1 - 1.2 / (3.5 + 1e-5),
        # response lengths 4, 2, 0 (T_r = 4); prompt lengths 2, 3, 1 (T_p = 3)
        "response_length/mean": 2.0,
        "response_length/max": 4.0,
        "response_length/min": 0.0,
        "response_length/clip_ratio": 1 / 3,
        "response_length_non_aborted/mean": 3.0,
        "response_length_non_aborted/clip_ratio": 0.5,
        "response/aborted_ratio": 1 / 3,
        "prompt_length/mean": 2.0,
        "prompt_length/max": 3.0,
        "prompt_length/min": 1.0,
        "prompt_length/clip_ratio": 1 / 3,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-6), key


def test_data_metrics_without_critic():
    m = compute_data_metrics(_batch(), use_critic=False)
    assert "critic/values/mean" not in m and "critic/vf_explained_var" not in m
    assert m["critic/returns/mean"] == pytest.approx(3.5)


def test_timing_and_throughput():
    batch = _batch()  # 6 prompt tokens, 6 response tokens
    timing = {"gen": 0.6, "update_actor": 1.2, "reward": 0.1, "step": 3.0}
    m = compute_timing_metrics(batch, timing)
    assert m["timing_s/reward"] == 0.1 and m["timing_s/step"] == 3.0
    assert m["timing_per_token_ms/gen"] == pytest.approx(600 / 6)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(1200 / 12)
    assert "timing_per_token_ms/reward" not in m and "timing_per_token_ms/step" not in m

    m = compute_throughput_metrics(batch, timing, n_workers=2)
    assert m == {"perf/total_num_tokens": 12, "perf/time_per_step": 3.0, "perf/throughput": 2.0}
    m = compute_throughput_metrics(_batch(meta_info={"global_token_num": [10, 10, 10]}), timing, 2)
    assert m["perf/total_num_tokens"] == 30 and m["perf/throughput"] == 5.0


def test_reduce_metrics():
    reduced = reduce_metrics(
        {"a": [1, 2, 3], "b": 4, "c": torch.tensor([1.0, 3.0]), "d": [], "e": torch.tensor(2)}
    )
    assert reduced == {"a": 2.0, "b": 4.0, "c": 2.0, "e": 2.0}


def test_validation_metrics_by_hand():
    # Two prompts x 3 samples. Prompt a: rewards 1, 0, 1, answers 4, 5, 4 -> majority "4" -> 1.
    # Prompt b: rewards 0, 0, 1, answers 7, 7, 3 -> majority "7" -> 0.
    sources = ["gsm8k"] * 6
    uids = ["a", "a", "a", "b", "b", "b"]
    infos = {"reward": [1.0, 0.0, 1.0, 0.0, 0.0, 1.0], "pred": ["4", "5", "4", "7", "7", "3"]}
    m = process_validation_metrics(sources, uids, infos)
    assert m["val-core/gsm8k/reward/mean@3"] == pytest.approx(0.5)  # (2/3 + 1/3) / 2
    assert m["val-core/gsm8k/reward/best@3/mean"] == 1.0
    assert m["val-core/gsm8k/reward/maj@3/mean"] == 0.5
    assert m["val-aux/gsm8k/reward/worst@3/mean"] == 0.0
    # best@2: a's max over the 3 pairs is 1 every time; b's pairs {0,0},{0,1},{0,1} -> 2/3. Mean 5/6.
    assert m["val-aux/gsm8k/reward/best@2/mean"] == pytest.approx(5 / 6)
    # worst@2: a's pairs {1,0},{1,1},{0,1} -> 1/3; b -> 0. Mean 1/6.
    assert m["val-aux/gsm8k/reward/worst@2/mean"] == pytest.approx(1 / 6)
    # maj@2 for a: pairs (4,5)->1, (4,4)->1, (5,4)->0 -> 2/3; b: (7,7)->0, (7,3)->0, (7,3)->0 -> 0.
    assert m["val-aux/gsm8k/reward/maj@2/mean"] == pytest.approx(1 / 3)
    assert m["val-aux/gsm8k/reward/std@3"] == pytest.approx(math.sqrt(2 / 9))
    assert not any("/pred/" in key for key in m)


def test_validation_single_sample_and_acc_core():
    m = process_validation_metrics(
        ["math", "math", "code"], [0, 1, 2], {"reward": [1.0, 0.0, 0.5], "acc": [True, False, True]}
    )
    assert m == {
        "val-aux/math/reward/mean@1": 0.5,
        "val-core/math/acc/mean@1": 0.5,
        "val-aux/code/reward/mean@1": 0.5,
        "val-core/code/acc/mean@1": 1.0,
    }


def test_rollout_probs_diff():
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.6, 0.3, 0.3]]))
    old = torch.log(torch.tensor([[0.4, 0.25, 0.1], [0.3, 0.3, 0.3]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = compute_rollout_probs_diff(rollout, old, mask)  # valid |diffs|: 0.1, 0.0, 0.3
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.3)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.4 / 3)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt(0.07 / 3), rel=1e-5)
