"""The on-policy shortcut: with one PPO epoch and one mini-batch per step the update's own log-probs
(detached) are the old policy's, so the separate old-log-prob forward is skipped. The gradient equals
the recompute path's, and the metrics that pass used to report (entropy, rollout parity) still come."""

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.trainer.config import load_config
from hybridflow.utils.roles import update_computes_old_log_probs
from hybridflow.utils.torch_functional import masked_mean
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.fsdp_utils import build_device_mesh
from hybridflow.workers.model_builder import build_fsdp_module
from tests.utils.checkpoint.fsdp_toy import full_value, gloo_group
from tests.workers.test_loss_normalisation import RESPONSE_LEN, _actor_config, _batch

BATCHING = OmegaConf.create(
    {
        "log_prob_micro_batch_size_per_gpu": 3,
        "log_prob_use_dynamic_bsz": False,
        "log_prob_max_token_len_per_gpu": None,
    }
)


def _actor(model_dir: str) -> DataParallelPPOActor:
    module = build_fsdp_module(
        OmegaConf.create({"path": model_dir}), OmegaConf.create({}), build_device_mesh(1, "cpu")
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    return DataParallelPPOActor(
        _actor_config("token-mean", 4, 2), module, optimizer, response_length=RESPONSE_LEN
    )


def _grads(actor) -> dict[str, torch.Tensor]:
    return {n: full_value(p.grad).clone() for n, p in actor.module.named_parameters() if p.grad is not None}


def test_update_log_probs_replace_the_recompute_exactly(tiny_model_dir):
    with gloo_group():
        recompute = _actor(tiny_model_dir)
        data = _batch()
        old_log_probs, entropy = recompute.compute_log_prob(data, BATCHING, calculate_entropy=True)
        data.batch[keys.OLD_LOG_PROBS] = old_log_probs
        recompute.module.train()
        recompute.accumulate_gradients(data, 1.0, {})
        want = _grads(recompute)

        shortcut = _actor(tiny_model_dir)
        data = _batch()  # no old_log_probs: the update supplies them
        rollout = old_log_probs.clone()
        rollout[1, 0] += 0.25  # the engine disagrees on one valid token by 0.25
        data.batch[keys.ROLLOUT_LOG_PROBS] = rollout
        shortcut.module.train()
        metrics: dict[str, list] = {}
        shortcut.accumulate_gradients(data, 1.0, metrics)
        got = _grads(shortcut)

    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    mask = data.batch[keys.RESPONSE_MASK].float()
    assert metrics["actor/entropy"][0] == pytest.approx(float(masked_mean(entropy, mask)), rel=1e-5)
    assert metrics["actor/ppo_kl"] == [0.0, 0.0] and metrics["actor/pg_clipfrac"] == [0.0, 0.0]
    assert metrics["training/rollout_log_probs_diff_max"][0] == pytest.approx(0.25, abs=1e-4)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ([], True),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=8"], False),  # two optimizer steps per batch
        (["actor_rollout_ref.actor.ppo_epochs=2"], False),
        (["algorithm.use_kl_in_reward=true"], False),  # the reward needs them before the update
        (["actor_rollout_ref.rollout.use_rollout_log_probs=true"], False),  # the engine's are asked for
        (["actor_rollout_ref.actor.reuse_update_log_probs=false"], False),
    ],
)
def test_shortcut_only_where_the_equality_holds(extra, expected):
    config = load_config(
        ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16", *extra]
    )
    assert update_computes_old_log_probs(config) is expected


def test_balance_keeps_prompt_groups_on_one_rank():
    from hybridflow.trainer.ppo.ray_trainer import group_balanced_partitions

    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    seqlens = [10, 12, 3, 4, 20, 2, 5, 5]  # group tokens: a 22, b 7, c 22, d 10
    parts = group_balanced_partitions(uids, seqlens, world=2)
    assert all(len({uids[i] for i in part}) == 2 and len(part) == 4 for part in parts)  # whole groups
    loads = sorted(sum(seqlens[i] for i in part) for part in parts)
    assert loads == [29, 32]  # the best split of 22, 7, 22, 10 over 2 ranks
    assert group_balanced_partitions(uids, seqlens, world=3) is None  # 4 groups over 3 ranks
    assert group_balanced_partitions(["a", "a", "b"], [1, 1, 1], world=1) is None  # unequal groups
