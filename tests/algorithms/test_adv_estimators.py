"""Advantage estimators against hand-derived numbers and plain-Python float64 references.

The references below re-derive each estimator with lists and loops (verl's per-sample semantics) and never
call the code under test.
"""

import math
import statistics

import numpy as np
import pytest
import torch

from hybridflow.algorithms import ADV_ESTIMATORS, AdvantageInputs, compute_advantage, register_adv_est
from hybridflow.algorithms.advantage import AdvantageOutput

D = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=D)


def outcome_rewards(scores, length=3):
    """Rewards (B, length) with each score on the last token; full masks."""
    rewards = torch.zeros(len(scores), length, dtype=D)
    rewards[:, -1] = torch.tensor(scores, dtype=D)
    return rewards, torch.ones_like(rewards)


# ----------------------------------------------------------------------------- plain-Python references


def ref_whiten(rows, masks):
    vals = [v for row, m in zip(rows, masks) for v, k in zip(row, m) if k]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in rows]


def ref_groups(index):
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    return groups


def ref_grpo(scores, index, norm=True, eps=1e-6):
    out = [0.0] * len(scores)
    for members in ref_groups(index).values():
        vals = [scores[i] for i in members]
        mean, std = (0.0, 1.0) if len(vals) == 1 else (statistics.fmean(vals), statistics.stdev(vals))
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return out


def ref_rloo(scores, index):
    out = list(scores)
    for members in ref_groups(index).values():
        if len(members) > 1:
            for i in members:
                others = [scores[j] for j in members if j != i]
                out[i] = scores[i] - sum(others) / len(others)
    return out


def ref_opo(scores, lengths, index):
    out = list(scores)
    for members in ref_groups(index).values():
        if len(members) > 1:
            base = sum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
            for i in members:
                out[i] = scores[i] - base
    return out


def ref_gae(rewards, values, masks, gamma, lam):
    """Per-row GAE that skips masked tokens (carries V and A across them), then whitened."""
    advs, rets = [], []
    for r, v, m in zip(rewards, values, masks):
        adv, next_v, last = [0.0] * len(r), 0.0, 0.0
        for k in reversed(range(len(r))):
            if m[k]:
                last = r[k] + gamma * next_v - v[k] + gamma * lam * last
                next_v = v[k]
            adv[k] = last
        advs.append(adv)
        rets.append([a + b for a, b in zip(adv, v)])
    return ref_whiten(advs, masks), rets


def ref_reinforce_pp(rewards, masks, gamma):
    rets = []
    for r, m in zip(rewards, masks):
        ret, running = [0.0] * len(r), 0.0
        for k in reversed(range(len(r))):
            running = r[k] + gamma * running
            ret[k] = running
            running *= m[k]
        rets.append(ret)
    white = ref_whiten(rets, masks)
    return [[w * k for w, k in zip(row, m)] for row, m in zip(white, masks)], rets


def assert_outcome(out: AdvantageOutput, per_sample, mask):
    expected = torch.tensor(per_sample, dtype=D).unsqueeze(-1) * mask
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, expected)


# ----------------------------------------------------------------------------- grpo and Dr.GRPO


def test_grpo_hand_value():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 0.0])
    out = compute_advantage("grpo", AdvantageInputs(rewards, mask, index=np.array(["a"] * 4)))
    # mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert_outcome(out, [a, -a, a, -a], mask)


def test_dr_grpo_drops_std():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0])
    inputs = AdvantageInputs(rewards, mask, index=np.array([0, 0, 0]), norm_adv_by_std_in_grpo=False)
    # mean 1/3 -> [2/3, -1/3, -1/3]
    assert_outcome(compute_advantage("grpo", inputs), [2 / 3, -1 / 3, -1 / 3], mask)


def test_grpo_singleton_group_uses_mean0_std1():
    rewards, mask = outcome_rewards([0.7, 1.0, 0.0])
    out = compute_advantage("grpo", AdvantageInputs(rewards, mask, index=np.array(["solo", "g", "g"])))
    # solo: (0.7 - 0) / (1 + eps); pair: +-0.5 / (stdev(1, 0) = 0.70711)
    pair = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_outcome(out, [0.7 / (1 + 1e-6), pair, -pair], mask)


@pytest.mark.parametrize("name", ["grpo", "rloo", "gpg", "reinforce_plus_plus_baseline", "opo"])
def test_all_equal_rewards_give_zero_advantage(name):
    rewards, mask = outcome_rewards([1.0, 1.0, 1.0, 1.0])
    out = compute_advantage(name, AdvantageInputs(rewards, mask, index=np.array([3, 3, 3, 3])))
    assert torch.isfinite(out.advantages).all()
    torch.testing.assert_close(out.advantages, torch.zeros_like(rewards))


def test_grpo_matches_reference_on_random_batch():
    gen = np.random.default_rng(0)
    index = gen.permutation(np.repeat(np.array([f"uid-{k}" for k in range(7)], dtype=object), 5))
    index = np.concatenate([index, np.array(["lonely"], dtype=object)])
    scores = gen.normal(size=len(index)).round(3).tolist()
    rewards, mask = outcome_rewards(scores, length=4)
    mask[0, 2:] = 0  # a shorter response: its advantage is masked there
    rewards[0, -1], rewards[0, 1] = 0.0, scores[0]
    for norm in (True, False):
        out = compute_advantage(
            "grpo", AdvantageInputs(rewards, mask, index=index, norm_adv_by_std_in_grpo=norm)
        )
        assert_outcome(out, ref_grpo(scores, list(index), norm=norm), mask)


def test_fully_masked_row_gets_zero_advantage():
    rewards, mask = outcome_rewards([1.0, 0.0])
    mask[1] = 0
    out = compute_advantage("grpo", AdvantageInputs(rewards, mask, index=np.array([0, 0])))
    assert torch.isfinite(out.advantages).all()
    assert out.advantages[1].abs().sum().item() == 0.0


# ----------------------------------------------------------------------------- rloo, opo, gpg, passk


def test_rloo_hand_value_and_singleton():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0, 0.4])
    out = compute_advantage("rloo", AdvantageInputs(rewards, mask, index=np.array([0, 0, 0, 1])))
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; singleton keeps its raw score 0.4
    assert_outcome(out, [1.0, -0.5, -0.5, 0.4], mask)


def test_rloo_matches_reference():
    gen = np.random.default_rng(1)
    index = gen.integers(0, 6, size=40)
    scores = gen.normal(size=40).tolist()
    rewards, mask = outcome_rewards(scores)
    out = compute_advantage("rloo", AdvantageInputs(rewards, mask, index=index))
    assert_outcome(out, ref_rloo(scores, index.tolist()), mask)


def test_opo_length_weighted_baseline():
    rewards = t([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]])
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    out = compute_advantage("opo", AdvantageInputs(rewards, mask, index=np.array([0, 0, 1])))
    # group 0: lengths 2, 4 -> baseline (2*1 + 4*0) / 6 = 1/3 -> [2/3, -1/3]; singleton keeps 0.5
    assert_outcome(out, [2 / 3, -1 / 3, 0.5], mask)


def test_opo_matches_reference():
    gen = np.random.default_rng(2)
    index = gen.integers(0, 4, size=24)
    lengths = gen.integers(1, 6, size=24)
    scores = gen.normal(size=24).tolist()
    rewards = torch.zeros(24, 6, dtype=D)
    mask = (torch.arange(6) < torch.as_tensor(lengths).unsqueeze(-1)).to(D)
    rewards[torch.arange(24), torch.as_tensor(lengths) - 1] = torch.tensor(scores, dtype=D)
    out = compute_advantage("opo", AdvantageInputs(rewards, mask, index=index))
    assert_outcome(out, ref_opo(scores, lengths.tolist(), index.tolist()), mask)


def test_gpg_hand_value():
    rewards, mask = outcome_rewards([1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    out = compute_advantage("gpg", AdvantageInputs(rewards, mask, index=np.array([0, 0, 1, 1, 2, 2])))
    # alpha = B / #nonzero = 6 / 2 = 3; groups 0, 1: 3 * (+-0.5) = +-1.5; group 2: 0
    assert_outcome(out, [1.5, -1.5, 1.5, -1.5, 0.0, 0.0], mask)


def test_grpo_passk_hand_value():
    rewards, mask = outcome_rewards([0.2, 0.9, 0.5, 1.0, 1.0])
    index = np.array(["a", "a", "a", "b", "b"])
    out = compute_advantage("grpo_passk", AdvantageInputs(rewards, mask, index=index))
    # group a: best 0.9, second 0.5 -> 0.4 / (stdev(0.2, 0.9, 0.5) = 0.351188); group b: tie -> 0
    best = 0.4 / (statistics.stdev([0.2, 0.9, 0.5]) + 1e-6)
    assert_outcome(out, [0.0, best, 0.0, 0.0, 0.0], mask)
    raw = AdvantageInputs(rewards, mask, index=index, norm_adv_by_std_in_grpo=False)
    assert_outcome(compute_advantage("grpo_passk", raw), [0.0, 0.4, 0.0, 0.0, 0.0], mask)


def test_grpo_passk_rejects_singleton_group():
    rewards, mask = outcome_rewards([0.2, 0.9, 0.5])
    with pytest.raises(ValueError, match="solo"):
        compute_advantage("grpo_passk", AdvantageInputs(rewards, mask, index=np.array(["g", "g", "solo"])))


# ----------------------------------------------------------------------------- token-level estimators


def test_gae_hand_value():
    # gamma = lam = 1, V = 0.5 everywhere, reward 1 at the end: A_2 = 1 - 0.5 = 0.5, A_1 = 0 + 0.5 - 0.5
    # + A_2 = 0.5, A_0 = 0.5; returns = A + V = 1. Whitening equal advantages gives 0.
    rewards, values, mask = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.5, 0.5]]), t([[1, 1, 1]])
    out = compute_advantage("gae", AdvantageInputs(rewards, mask, values=values))
    torch.testing.assert_close(out.returns, t([[1.0, 1.0, 1.0]]))
    torch.testing.assert_close(out.advantages, torch.zeros(1, 3, dtype=D))


def test_gae_discounted_hand_value():
    # gamma 0.9, lam 0.8, V = [0.2, 0.4], r = [0, 1]:
    # A_1 = 1 - 0.4 = 0.6; A_0 = 0 + 0.9 * 0.4 - 0.2 + 0.72 * 0.6 = 0.592; returns = [0.792, 1.0]
    out = compute_advantage(
        "gae", AdvantageInputs(t([[0.0, 1.0]]), t([[1, 1]]), values=t([[0.2, 0.4]]), gamma=0.9, lam=0.8)
    )
    torch.testing.assert_close(out.returns, t([[0.792, 1.0]]))


def test_gae_matches_reference_with_padding_and_observation_tokens():
    gen = np.random.default_rng(3)
    rewards = gen.normal(size=(5, 7)).round(2)
    values = gen.normal(size=(5, 7)).round(2)
    masks = np.ones((5, 7))
    masks[0, 5:] = 0  # right padding
    masks[1, 2:4] = 0  # tool-observation tokens inside a multi-turn response
    masks[2, 6] = 0
    adv_ref, ret_ref = ref_gae(rewards.tolist(), values.tolist(), masks.tolist(), gamma=0.95, lam=0.9)
    out = compute_advantage(
        "gae", AdvantageInputs(t(rewards), t(masks), values=t(values), gamma=0.95, lam=0.9)
    )
    torch.testing.assert_close(out.returns, t(ret_ref))
    torch.testing.assert_close(out.advantages, t(adv_ref))


def test_reinforce_plus_plus_matches_reference():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.0, -1.0]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    # row 0 with gamma 0.5: G = [0.25, 0.5, 1]
    out = compute_advantage("reinforce_plus_plus", AdvantageInputs(rewards, mask, gamma=0.5))
    torch.testing.assert_close(out.returns[0], t([0.25, 0.5, 1.0]))
    adv_ref, ret_ref = ref_reinforce_pp(rewards.tolist(), mask.tolist(), gamma=0.5)
    torch.testing.assert_close(out.returns, t(ret_ref))
    torch.testing.assert_close(out.advantages, t(adv_ref))


def test_reinforce_plus_plus_baseline_matches_reference():
    scores = [1.0, 0.0, 0.5, 2.0]
    rewards, mask = outcome_rewards(scores)
    mask[3, 1:] = 0
    out = compute_advantage(
        "reinforce_plus_plus_baseline", AdvantageInputs(rewards, mask, index=np.array([0, 0, 0, 1]))
    )
    centred = [s - m for s, m in zip(scores, [0.5, 0.5, 0.5, 0.0])]  # singleton baseline 0
    tiled = [[c * k for k in m] for c, m in zip(centred, mask.tolist())]
    expected = [
        [w * k for w, k in zip(row, m)] for row, m in zip(ref_whiten(tiled, mask.tolist()), mask.tolist())
    ]
    torch.testing.assert_close(out.advantages, t(expected))


def test_remax_hand_value():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    out = compute_advantage("remax", AdvantageInputs(rewards, mask, reward_baselines=t([0.4, 1.5])))
    # returns-to-go [1, 1, 1] and [1, 1, 0]; minus baseline on valid tokens
    torch.testing.assert_close(out.returns, t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    torch.testing.assert_close(out.advantages, t([[0.6, 0.6, 0.6], [-0.5, -0.5, 0.0]]))


# ----------------------------------------------------------------------------- errors and extension


@pytest.mark.parametrize(
    "name, field", [("gae", "values"), ("remax", "reward_baselines"), ("grpo", "index"), ("rloo", "index")]
)
def test_missing_input_names_the_field(name, field):
    rewards, mask = outcome_rewards([1.0, 0.0])
    with pytest.raises(ValueError, match=f"{name}.*{field}"):
        compute_advantage(name, AdvantageInputs(rewards, mask))


def test_index_with_wrong_length_raises():
    rewards, mask = outcome_rewards([1.0, 0.0])
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", AdvantageInputs(rewards, mask, index=np.array([0, 0, 0])))


def test_new_estimator_dispatches_without_editing_dispatcher(monkeypatch):
    monkeypatch.setattr(ADV_ESTIMATORS, "_entries", dict(ADV_ESTIMATORS._entries))

    @register_adv_est("constant_one")  # verl's estimator signature
    def constant_one(token_level_rewards, response_mask, index=None, config=None, **kwargs):
        ones = torch.ones_like(token_level_rewards) * response_mask
        return ones, ones

    rewards, mask = outcome_rewards([3.0])
    torch.testing.assert_close(
        compute_advantage("constant_one", AdvantageInputs(rewards, mask)).advantages, mask
    )
