"""The engine's weight sync checks what arrived: every engine weight exactly once, with its shape.

A sync that leaves a weight out would let the engine generate from uninitialised memory (or last
step's weights) without a word; these tests build real tiny Qwen2 models that differ from the
engine's layout and expect an error naming every offending tensor."""

import copy

import pytest
import torch

from hybridflow.workers.rollout.engine import EngineModel
from hybridflow.workers.rollout.engine.weight_sync import WeightLedger, WeightSyncError, sync_weights

MAX_POSITIONS = 32


@pytest.fixture
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _engine(model) -> EngineModel:
    return EngineModel.empty_like_hf_module(model, MAX_POSITIONS)


def test_a_complete_sync_copies_every_weight(model):
    engine = _engine(model)
    stats = sync_weights(engine, model)
    assert stats.tensors == len(engine.weight_names)  # tied embeddings: lm_head is the embedding
    assert torch.equal(engine.final_norm, model.model.norm.weight)
    assert torch.equal(engine.layers[1].down, model.model.layers[1].mlp.down_proj.weight)


def test_a_missing_weight_is_an_error(model):
    engine = _engine(model)
    broken = copy.deepcopy(model)
    broken.model.norm = torch.nn.Identity()  # the final norm's weight never reaches the engine
    with pytest.raises(WeightSyncError, match=r"missing: model\.norm\.weight$"):
        sync_weights(engine, broken)


def test_mis_shaped_weights_are_all_named(model, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    engine = _engine(model)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.intermediate_size = 96  # the engine was laid out for 128
    other = AutoModelForCausalLM.from_config(config)
    with pytest.raises(WeightSyncError) as err:
        sync_weights(engine, other)
    message = str(err.value)
    for layer in (0, 1):
        assert f"model.layers.{layer}.mlp.gate_proj.weight: engine expects (128, 64), got (96, 64)" in message
        assert f"model.layers.{layer}.mlp.up_proj.weight: engine expects (128, 64), got (96, 64)" in message
        assert f"model.layers.{layer}.mlp.down_proj.weight: engine expects (64, 128), got (64, 96)" in message
    assert "missing" not in message  # the names arrived, with the wrong shapes


def test_an_extra_weight_is_an_error(model):
    engine = _engine(model)
    extended = copy.deepcopy(model)
    extended.model.layers[0].self_attn.register_parameter("gate", torch.nn.Parameter(torch.ones(4)))
    with pytest.raises(
        WeightSyncError, match=r"unknown to the engine: model\.layers\.0\.self_attn\.gate \(4,\)"
    ):
        sync_weights(engine, extended)


def test_a_weight_sent_twice_is_an_error(model):
    engine = _engine(model)
    ledger = WeightLedger(engine)
    named = list(model.named_parameters())
    for name, tensor in named + named[:1]:
        ledger.accept(name, tensor.detach())
    with pytest.raises(WeightSyncError, match=rf"sent more than once: {named[0][0]} \(x2\)"):
        ledger.check()
