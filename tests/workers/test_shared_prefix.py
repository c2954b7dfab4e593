"""Shared-prompt packing gives the padded layout's log-probs, entropies, values and gradients (float64
reference), and is chosen only when it saves FLOPs."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.workers import shared_prefix
from hybridflow.workers.actor.dp_actor import response_log_probs
from hybridflow.workers.critic.dp_critic import forward_values
from tests.workers.grouped_batches import grouped_batch

PROMPT_LEN, RESPONSE_LEN = 7, 6
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
RESPONSE_LENGTHS = [[5, 1, 0], [3, 3, 2], [6, 4, 1]]  # n = 3 per prompt, an empty one included


def _batch() -> DataProto:
    return grouped_batch(PROMPTS, RESPONSE_LENGTHS, PROMPT_LEN, RESPONSE_LEN, (20, 200))


@pytest.fixture
def packing(monkeypatch):
    """``packing(True)``: always pack; ``packing(False)``: never."""

    def set_mode(on: bool) -> None:
        monkeypatch.setattr(shared_prefix, "MIN_SAVING", -1e9 if on else 1e9)

    return set_mode


def _log_probs_and_grads(model, packing_on: bool, set_packing):
    set_packing(packing_on)
    model.zero_grad()
    data = _batch()
    log_probs, entropy = response_log_probs(model, data, temperature=0.7, with_entropy=True)
    mask = data.batch[keys.RESPONSE_MASK].double()
    ((log_probs.double() * mask).sum() + (entropy.double() * mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return log_probs * mask, entropy * mask, grads


def test_packed_log_probs_entropy_and_gradients_equal_the_padded_ones(tiny_model_dir, packing):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    padded = _log_probs_and_grads(model, False, packing)
    packed = _log_probs_and_grads(model, True, packing)
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(packed[1], padded[1], rtol=0, atol=1e-6)
    assert set(packed[2]) == set(padded[2])
    for name, grad in padded[2].items():
        # outputs are cast to fp32 (as in training): agreement to fp32 rounding of the logits
        torch.testing.assert_close(packed[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # the empty response (row 2) gets nothing, and the shared first-token prediction is per row
    assert packed[0][2].abs().sum() == 0 and (packed[0][0, 0] != packed[0][1, 0])


def test_packed_critic_values_equal_the_padded_ones(tiny_model_dir, packing):
    critic = AutoModelForTokenClassification.from_pretrained(
        tiny_model_dir, num_labels=1, dtype=torch.float64
    )
    packing(False)
    padded = forward_values(critic, _batch())
    packing(True)
    packed = forward_values(critic, _batch())
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-6)


def test_packing_is_chosen_by_its_flops(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    # short answers to a 4-6 token prompt: the 9 rows' 13 columns shrink to 3 packed rows of <= 17 tokens
    assert shared_prefix.plan_packing(_batch(), config, padded_width=PROMPT_LEN + RESPONSE_LEN) is not None
    distinct = _batch().select_idxs(torch.tensor([0, 3, 6]))  # one row per prompt: nothing is shared
    assert shared_prefix.plan_packing(distinct, config, padded_width=PROMPT_LEN + RESPONSE_LEN) is None
    long = _batch()
    long.batch[keys.ATTENTION_MASK][:, PROMPT_LEN:] = 1  # every response runs to the end
    # 3 rows of 4-6 + 18 tokens: the dense block mask costs more than the prompt it saves
    assert shared_prefix.plan_packing(long, config, padded_width=4) is None
