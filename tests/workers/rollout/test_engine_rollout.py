"""The hybrid engine in one process: an FSDP2-sharded actor feeds the engine rollout in place."""

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config
from hybridflow.workers.fsdp_utils import apply_fsdp2, build_device_mesh, full_state_dict
from hybridflow.workers.rollout import engine_rollout
from hybridflow.workers.rollout.engine_rollout import EngineRollout, prompt_groups
from tests.utils.checkpoint.fsdp_toy import gloo_group
from tests.workers.engine_prompts import EOS, PAD, hf_greedy, tiny_prompts


def _rollout_config(**overrides):
    values = {"data.max_prompt_length": 16, "data.max_response_length": 8, **overrides}
    config = load_config([f"{k}={v}" for k, v in values.items()])
    OmegaConf.resolve(config)
    return config.actor_rollout_ref.rollout


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
    data = tiny_prompts(n=3)
    groups = prompt_groups(data.batch["input_ids"], data.batch["attention_mask"])
    assert [(len(p), n) for p, n in groups] == [(5, 3), (3, 3), (7, 3)]


def test_weight_sync_in_place_changes_generation_without_a_second_copy(sharded_actor, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    rollout = EngineRollout(sharded_actor, _rollout_config(), rank=0)
    prompts = tiny_prompts()
    before = rollout.generate_sequences(prompts).batch[keys.RESPONSES]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(before, hf_greedy(initial, prompts, 8))
    assert rollout.engine.cache.nbytes == 0  # free_cache_engine: no KV cache between rollouts

    _train_one_step(sharded_actor)
    stale = rollout.generate_sequences(prompts).batch[keys.RESPONSES]
    assert torch.equal(stale, before)  # the engine holds its own weights until synced
    metrics = rollout.update_weights()
    after = rollout.generate_sequences(prompts).batch[keys.RESPONSES]
    assert not torch.equal(after, before)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained.load_state_dict(full_state_dict(sharded_actor))
    assert torch.equal(after, hf_greedy(trained, prompts, 8))

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


def test_ignore_eos_keeps_every_token_past_an_eos_in_the_response_mask(sharded_actor):
    prompts = tiny_prompts()
    first = EngineRollout(sharded_actor, _rollout_config()).generate_sequences(prompts)
    eos = int(first.batch[keys.RESPONSES][0, 0])  # row 0's first greedy token, made its EOS below
    prompts.meta_info["eos_token_id"] = [eos]
    stopped = EngineRollout(sharded_actor, _rollout_config()).generate_sequences(prompts)
    assert stopped.batch[keys.RESPONSE_MASK][0].tolist() == [1] + [0] * 7  # cut after the EOS
    config = _rollout_config(**{"actor_rollout_ref.rollout.ignore_eos": True})
    full = EngineRollout(sharded_actor, config).generate_sequences(prompts)
    assert full.batch[keys.RESPONSE_MASK].sum(dim=1).tolist() == [8, 8, 8]  # the set length, past EOS
    assert torch.equal(full.batch[keys.RESPONSES], first.batch[keys.RESPONSES])


def test_rollout_log_probs_match_the_actor_forward(sharded_actor):
    from hybridflow.workers.actor.dp_actor import response_log_probs

    rollout = EngineRollout(sharded_actor, _rollout_config(**{"actor_rollout_ref.rollout.temperature": 0.7}))
    output = rollout.generate_sequences(tiny_prompts(n=4, do_sample=True))
    with torch.no_grad():
        recomputed, _ = response_log_probs(sharded_actor, output, 0.7)
    mask = output.batch[keys.RESPONSE_MASK].bool()
    diff = (output.batch[keys.ROLLOUT_LOG_PROBS] - recomputed).abs()[mask]
    assert diff.max().item() <= 1e-5
    assert "temperature" not in output.meta_info  # log-probs take it from config, never from a rollout


def test_multi_turn_rollout_masks_tool_turns_and_reports_tool_columns(
    sharded_actor, tiny_model_dir, tmp_path, monkeypatch
):
    import numpy as np

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.tasks.arithmetic_tools import TOOL_NAME, task_config, write_tool_task
    from hybridflow.workers.rollout.engine import SamplingParams
    from tests.workers.rollout.test_multi_turn import Script

    tokenizer = load_tokenizer(tiny_model_dir)
    _, _, tools = write_tool_task(tmp_path, task_config(num_train=4, num_test=2))
    config = _rollout_config(
        **{
            "data.max_prompt_length": 40,
            "data.max_response_length": 300,
            "actor_rollout_ref.rollout.multi_turn.enable": True,
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(tools),
        }
    )
    rollout = EngineRollout(sharded_actor, config, tokenizer=tokenizer)
    call = f'<tool_call>{{"name": "{TOOL_NAME}", "arguments": {{"code": "print(123 * 456)"}}}}</tool_call>'
    script = Script(tokenizer, [call, "56088"])
    monkeypatch.setattr(  # script the model's turns: same stop tokens, forced token choice
        engine_rollout,
        "engine_sampling_params",
        lambda cfg, meta, eos: SamplingParams(
            int(cfg.response_length), stop_token_ids=tuple(eos), logits_processor=script
        ),
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 123 * 456?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    ids = torch.tensor([[PAD] * (40 - len(prompt)) + prompt])
    mask = (ids != PAD).long()
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"tools_kwargs": np.array([{TOOL_NAME: {"create_kwargs": {}}}], dtype=object)},
    )
    data.meta_info = {"eos_token_id": [EOS], "pad_token_id": PAD, "global_steps": 1}

    out = rollout.generate_sequences(data)
    response_mask = out.batch[keys.RESPONSE_MASK][0]
    present = out.batch[keys.ATTENTION_MASK][0, 40:]
    length = int(present.sum())
    responses = out.batch[keys.RESPONSES][0]
    tool_tokens = responses[:length][response_mask[:length] == 0].tolist()
    assert "56088" in tokenizer.decode(tool_tokens)  # the sandbox computed it, in a masked tool turn
    assert tokenizer.decode(responses[:length][response_mask[:length] == 1].tolist()).endswith(
        "56088<|im_end|>"
    )
    assert response_mask[:length].sum() < length and not response_mask[length:].any()
    assert (out.batch[keys.ROLLOUT_LOG_PROBS][0] * (1 - response_mask)).abs().sum() == 0
    assert out.non_tensor_batch["tool_calls"].tolist() == [1]
    assert out.non_tensor_batch["tool_failures"].tolist() == [0]
    assert out.non_tensor_batch["__num_turns__"].tolist() == [3]
