"""The hybrid engine in one process: an FSDP2-sharded actor feeds the engine rollout in place."""

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config
from hybridflow.workers.fsdp_utils import apply_fsdp2, build_device_mesh, full_state_dict
from hybridflow.workers.rollout.engine_rollout import EngineRollout, prompt_groups
from tests.utils.checkpoint.fsdp_toy import gloo_group

PAD, EOS = 3, 2


def _rollout_config(**overrides):
    values = {"data.max_prompt_length": 16, "data.max_response_length": 8, **overrides}
    config = load_config([f"{k}={v}" for k, v in values.items()])
    OmegaConf.resolve(config)
    return config.actor_rollout_ref.rollout


def _prompts(n: int = 1, do_sample: bool = False) -> DataProto:
    rows = [[1, 9, 14, 22, 5], [1, 30, 7], [1, 11, 12, 13, 40, 41, 42]]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows]).repeat_interleave(n, dim=0)
    mask = (ids != PAD).long()
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    )
    data.meta_info = {"eos_token_id": [EOS], "pad_token_id": PAD, "do_sample": do_sample, "global_steps": 1}
    return data


def _hf_greedy(model, data: DataProto, new_tokens: int) -> torch.Tensor:
    out = model.generate(
        input_ids=data.batch["input_ids"],
        attention_mask=data.batch["attention_mask"],
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    generated = out[:, data.batch["input_ids"].shape[1] :]
    return torch.nn.functional.pad(generated, (0, new_tokens - generated.shape[1]), value=PAD)


def _train_one_step(module) -> None:
    ids = torch.randint(4, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    loss = module(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(module.parameters(), lr=2.0).step()
    module.zero_grad(set_to_none=True)


@pytest.fixture
def sharded_actor(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    with gloo_group():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        yield apply_fsdp2(model, build_device_mesh(1, "cpu"), OmegaConf.create({}))


def test_prompt_groups_merge_neighbouring_repeats():
    data = _prompts(n=3)
    groups = prompt_groups(data.batch["input_ids"], data.batch["attention_mask"])
    assert [(len(p), n) for p, n in groups] == [(5, 3), (3, 3), (7, 3)]


def test_weight_sync_in_place_changes_generation_without_a_second_copy(sharded_actor, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    rollout = EngineRollout(sharded_actor, _rollout_config(), rank=0)
    prompts = _prompts()
    before = rollout.generate_sequences(prompts).batch[keys.RESPONSES]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(before, _hf_greedy(initial, prompts, 8))
    assert rollout.engine.cache.nbytes == 0  # free_cache_engine: no KV cache between rollouts

    _train_one_step(sharded_actor)
    stale = rollout.generate_sequences(prompts).batch[keys.RESPONSES]
    assert torch.equal(stale, before)  # the engine holds its own weights until synced
    metrics = rollout.update_weights()
    after = rollout.generate_sequences(prompts).batch[keys.RESPONSES]
    assert not torch.equal(after, before)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained.load_state_dict(full_state_dict(sharded_actor))
    assert torch.equal(after, _hf_greedy(trained, prompts, 8))

    layers = trained.model.layers
    layer_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)
    total = sum(p.numel() * p.element_size() for p in trained.parameters())
    root_bytes = total - sum(p.numel() * p.element_size() for p in layers.parameters())
    # one FSDP unit (a decoder layer, or the root's embedding + norm) gathered at a time
    assert 0 < rollout.last_sync.peak_extra_bytes <= max(layer_bytes, root_bytes) < total / 2
    assert metrics["update_weights"] > 0
    local = {p.to_local().untyped_storage().data_ptr() for p in sharded_actor.parameters()}
    engine = {t.untyped_storage().data_ptr() for t, _, _ in rollout.model._targets.values()}
    assert not local & engine  # the engine's tensors are its own, not views of the actor's


def test_rollout_log_probs_match_the_actor_forward(sharded_actor):
    from hybridflow.workers.forward import response_outputs

    rollout = EngineRollout(sharded_actor, _rollout_config(**{"actor_rollout_ref.rollout.temperature": 0.7}))
    output = rollout.generate_sequences(_prompts(n=4, do_sample=True))
    logits = response_outputs(sharded_actor, output) / 0.7
    recomputed = (
        torch.log_softmax(logits, -1).gather(2, output.batch[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    )
    mask = output.batch[keys.RESPONSE_MASK].bool()
    diff = (output.batch[keys.ROLLOUT_LOG_PROBS] - recomputed).abs()[mask]
    assert diff.max().item() <= 1e-5
    assert output.meta_info["temperature"] == 0.7
