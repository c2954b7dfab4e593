"""Gemma 2/3's attention logit softcapping and sliding window, and Mistral's window, in the CPU training
attention (hybridflow/models/attention.py), against HF's eager attention on the same weights, float64:
the actor's log-probs in every layout (no mask, the padded rows, the packed rows) and the layouts'
gradients, issue 48 item 5. HF's eager attention takes its softmax in fp32 even in float64, so agreement
is to ~1e-6, and the controls show what dropping the softcap or the window would change (> 1e-2).
Before, the softcap was dropped everywhere and the window wherever the function built its own mask: a
Gemma 2 actor computed other log-probs than HF's, silently."""

import pytest
import torch
import transformers

from hybridflow.models import attention
from hybridflow.models.attention import register_cpu_attention, windowed
from hybridflow.workers import packed_rows, shared_prefix
from hybridflow.workers.actor.dp_actor import response_log_probs
from tests.tiny_configs import TINY_DECODER
from tests.workers.grouped_batches import grouped_batch

PROMPT_LEN, RESPONSE_LEN, VOCAB = 7, 6, 97
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]
RESPONSE_LENGTHS = [[5, 2], [6, 3], [6]]
WINDOW = 3  # shorter than every row: each sliding layer drops keys
TINY = {**TINY_DECODER, "vocab_size": VOCAB, "max_position_embeddings": 64, "head_dim": 16}


def _config(family: str, impl: str):
    if family == "gemma2":
        config = transformers.Gemma2Config(
            **TINY,
            attn_logit_softcapping=2.0,  # small: most scores are capped
            final_logit_softcapping=3.0,
            sliding_window=WINDOW,
            query_pre_attn_scalar=12,
        )
    elif family == "gemma3_text":
        config = transformers.Gemma3TextConfig(
            **TINY,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=2.0,
            query_pre_attn_scalar=12,
        )
    else:
        config = transformers.MistralConfig(**TINY, sliding_window=WINDOW)
    config._attn_implementation = impl
    return config


def _models(family: str):
    """Ours and HF eager on the same random weights, the query/key projections scaled up so that the
    attention scores are large: the softcap bites and a dropped key matters (checked by the controls)."""
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(_config(family, register_cpu_attention())).double()
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(6.0)
    eager = transformers.AutoModelForCausalLM.from_config(_config(family, "eager")).double()
    eager.load_state_dict(ours.state_dict())
    return ours, eager


def _log_probs_and_grads(model, data):
    model.zero_grad()
    log_probs, _ = response_log_probs(model, data, temperature=0.7)
    mask = data.batch["response_mask"].double()
    (log_probs.double() * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return log_probs * mask, grads


def _eager_reference(eager, data, temperature: float = 0.7) -> torch.Tensor:
    """HF eager's log-probs of each row's response, the row run alone with no padding and no mask (HF's
    eager attention turns a left-padded row's unattended queries into NaN, which its masked keys spread)."""
    mask = data.batch["attention_mask"]
    out = torch.zeros(data.batch["responses"].shape, dtype=torch.float64)
    for row in range(len(data)):
        ids = data.batch["input_ids"][row][mask[row].bool()]
        n = int(data.batch["response_mask"][row].sum())
        if n == 0:
            continue
        with torch.no_grad():
            logits = eager(ids[None]).logits[0, -n - 1 : -1].double() / temperature
        out[row, :n] = torch.log_softmax(logits, -1).gather(-1, ids[-n:, None])[:, 0]
    return out


@pytest.fixture
def layout(monkeypatch):
    def set_layout(name: str) -> None:
        monkeypatch.setattr(packed_rows, "MAX_TOKEN_FRACTION", 1e9 if name == "packed" else -1.0)
        monkeypatch.setattr(shared_prefix, "MIN_SAVING", 1e9)

    return set_layout


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "mistral"])
def test_log_probs_equal_hf_eager_and_layouts_agree_with_gradients(layout, monkeypatch, family):
    ours, eager = _models(family)
    data = grouped_batch(PROMPTS, RESPONSE_LENGTHS, PROMPT_LEN, RESPONSE_LEN, (23, VOCAB))
    reference = _eager_reference(eager, data)
    calls = []
    real = attention.packed_attention
    monkeypatch.setattr(attention, "packed_attention", lambda *a: calls.append(1) or real(*a))
    results = {}
    for name in ("padded", "packed"):
        layout(name)
        results[name] = _log_probs_and_grads(ours, data)
        torch.testing.assert_close(results[name][0], reference, rtol=0, atol=1e-5, msg=f"{family} {name}")
    assert calls  # the packed layout ran
    # both layouts differentiate the same function (logits cast to fp32 as in training: test_packed_rows)
    for key, grad in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][key], grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_no_mask_passed_keeps_softcap_and_window(family):
    """A forward with no attention mask at all: our function builds the causal mask itself."""
    ours, eager = _models(family)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(ids).logits, eager(ids).logits, rtol=0, atol=1e-5)


def test_the_window_counts_attended_positions_not_slots():
    """A shared-prompt block mask: a second response's tokens sit after the first's slots, which it
    does not attend; its window counts its own positions (prompt, then its tokens)."""
    keep = torch.ones(1, 1, 7, 7, dtype=torch.bool).tril()
    keep[:, :, 5:, 3:5] = False  # slots 3-4: response A; 5-6: response B after prompt slots 0-2
    window = windowed(keep, 3)
    # slots 2, 5, 6 hold positions 2, 3, 4: the query's 3 most recent
    assert window[0, 0, 6].tolist() == [False, False, True, False, False, True, True]


def test_softcap_would_be_missed_without_it(monkeypatch):
    """The control: dropping the softcap (today's code before the fix) changes the log-probs by far more
    than the tolerance above, so the equality means something."""
    ours, eager = _models("gemma2")
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    real = attention.grouped_attention
    monkeypatch.setattr(
        attention, "grouped_attention", lambda q, k, v, m, s, softcap=None: real(q, k, v, m, s)
    )
    assert (ours(ids).logits - eager(ids).logits).abs().max() > 1e-3
