import math

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo import metric_utils
from hybridflow.trainer.ppo.metric_utils import (
    bootstrap_metric,
    calc_maj_val,
    compute_data_metrics,
    compute_rollout_probs_diff,
    compute_throughput_metrics,
    compute_timing_metrics,
    flatten_validation_metrics,
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
    # verl's spelling takes n_gpus: 30 tokens / (3 s * 5 workers) = 2 tokens/s per worker
    assert metric_utils.compute_throughout_metrics(
        _batch(meta_info={"global_token_num": [10] * 3}), timing, n_gpus=5
    )["perf/throughput"] == pytest.approx(2.0)


def test_timing_reads_lengths_through_verls_response_info(monkeypatch):
    info = metric_utils._compute_response_info(_batch())
    assert info["prompt_length"].sum().item() == 6 and info["response_length"].sum().item() == 6
    # code that patches the helper (as verl's tests do) changes what timing divides by
    fake = {"prompt_length": torch.tensor([1.0]), "response_length": torch.tensor([4.0])}
    monkeypatch.setattr(metric_utils, "_compute_response_info", lambda batch: fake)
    m = compute_timing_metrics(_batch(), {"gen": 0.4, "ref": 0.5})
    assert m["timing_per_token_ms/gen"] == pytest.approx(400 / 4) and m[
        "timing_per_token_ms/ref"
    ] == pytest.approx(500 / 5)


def test_reduce_metrics():
    reduced = reduce_metrics(
        {
            "a": [1, 2, 3],
            "b": 4,
            "c": torch.tensor([1.0, 3.0]),
            "d": [],
            "e": torch.tensor(2),
            "perf/max_memory_allocated_gb": [1.0, 3.0],  # verl: a "max" key takes the max over ranks
            "response_length/min": [2, 1],
            "timing_s/update_actor_worker": [1.0, 3.0],  # "timing" is no "min" token: the mean
        }
    )
    assert math.isnan(reduced.pop("d"))  # verl's np.mean([]) is NaN; the key is kept, not dropped
    assert reduced == {
        "a": 2.0,
        "b": 4.0,
        "c": 2.0,
        "e": 2.0,
        "perf/max_memory_allocated_gb": 3.0,
        "response_length/min": 1.0,
        "timing_s/update_actor_worker": 2.0,
    }


def _verl_bootstrap(data, subset_size, fn, seed=42):
    """verl's procedure, literally: reseed the global RNG, one np.random.choice per resample."""
    np.random.seed(seed)
    stats = [fn([data[i] for i in np.random.choice(len(data), size=subset_size)]) for _ in range(1000)]
    return np.mean(stats), np.std(stats)


def test_bootstrap_metric_matches_verl_draws_and_theory():
    data = [1, 2, 3, 4, 5]
    state = np.random.get_state()
    (mean_m, std_m), (max_m, _) = bootstrap_metric(data, 3, [np.mean, np.max])
    assert np.array_equal(np.random.get_state()[1], state[1])  # global RNG untouched (verl reseeds it)
    assert (mean_m, std_m) == pytest.approx(_verl_bootstrap(data, 3, np.mean), abs=1e-12)
    assert max_m == pytest.approx(_verl_bootstrap(data, 3, np.max)[0], abs=1e-12)
    # Theory: a resample of 1 is uniform on 1..5 (mean 3, std sqrt(2)); E[max of 3 draws] =
    # sum_k k * ((k/5)^3 - ((k-1)/5)^3) = 4.2. 1000 resamples: a few standard errors of slack.
    mean_1, std_1 = bootstrap_metric(data, 1, [np.mean])[0]
    assert mean_1 == pytest.approx(3.0, abs=0.15) and std_1 == pytest.approx(math.sqrt(2), abs=0.1)
    assert max_m == pytest.approx(4.2, abs=0.1)


def test_calc_maj_val():
    votes = [{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "A", "val": 0.7}]
    assert calc_maj_val(votes, vote_key="pred", val_key="val") == 0.9  # first value of the majority
    tie = [{"p": "B", "v": 1.0}, {"p": "A", "v": 0.0}]
    assert calc_maj_val(tie, vote_key="p", val_key="v") == 1.0  # a tie goes to the first answer seen


def test_validation_metrics_nested_like_verl():
    # Two prompts x 3 samples. Prompt a: rewards 1, 0, 1, answers 4, 5, 4; prompt b: 0, 0, 1 / 7, 7, 3.
    sources = ["gsm8k"] * 6
    uids = ["a", "a", "a", "b", "b", "b"]
    infos = {"reward": [1.0, 0.0, 1.0, 0.0, 0.0, 1.0], "pred": ["4", "5", "4", "7", "7", "3"]}
    m = process_validation_metrics(sources, uids, infos)
    assert list(m) == ["gsm8k"] and list(m["gsm8k"]) == ["reward"]  # "pred" holds strings: skipped
    reward = m["gsm8k"]["reward"]
    assert set(reward) == {
        "mean@3", "std@3",
        *(f"{k}@{n}/{s}" for k in ("best", "worst", "maj") for n in (2, 3) for s in ("mean", "std")),
    }  # fmt: skip
    assert reward["mean@3"] == pytest.approx(0.5)  # (2/3 + 1/3) / 2
    assert reward["std@3"] == pytest.approx(math.sqrt(2 / 9))  # both prompts: population std sqrt(2/9)
    # Bootstrap with replacement, as verl: E[best@3] = 1 - P(no 1 in 3 draws): a 26/27, b 19/27.
    assert reward["best@3/mean"] == pytest.approx((26 / 27 + 19 / 27) / 2, abs=0.03)
    # E[worst@2] = P(both draws are 1): a (2/3)^2, b (1/3)^2.
    assert reward["worst@2/mean"] == pytest.approx((4 / 9 + 1 / 9) / 2, abs=0.03)
    # Exactly verl's numbers: same seed, same draws, averaged over the two prompts.
    a, b = [1.0, 0.0, 1.0], [0.0, 0.0, 1.0]
    for n in (2, 3):
        for name, fn in (("best", np.max), ("worst", np.min)):
            ref = [_verl_bootstrap(a, n, fn), _verl_bootstrap(b, n, fn)]
            assert reward[f"{name}@{n}/mean"] == pytest.approx((ref[0][0] + ref[1][0]) / 2, abs=1e-12)
            assert reward[f"{name}@{n}/std"] == pytest.approx((ref[0][1] + ref[1][1]) / 2, abs=1e-12)
    maj = lambda sample: calc_maj_val(sample, "pred", "val")  # noqa: E731
    votes_a = [{"val": v, "pred": p} for v, p in zip(a, ["4", "5", "4"], strict=True)]
    votes_b = [{"val": v, "pred": p} for v, p in zip(b, ["7", "7", "3"], strict=True)]
    ref = (_verl_bootstrap(votes_a, 3, maj)[0] + _verl_bootstrap(votes_b, 3, maj)[0]) / 2
    assert reward["maj@3/mean"] == pytest.approx(ref, abs=1e-12)


def test_validation_single_sample_and_flat_keys():
    m = process_validation_metrics(
        ["math", "math", "code"], [0, 1, 2], {"reward": [1.0, 0.0, 0.5], "acc": [True, False, True]}
    )
    assert m == {
        "math": {"reward": {"mean@1": 0.5}, "acc": {"mean@1": 0.5}},
        "code": {"reward": {"mean@1": 0.5}, "acc": {"mean@1": 1.0}},
    }
    assert flatten_validation_metrics(m) == {
        "val-aux/math/reward/mean@1": 0.5,  # "acc" is the core variable when a source has it
        "val-core/math/acc/mean@1": 0.5,
        "val-aux/code/reward/mean@1": 0.5,
        "val-core/code/acc/mean@1": 1.0,
    }


def test_flatten_validation_metrics_core_is_mean_best_maj_at_largest_n():
    nested = {
        "gsm8k": {
            "reward": {
                "mean@4": 0.5, "std@4": 0.1, "best@2/mean": 0.6, "best@4/mean": 0.7, "best@4/std": 0.2,
                "worst@4/mean": 0.3, "maj@2/mean": 0.4, "maj@4/mean": 0.45, "maj@4/std": 0.05,
            },
            "length": {"mean@4": 12.0},
        }
    }  # fmt: skip
    flat = flatten_validation_metrics(nested)
    core = {k for k in flat if k.startswith("val-core/")}
    assert core == {
        "val-core/gsm8k/reward/mean@4",
        "val-core/gsm8k/reward/best@4/mean",
        "val-core/gsm8k/reward/best@4/std",  # verl files the /std of a core metric under val-core too
        "val-core/gsm8k/reward/maj@4/mean",
        "val-core/gsm8k/reward/maj@4/std",
    }
    assert flat["val-aux/gsm8k/reward/best@2/mean"] == 0.6 and flat["val-aux/gsm8k/length/mean@4"] == 12.0
    assert len(flat) == 10


def test_rollout_probs_diff():
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.6, 0.3, 0.3]]))
    old = torch.log(torch.tensor([[0.4, 0.25, 0.1], [0.3, 0.3, 0.3]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = compute_rollout_probs_diff(rollout, old, mask)  # valid |diffs|: 0.1, 0.0, 0.3
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.3)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.4 / 3)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt(0.07 / 3), rel=1e-5)


def test_overhead_metrics_are_driver_wall_minus_worker_time():
    from hybridflow.trainer.ppo.metric_utils import compute_overhead_metrics

    timing = {
        "step": 2.0,
        "generate_call": 0.5,
        "generate_sequences": 0.38,
        "update_weights": 0.02,
        "update_actor": 1.2,
        "gen": 0.6,
    }
    out = compute_overhead_metrics(timing, {"timing_s/update_actor_worker": 1.1})
    # (0.5 - 0.40) + (1.2 - 1.1) = 0.2 s of a 2 s step; weight sync 0.02 / 2
    assert out["perf/dispatch_overhead_s"] == pytest.approx(0.2)
    assert out["perf/dispatch_overhead_frac"] == pytest.approx(0.1)
    assert out["perf/weight_sync_frac"] == pytest.approx(0.01)
