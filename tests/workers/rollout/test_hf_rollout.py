"""The HF rollout samples exactly the configured distribution: a checkpoint whose
``generation_config.json`` sets ``repetition_penalty``, ``no_repeat_ngram_size``, ``top_k`` or ``min_p``
changes nothing."""

import json
import shutil

import pytest
import torch

from hybridflow import keys
from hybridflow.workers.rollout.hf_rollout import HFRollout
from tests.workers.engine_prompts import EOS, PAD, hf_greedy, tiny_prompts
from tests.workers.rollout.test_engine_rollout import _rollout_config

RESPONSE_LENGTH = 8


def _model_with(tiny_model_dir, tmp_path_factory, **extras):
    """The tiny model, saved with a generation_config.json holding ``extras``."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("extras") / "model"
    shutil.copytree(tiny_model_dir, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(extras)
    (path / "generation_config.json").write_text(json.dumps(gen))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for key, value in extras.items():
        assert getattr(model.generation_config, key) == value
    return model


@pytest.fixture(scope="module")
def penalised_model(tiny_model_dir, tmp_path_factory):
    return _model_with(tiny_model_dir, tmp_path_factory, repetition_penalty=2.0, no_repeat_ngram_size=2)


@pytest.fixture(scope="module")
def truncated_model(tiny_model_dir, tmp_path_factory):
    """Sampling settings that would cut the distribution: top-3 and min_p 0.3 (kept separate from the
    repetition penalty, which would move the raw-logit ranks the test measures)."""
    return _model_with(tiny_model_dir, tmp_path_factory, top_k=3, min_p=0.3, do_sample=True, temperature=0.3)


def _rollout(model, **overrides):
    values = {"data.max_response_length": RESPONSE_LENGTH, **overrides}
    return HFRollout(model, _rollout_config(**{"actor_rollout_ref.rollout.name": "hf", **values}))


def _argmax_decode(model, prompts) -> torch.Tensor:
    """Greedy from the raw forward, recomputed over the whole sequence each step (no cache, no
    logits processor); rows stop at EOS and are padded after it."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    out = []
    with torch.no_grad():
        for _ in range(RESPONSE_LENGTH):
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]
            token = torch.where(done, torch.full_like(done, PAD, dtype=torch.long), logits.argmax(-1))
            out.append(token)
            done |= token == EOS
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(token[:, None])], dim=1)
    return torch.stack(out, dim=1)


def test_greedy_is_the_argmax_of_the_raw_forward(penalised_model):
    prompts = tiny_prompts()
    expected = _argmax_decode(penalised_model, prompts)
    # the checkpoint's repetition penalty does change a plain generate() on these prompts
    assert not torch.equal(hf_greedy(penalised_model, prompts, RESPONSE_LENGTH), expected)
    output = _rollout(penalised_model).generate_sequences(prompts)
    assert torch.equal(output.batch[keys.RESPONSES], expected)


def test_sampling_is_not_restricted_by_the_checkpoint(truncated_model):
    """At temperature 1 with top-k/top-p off, some of 3 x 16 x 8 sampled tokens fall outside the raw
    top 3 and below 0.3 x the most likely token's probability (the checkpoint's top_k=3 or min_p=0.3
    would allow neither)."""
    model = truncated_model
    prompts = tiny_prompts(n=16, do_sample=True)
    output = _rollout(model, **{"actor_rollout_ref.rollout.temperature": 1.0}).generate_sequences(prompts)
    responses, response_mask = output.batch[keys.RESPONSES], output.batch[keys.RESPONSE_MASK].bool()
    with torch.no_grad():
        logits = model(
            input_ids=output.batch[keys.INPUT_IDS],
            attention_mask=output.batch[keys.ATTENTION_MASK],
            position_ids=output.batch[keys.POSITION_IDS],
        ).logits[:, -RESPONSE_LENGTH - 1 : -1]
    chosen = logits.gather(-1, responses[..., None]).squeeze(-1)
    rank = (logits > chosen[..., None]).sum(-1)  # 0 = the most likely token
    prob_vs_best = (chosen - logits.amax(-1)).exp()  # p(token) / p(most likely token)
    assert (rank[response_mask] >= 3).any()
    assert (prob_vs_best[response_mask] < 0.3).any()
    assert model.generation_config.top_k == 3  # the model's own config is left as it was
