"""The padding-free packed forward (hybridflow/workers/packed_rows.py) gives the padded layout's
log-probs, entropies, values and gradients (float64, GQA model), and is chosen only where it saves."""

import pytest
import torch
import transformers

from hybridflow import keys
from hybridflow.models import attention
from hybridflow.models.attention import register_cpu_attention
from hybridflow.protocol import DataProto
from hybridflow.workers import packed_rows, shared_prefix
from hybridflow.workers.actor.dp_actor import response_log_probs
from hybridflow.workers.critic.dp_critic import forward_values
from tests.tiny_configs import tiny_decoder_config
from tests.workers.grouped_batches import grouped_batch

PROMPT_LEN, RESPONSE_LEN, VOCAB = 7, 6, 97
# GRPO groups (n = 3, an empty response included), then two rows whose prompts nobody shares
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20, 21, 22]]
RESPONSE_LENGTHS = [[5, 1, 0], [3, 6, 2], [4], [6]]


def _batch() -> DataProto:
    return grouped_batch(PROMPTS, RESPONSE_LENGTHS, PROMPT_LEN, RESPONSE_LEN, (23, VOCAB))


def _config(impl: str, arch: str = "qwen2"):
    return tiny_decoder_config(arch, impl, vocab_size=VOCAB, max_position_embeddings=64)


@pytest.fixture
def layout(monkeypatch):
    """``layout("packed")``: always the padding-free rows; ``layout("padded")``: the trimmed padded
    rows (no packing of any kind)."""

    def set_layout(name: str) -> None:
        monkeypatch.setattr(packed_rows, "MAX_TOKEN_FRACTION", 1e9 if name == "packed" else -1.0)
        monkeypatch.setattr(shared_prefix, "MIN_SAVING", 1e9)

    return set_layout


def _log_probs_and_grads(model, data: DataProto):
    model.zero_grad()
    log_probs, entropy = response_log_probs(model, data, temperature=0.7, with_entropy=True)
    mask = data.batch[keys.RESPONSE_MASK].double()
    weights = torch.linspace(0.5, 1.5, mask.shape[1], dtype=torch.float64)  # every position matters
    ((log_probs.double() * mask * weights).sum() + (entropy.double() * mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return log_probs * mask, entropy * mask, grads


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_rows_equal_the_padded_rows_with_gradients(layout, monkeypatch, family):
    calls = []
    real = attention.packed_attention
    monkeypatch.setattr(attention, "packed_attention", lambda *a: calls.append(1) or real(*a))
    config = _config(register_cpu_attention(), family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    data = _batch()
    layout("padded")
    padded = _log_probs_and_grads(model, data)
    layout("packed")
    assert packed_rows.plan_packed_rows(data, PROMPT_LEN + RESPONSE_LEN) is not None
    assert not calls
    packed = _log_probs_and_grads(model, data)
    assert len(calls) == 2  # the packed forward ran, one call per layer
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(packed[1], padded[1], rtol=0, atol=1e-6)
    assert set(packed[2]) == set(padded[2])
    for name, grad in padded[2].items():
        # outputs are cast to fp32 (as in training): agreement to fp32 rounding of the logits
        torch.testing.assert_close(packed[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert packed[0][2].abs().sum() == 0  # the empty response gets nothing
    assert packed[0].abs().sum() > 0 and packed[2]["model.embed_tokens.weight"].abs().sum() > 0


def test_packed_rows_equal_sdpa_on_the_padded_rows(layout):
    """The reference is transformers' own SDPA on the untrimmed padded batch, not our attention."""
    torch.manual_seed(0)
    sdpa = transformers.Qwen2ForCausalLM(_config("sdpa")).double()
    torch.manual_seed(0)
    ours = transformers.Qwen2ForCausalLM(_config(register_cpu_attention())).double()
    data = _batch()
    layout("padded")
    expected = _log_probs_and_grads(sdpa, data)
    layout("packed")
    packed = _log_probs_and_grads(ours, data)
    torch.testing.assert_close(packed[0], expected[0], rtol=0, atol=1e-6)
    for name, grad in expected[2].items():
        torch.testing.assert_close(packed[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_packed_rows_through_sdpa_equal_the_padded_rows(layout, monkeypatch):
    """Above the weights bound the gathered rows go through SDPA (GQA, boolean mask): same outputs."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(_config(register_cpu_attention())).double()
    data = _batch()
    layout("padded")
    padded = _log_probs_and_grads(model, data)
    layout("packed")
    monkeypatch.setattr(attention, "EAGER_MAX_BYTES", 0)
    packed = _log_probs_and_grads(model, data)
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=1e-6)
    for name, grad in padded[2].items():
        torch.testing.assert_close(packed[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_packed_critic_values_equal_the_padded_ones(layout):
    torch.manual_seed(0)
    config = _config(register_cpu_attention())
    config.num_labels = 1
    critic = transformers.Qwen2ForTokenClassification(config).double().eval()  # no classifier dropout
    layout("padded")
    padded = forward_values(critic, _batch())
    layout("packed")
    packed = forward_values(critic, _batch())
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-6)


def test_each_token_is_computed_once_and_queried_by_one_row():
    data = _batch()
    plan = packed_rows.plan_packed_rows(data, PROMPT_LEN + RESPONSE_LEN)
    assert plan is not None
    # 4 + 6 + 1 + 7 prompt tokens once, plus every response token
    expected_tokens = sum(map(len, PROMPTS)) + sum(map(sum, RESPONSE_LENGTHS))
    assert plan.input_ids.shape == (1, expected_tokens)
    rows = plan.attention_mask.packed_rows
    slots = rows.query_index.reshape(-1)[rows.token_slot]
    assert torch.equal(slots, torch.arange(expected_tokens))  # each token is its own slot's query
    # a response token of a group's second row sees its prompt and its own earlier tokens only
    mask = plan.attention_mask[4, 0]  # row 4: the second row of prompt 2 (6 response tokens)
    assert mask[0, :6].all() and not mask[0, 7:].any()  # first response token: 6 prompt keys + itself
    assert mask[5, :12].all()


def test_the_layout_is_chosen_by_its_token_count():
    data = _batch()
    assert packed_rows.plan_packed_rows(data, PROMPT_LEN + RESPONSE_LEN) is not None
    full = _batch().select_idxs(torch.tensor([6, 7]))  # distinct prompts: only padding to save
    full.batch[keys.ATTENTION_MASK][:] = 1
    assert packed_rows.plan_packed_rows(full, PROMPT_LEN + RESPONSE_LEN) is None  # nothing to save
    gap = _batch()
    gap.batch[keys.ATTENTION_MASK][0, PROMPT_LEN + 1] = 0  # an unattended column inside a response
    assert packed_rows.plan_packed_rows(gap, PROMPT_LEN + RESPONSE_LEN) is None


def test_a_single_row_carries_no_quadratic_mask(monkeypatch):
    """One row queried whole (SP's one long sequence per micro-batch) is plain causal: the plan carries
    a stride-0 placeholder, not a (Q, K) mask, and both attention paths (matmul form, SDPA) give
    causal attention over the packed tokens."""
    data = _batch().select_idxs(torch.tensor([3]))  # prompt 1 (6 tokens), 3 response tokens
    plan = packed_rows.plan_packed_rows(data, PROMPT_LEN + RESPONSE_LEN, always=True)
    tokens = plan.input_ids.shape[1]
    assert tokens == 9 and plan.attention_mask.packed_rows.causal
    assert plan.attention_mask.shape == (1, 1, tokens, tokens)
    assert plan.attention_mask.untyped_storage().nbytes() == 1  # one bool, whatever the length
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, 8, generator=gen, dtype=torch.float64) for heads in (4, 2, 2))
    scores = torch.einsum("hqd,hkd->hqk", q[0], k[0].repeat_interleave(2, dim=0)) * 8**-0.5
    scores = scores.masked_fill(~torch.ones(tokens, tokens, dtype=torch.bool).tril(), float("-inf"))
    want = torch.einsum("hqk,hkd->qhd", scores.softmax(-1), v[0].repeat_interleave(2, dim=0))[None]
    module = torch.nn.Module().eval()
    matmul, _ = attention.cpu_attention_forward(module, q, k, v, plan.attention_mask)
    monkeypatch.setattr(attention, "EAGER_MAX_BYTES", 0)
    sdpa, _ = attention.cpu_attention_forward(module, q, k, v, plan.attention_mask)
    torch.testing.assert_close(matmul, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(sdpa, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["packed", "block_mask", "padded"])
def test_the_forward_tally_counts_each_shared_prompt_once(layout, monkeypatch, name):
    """``perf/mfu/actor`` counts the update's FLOPs as the rows' less those of the repeated prompts
    (the tally of ``tally_forwards``): exactly the packed layouts' tokens through the dense layers and
    their attended pairs (a group: ``p^2 + sum(2 p r + r^2)``); nothing less in the padded layout."""
    from hybridflow.utils.flops_counter import FlopsCounter
    from hybridflow.workers.forward import tally_forwards

    layout("packed" if name == "packed" else "padded")
    if name == "block_mask":
        monkeypatch.setattr(shared_prefix, "MIN_SAVING", -1e9)  # the block mask, whatever it saves
    config = _config(register_cpu_attention() if name == "packed" else "sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad(), tally_forwards() as tally:
        response_log_probs(model, _batch(), temperature=1.0)
    rows = [len(p) + r for p, lengths in zip(PROMPTS, RESPONSE_LENGTHS) for r in lengths]
    assert tally.rows == rows
    groups = [(len(p), lengths) for p, lengths in zip(PROMPTS, RESPONSE_LENGTHS)]
    if name == "padded":
        assert tally.repeated_prompts == []
        return
    assert tally.repeated_prompts == [4, 4, 6, 6]  # the two groups of 3; the lone prompts: none
    counter = FlopsCounter(config)
    quadratic = (counter.flops([2]) - 2 * counter.flops([1])) / 2  # flops(s) = linear s + quadratic s^2
    linear = counter.flops([1]) - quadratic
    tokens = sum(p + sum(lengths) for p, lengths in groups)
    pairs = sum(p * p + sum(2 * p * r + r * r for r in lengths) for p, lengths in groups)
    computed = linear * tokens + quadratic * pairs
    assert counter.flops(rows) - counter.flops(tally.repeated_prompts) == pytest.approx(computed, rel=1e-12)
    saved = counter.saved_fraction(tally.rows, tally.repeated_prompts)
    assert saved == pytest.approx(1 - computed / counter.flops(rows), rel=1e-12) and 0 < saved < 1
