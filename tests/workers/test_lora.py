"""LoRA on the hybrid worker, in one process (world size 1, gloo): only the adapter trains, the
reference is the base model with the adapter off, the engine generates with merged weights, and
the adapter-only checkpoint exports to a merged model (or the adapter) that loads with
``from_pretrained``."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.model_merger import merge_fsdp_checkpoint
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config
from hybridflow.workers.fsdp_workers import ActorRolloutRefWorker
from hybridflow.workers.lora import hf_parameter_name
from hybridflow.workers.rollout.engine_rollout import EngineRollout
from tests.utils.checkpoint.fsdp_toy import gloo_group, local_value
from tests.workers.engine_prompts import hf_greedy
from tests.workers.engine_prompts import tiny_prompts as _prompts

RESPONSE_LENGTH = 6


def _worker_config(model_dir: str, **overrides):
    values = {
        "actor_rollout_ref.model.path": model_dir,
        "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.model.lora_alpha": 8,
        "actor_rollout_ref.actor.use_kl_loss": "true",
        "actor_rollout_ref.actor.optim.lr": 0.05,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 3,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3,
        "actor_rollout_ref.rollout.n": 1,
        "actor_rollout_ref.rollout.kv_cache_memory_gb": 0.01,
        "data.max_prompt_length": 8,
        "data.max_response_length": RESPONSE_LENGTH,
        **overrides,
    }
    config = load_config([f"{k}={v}" for k, v in values.items()])
    OmegaConf.resolve(config)
    return config.actor_rollout_ref


def _training_batch(worker: ActorRolloutRefWorker) -> DataProto:
    """Greedy rollouts with old/ref log-probs and advantages that push every token."""
    batch = worker.generate_sequences(_prompts())
    batch.meta_info.pop("metrics", None)
    batch = batch.union(worker.compute_log_prob(batch)).union(worker.compute_ref_log_prob(batch))
    response_mask = batch.batch[keys.ATTENTION_MASK][:, -RESPONSE_LENGTH:]
    batch.batch[keys.RESPONSE_MASK] = response_mask
    batch.batch[keys.ADVANTAGES] = torch.tensor([[1.0], [-1.0], [1.0]]).expand(-1, RESPONSE_LENGTH).clone()
    return batch


def _hf_greedy(model, prompts: DataProto) -> torch.Tensor:
    return hf_greedy(model, prompts, RESPONSE_LENGTH)


def _base_log_probs(model_dir: str, batch: DataProto) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from hybridflow.workers.actor.dp_actor import response_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return response_log_probs(model, batch, 1.0)[0]


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """One LoRA update on the hybrid worker, with everything the tests compare."""
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path_factory.mktemp("lora_ckpt") / "actor"
    with gloo_group():
        worker = ActorRolloutRefWorker(_worker_config(tiny_model_dir))
        worker.init_model()
        module = worker.actor_module
        before = _local_parameters(module)
        batch = _training_batch(worker)
        metrics = worker.update_actor(batch).meta_info["metrics"]
        after = _local_parameters(module)
        ref_after = worker.compute_ref_log_prob(batch).batch[keys.REF_LOG_PROB]
        actor_after = worker.compute_log_prob(batch).batch[keys.OLD_LOG_PROBS]
        engine_after = worker.generate_sequences(_prompts())
        worker.save_checkpoint(str(ckpt), global_step=1)
        trainable = {name for name, p in module.named_parameters() if p.requires_grad}
        # The same actor turned into a plain HF model with the adapter merged, for greedy parity.
        merged = _merged_copy(module, tiny_model_dir)
    yield {
        "worker_metrics": metrics,
        "before": before,
        "after": after,
        "trainable": trainable,
        "batch": batch,
        "ref_after": ref_after,
        "actor_after": actor_after,
        "engine_after": engine_after,
        "merged_greedy": _hf_greedy(merged, _prompts()),
        "ckpt": ckpt,
        "base": AutoModelForCausalLM.from_pretrained(tiny_model_dir),
    }


def _local_parameters(module) -> dict[str, torch.Tensor]:
    """Plain-tensor copies of the (world-size-1, so complete) DTensor shards."""
    return {name: local_value(p).detach().clone() for name, p in module.named_parameters()}


def _merged_copy(module, model_dir):
    """Full weights of the (world-size-1) peft actor merged through peft itself: an independent
    route to the numbers the engine sync computes by hand."""
    import copy

    from transformers import AutoModelForCausalLM

    from hybridflow.workers.fsdp_utils import full_state_dict

    state = full_state_dict(module)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    from peft import get_peft_model

    peft_model = get_peft_model(base, copy.deepcopy(module.peft_config["default"]))
    peft_model.load_state_dict(state)
    return peft_model.merge_and_unload().eval()


def test_only_adapter_parameters_train(lora_run):
    before, after, trainable = lora_run["before"], lora_run["after"], lora_run["trainable"]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed, "the LoRA update changed nothing"
    assert changed <= trainable
    assert any(".lora_B." in name for name in changed)  # B starts at zero: the adapter now does something
    assert lora_run["worker_metrics"]["actor/grad_norm"] > 0


def test_reference_is_the_base_model_with_the_adapter_off(lora_run, tiny_model_dir):
    batch = lora_run["batch"]
    base = _base_log_probs(tiny_model_dir, batch)
    mask = batch.batch[keys.RESPONSE_MASK].bool()
    # before the update the adapter is a no-op (B = 0): ref == actor == base
    assert torch.allclose(batch.batch[keys.REF_LOG_PROB][mask], base[mask], atol=1e-5)
    assert torch.allclose(batch.batch[keys.OLD_LOG_PROBS][mask], base[mask], atol=1e-5)
    # after it the reference stays the base model while the actor moved
    assert torch.allclose(lora_run["ref_after"][mask], base[mask], atol=1e-5)
    assert (lora_run["actor_after"][mask] - base[mask]).abs().max() > 1e-3


def test_engine_generates_with_the_merged_adapter(lora_run):
    engine_responses = lora_run["engine_after"].batch[keys.RESPONSES]
    assert torch.equal(engine_responses, lora_run["merged_greedy"])
    base_greedy = _hf_greedy(lora_run["base"], _prompts())
    assert not torch.equal(engine_responses, base_greedy), "the update should change the greedy output"


def test_checkpoint_holds_only_the_adapter(lora_run):
    from hybridflow.model_merger import load_dcp_model_state

    ckpt = lora_run["ckpt"]
    meta = json.loads((ckpt / "checkpoint_meta.json").read_text())
    assert meta["trainable_only"] is True and meta["model_class"] == "Qwen2ForCausalLM"
    saved = load_dcp_model_state(ckpt / "model")
    assert set(saved) == lora_run["trainable"]
    for name, tensor in saved.items():
        assert torch.equal(tensor, lora_run["after"][name])
    adapter_config = json.loads((ckpt / "huggingface" / "lora_adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8


def test_merged_export_loads_and_generates_like_the_trained_policy(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    target = merge_fsdp_checkpoint(lora_run["ckpt"], tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(target)
    names = {name for name, _ in model.named_parameters()}
    assert not any("lora" in name or "base_layer" in name for name in names)
    assert torch.equal(_hf_greedy(model, _prompts()), lora_run["engine_after"].batch[keys.RESPONSES])
    assert (target / "tokenizer.json").is_file()


def test_adapter_export_loads_with_peft(lora_run, tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    target = merge_fsdp_checkpoint(lora_run["ckpt"], tmp_path / "adapter", lora_export="adapter")
    assert (target / "adapter_model.safetensors").is_file()
    assert not (target / "model.safetensors").exists()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), target)
    assert torch.equal(_hf_greedy(model.eval(), _prompts()), lora_run["merged_greedy"])


def test_adapter_checkpoint_resumes_into_a_fresh_lora_worker(lora_run, tiny_model_dir):
    with gloo_group():
        worker = ActorRolloutRefWorker(_worker_config(tiny_model_dir))
        worker.init_model()
        worker.load_checkpoint(str(lora_run["ckpt"]))
        restored = _local_parameters(worker.actor_module)
        for name, tensor in lora_run["after"].items():
            assert torch.equal(restored[name], tensor), name
        responses = worker.generate_sequences(_prompts()).batch[keys.RESPONSES]
    assert torch.equal(responses, lora_run["engine_after"].batch[keys.RESPONSES])


def test_full_checkpoint_refuses_to_load_into_a_lora_model(lora_run, tiny_model_dir, tmp_path):
    with gloo_group():
        full = ActorRolloutRefWorker(
            _worker_config(tiny_model_dir, **{"actor_rollout_ref.model.lora_rank": 0})
        )
        full.init_model()
        full.save_checkpoint(str(tmp_path / "full"), global_step=1)
        lora = ActorRolloutRefWorker(_worker_config(tiny_model_dir))
        lora.init_model()
        with pytest.raises(ValueError, match="trainable_only"):
            lora.load_checkpoint(str(tmp_path / "full"))


def test_peft_names_map_to_hf_names():
    prefix = "base_model.model.model.layers.3.self_attn.q_proj"
    assert hf_parameter_name(f"{prefix}.base_layer.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_parameter_name(f"{prefix}.base_layer.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_parameter_name(f"{prefix}.lora_A.default.weight") is None
    assert hf_parameter_name("base_model.model.lm_head.weight") == "lm_head.weight"
    assert hf_parameter_name("model.norm.weight") == "model.norm.weight"


def test_engine_rollout_of_a_plain_module_is_unchanged(tiny_model_dir):
    """The merge path leaves non-peft modules alone (names and tensors as they are)."""
    from transformers import AutoModelForCausalLM

    config = _worker_config(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rollout = EngineRollout(model, config.rollout)
    responses = rollout.generate_sequences(_prompts()).batch[keys.RESPONSES]
    assert torch.equal(responses, _hf_greedy(model, _prompts()))
