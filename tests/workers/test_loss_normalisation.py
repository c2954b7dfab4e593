"""The actor's loss is normalised over the whole mini-batch — every micro-batch and every dp rank —
so its gradient equals the float64 gradient of the mini-batch objective computed in one piece, for
every ``loss_agg_mode``, however the rows are split (verl's global token / sequence counts).

Rows have 6, 1, 3 and 4 response tokens, so weighting micro-batch means by rows (the old scheme)
gives a different gradient."""

import os

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.fsdp_utils import build_device_mesh
from hybridflow.workers.model_builder import build_fsdp_module
from tests.utils.checkpoint.fsdp_toy import free_port, full_value, gloo_group

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PROMPT_LEN, RESPONSE_LEN = 5, 6
RESPONSE_TOKENS = [6, 1, 3, 4]
ADVANTAGES = [1.5, -0.5, 2.0, -1.0]


def _batch() -> DataProto:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (4, PROMPT_LEN + RESPONSE_LEN), generator=gen)
    response_mask = torch.tensor([[1] * n + [0] * (RESPONSE_LEN - n) for n in RESPONSE_TOKENS])
    attention_mask = torch.cat([torch.ones(4, PROMPT_LEN, dtype=torch.long), response_mask], dim=1)
    advantages = torch.tensor(ADVANTAGES).unsqueeze(-1) * response_mask
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: ids[:, PROMPT_LEN:],
            keys.RESPONSE_MASK: response_mask,
            keys.ADVANTAGES: advantages.float(),
        }
    )


def _actor_config(mode: str, rows_per_rank: int, micro: int):
    return OmegaConf.create(
        {
            "ppo_mini_batch_size": rows_per_rank,
            "ppo_micro_batch_size_per_gpu": micro,
            "use_dynamic_bsz": False,
            "ppo_max_token_len_per_gpu": 4096,
            "ppo_epochs": 1,
            "shuffle": False,
            "grad_clip": 1.0,
            "clip_ratio": 0.2,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.2,
            "clip_ratio_c": 3.0,
            "loss_agg_mode": mode,
            "loss_scale_factor": None,
            "entropy_coeff": 0.0,
            "use_kl_loss": False,
            "policy_loss": {"loss_mode": "vanilla"},
        }
    )


def _full_grads(
    model_dir: str, mode: str, rows: list[int], world: int, micro: int
) -> dict[str, torch.Tensor]:
    """Gradients of one mini-batch through the FSDP2 actor on ``rows`` of _batch() (this rank's)."""
    module = build_fsdp_module(
        OmegaConf.create({"path": model_dir}), OmegaConf.create({}), build_device_mesh(world, "cpu")
    )
    actor = DataParallelPPOActor(
        _actor_config(mode, len(rows), micro),
        module,
        torch.optim.SGD(module.parameters(), lr=0.0),
        response_length=RESPONSE_LEN,
    )
    data = _batch().select_idxs(torch.tensor(rows))
    batching = OmegaConf.create(
        {
            "log_prob_micro_batch_size_per_gpu": 4,
            "log_prob_use_dynamic_bsz": False,
            "log_prob_max_token_len_per_gpu": None,
        }
    )
    old_log_probs, _ = actor.compute_log_prob(data, batching)  # ratio 1: the PPO loss is -A log pi
    data.batch[keys.OLD_LOG_PROBS] = old_log_probs
    module.train()
    actor.accumulate_gradients(data, temperature=1.0, metrics={})
    return {name: full_value(p.grad).clone() for name, p in module.named_parameters() if p.grad is not None}


def _reference_grads(model_dir: str, mode: str) -> dict[str, torch.Tensor]:
    """float64 gradient of the mini-batch objective on all 4 rows in one piece, untrimmed, by hand."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    data = _batch().batch
    logits = model(
        input_ids=data[keys.INPUT_IDS],
        attention_mask=data[keys.ATTENTION_MASK],
        position_ids=data[keys.POSITION_IDS],
        use_cache=False,
    ).logits[:, PROMPT_LEN - 1 : -1]
    log_probs = torch.log_softmax(logits, -1).gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    mask = data[keys.RESPONSE_MASK].double()
    per_token = -data[keys.ADVANTAGES].double() * log_probs * mask  # d/dθ of -A r at r = 1
    seq_sums = per_token.sum(-1)
    objective = {
        "token-mean": per_token.sum() / mask.sum(),
        "seq-mean-token-sum": seq_sums.sum() / 4,
        "seq-mean-token-mean": (seq_sums / mask.sum(-1)).sum() / 4,
        "seq-mean-token-sum-norm": seq_sums.sum() / RESPONSE_LEN,
    }[mode]
    objective.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name].double(), want[name], rtol=2e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_of_unequal_size_give_the_mini_batch_gradient(tiny_model_dir, mode):
    want = _reference_grads(tiny_model_dir, mode)
    with gloo_group():
        one_micro = _full_grads(tiny_model_dir, mode, [0, 1, 2, 3], world=1, micro=4)
        four_micros = _full_grads(tiny_model_dir, mode, [0, 1, 2, 3], world=1, micro=1)
    _assert_close(one_micro, want)
    _assert_close(four_micros, want)


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, 2, port):
        for mode in MODES:
            # rank 0 holds rows 0 and 2 (9 tokens), rank 1 rows 1 and 3 (5 tokens); one row per micro
            grads = _full_grads(model_dir, mode, [rank, rank + 2], world=2, micro=1)
            if rank == 0:
                torch.save(grads, os.path.join(out_dir, f"{mode}.pt"))


def test_two_ranks_give_the_mini_batch_gradient(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(free_port(), tiny_model_dir, str(tmp_path)), nprocs=2, join=True)
    for mode in MODES:
        _assert_close(torch.load(tmp_path / f"{mode}.pt"), _reference_grads(tiny_model_dir, mode))
