"""The shared forward trims the padding columns no row attends to, and gives the same log-probs,
entropies and values as the untrimmed forward (float64 reference)."""

import pytest
import torch

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.workers.actor.dp_actor import response_log_probs
from hybridflow.workers.critic.dp_critic import forward_values
from hybridflow.workers.forward import attended_span, pad_responses
from hybridflow.workers.lora import apply_lora

PAD = 0
PROMPT_LEN, RESPONSE_LEN = 9, 7


def _batch() -> DataProto:
    """Three rows with prompts of 3-5 tokens (so columns 0-3 are padding in every row) and responses
    of 0, 2 and 4 tokens (columns 4-6 of the response are padding in every row)."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16]]
    responses = [[], [20, 21], [22, 23, 24, 25]]
    ids, mask = [], []
    for prompt, response in zip(prompts, responses, strict=True):
        left = PROMPT_LEN - len(prompt)
        right = RESPONSE_LEN - len(response)
        ids.append([PAD] * left + prompt + response + [PAD] * right)
        mask.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
    input_ids, attention_mask = torch.tensor(ids), torch.tensor(mask)
    data = DataProto.from_dict(
        {
            keys.INPUT_IDS: input_ids,
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: input_ids[:, PROMPT_LEN:],
            keys.RESPONSE_MASK: attention_mask[:, PROMPT_LEN:],
        }
    )
    return data


def _untrimmed_response_logits(model, data: DataProto) -> torch.Tensor:
    """The full-width forward in float64: (b, T_r, C)."""
    out = model.double()(
        input_ids=data.batch[keys.INPUT_IDS],
        attention_mask=data.batch[keys.ATTENTION_MASK],
        position_ids=data.batch[keys.POSITION_IDS],
        use_cache=False,
    )
    model.float()
    return out.logits[:, -RESPONSE_LEN - 1 : -1]


def _seen_widths(model) -> list[int]:
    """Records the sequence length of every forward through the embedding."""
    widths: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[1]))
    return widths


@pytest.fixture()
def causal_lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def test_attended_span_keeps_one_prompt_and_one_response_column():
    mask = _batch().batch[keys.ATTENTION_MASK]
    assert attended_span(mask, PROMPT_LEN) == (4, PROMPT_LEN + 4)
    assert attended_span(torch.ones(2, 5, dtype=torch.long), 3) == (0, 5)
    assert attended_span(torch.zeros(2, 5, dtype=torch.long), 3) == (2, 4)  # nothing attended
    prompt_only = torch.tensor([[0, 1, 1, 0, 0]])
    assert attended_span(prompt_only, 3) == (1, 4)  # an empty response still has one column


def test_trimmed_log_probs_and_entropy_match_the_full_forward(causal_lm):
    data = _batch()
    widths = _seen_widths(causal_lm)
    with torch.no_grad():
        log_probs, entropy = response_log_probs(causal_lm, data, temperature=0.7, with_entropy=True)
        reference = torch.log_softmax(_untrimmed_response_logits(causal_lm, data) / 0.7, dim=-1)
    assert widths[0] == 9  # of 16 columns: 4 leading and 3 trailing padding columns are cut
    expected = reference.gather(-1, data.batch[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(reference.exp() * reference).sum(-1)
    mask = data.batch[keys.RESPONSE_MASK].bool()
    assert log_probs.shape == entropy.shape == (3, RESPONSE_LEN)
    assert torch.allclose(log_probs[mask].double(), expected[mask], atol=1e-5)
    assert torch.allclose(entropy[mask].double(), expected_entropy[mask], atol=1e-5)
    assert (log_probs[:, 4:] == 0).all() and (entropy[:, 4:] == 0).all()  # the trimmed columns


def test_trimmed_forward_through_a_peft_model_keeps_the_gradient(causal_lm):
    from omegaconf import OmegaConf

    lora_cfg = OmegaConf.create({"lora_rank": 2, "lora_alpha": 4, "target_modules": "all-linear"})
    model = apply_lora(causal_lm, lora_cfg)
    data = _batch()
    widths = _seen_widths(model)
    log_probs, _ = response_log_probs(model, data, temperature=1.0)
    (log_probs * data.batch[keys.RESPONSE_MASK]).sum().backward()
    assert widths == [9]
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_trimmed_values_match_the_full_forward(tiny_model_dir):
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    data = _batch()
    widths = _seen_widths(critic)
    with torch.no_grad():
        values = forward_values(critic, data)
        expected = _untrimmed_response_logits(critic, data)[..., 0] * data.batch[keys.RESPONSE_MASK]
    assert widths[0] == 9
    assert values.shape == (3, RESPONSE_LEN)
    assert torch.allclose(values.double(), expected, atol=1e-5)


def test_pad_responses_widens_with_zeros():
    widened = pad_responses(torch.ones(2, 3), 5)
    assert widened.tolist() == [[1, 1, 1, 0, 0]] * 2
    same = torch.ones(2, 5)
    assert pad_responses(same, 5) is same
