"""The merger turns FSDP (DCP) shards into a Hugging Face directory that reproduces the trained model.

Checkpoints are written under a real gloo group; merging runs after the group is destroyed, as the CLI does.
"""

import json

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedTokenizerFast

from hybridflow.model_merger import main, merge_fsdp_checkpoint
from hybridflow.utils.checkpoint import FSDPCheckpointManager
from tests.utils.checkpoint import fsdp_toy


@pytest.fixture(scope="module")
def world1_ckpt(tmp_path_factory):
    """(checkpoint dir, full weights) of a causal LM trained 2 steps on 1 rank."""
    ckpt = tmp_path_factory.mktemp("merger") / "global_step_2" / "actor"
    with fsdp_toy.gloo_group():
        model, optimizer, scheduler = fsdp_toy.build(1)
        fsdp_toy.train_steps(model, optimizer, scheduler, 2)
        tokenizer = fsdp_toy.tiny_tokenizer()
        FSDPCheckpointManager(model, optimizer, scheduler, tokenizer).save_checkpoint(
            str(ckpt), global_step=2
        )
        weights = fsdp_toy.full_weights(model)
    return ckpt, weights


def _reference_model(weights, cls_name="Qwen2ForCausalLM", **config_overrides):
    """The trained weights in a plain (unsharded) model."""
    import transformers

    model = getattr(transformers, cls_name)(fsdp_toy.tiny_config(**config_overrides))
    model.load_state_dict(weights, strict=True)
    return model.eval()


def _assert_same_outputs(merged, reference):
    input_ids = torch.tensor([[1, 5, 9, 17, 33, 65], [1, 100, 7, 7, 42, 3]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids).logits, reference(input_ids).logits, rtol=0, atol=1e-5)
    if hasattr(reference, "generate"):
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(merged.generate(input_ids, **kwargs), reference.generate(input_ids, **kwargs))


def test_merge_world1_checkpoint_reproduces_trained_model(world1_ckpt, tmp_path):
    ckpt, weights = world1_ckpt
    assert not dist.is_initialized()
    target = merge_fsdp_checkpoint(ckpt, tmp_path / "merged")

    assert (target / "model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(target)
    assert merged.dtype == torch.float32
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()  # still tied
    _assert_same_outputs(merged, _reference_model(weights))
    # Not AutoTokenizer: with model_type qwen2 in config.json, transformers 5 rebuilds the toy word-level
    # vocabulary as a Qwen2 BPE tokenizer.
    assert (target / "tokenizer.json").read_text() == (ckpt / "huggingface" / "tokenizer.json").read_text()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    assert tokenizer("w5 w9")["input_ids"] == [5, 9] and tokenizer.eos_token == "</s>"


def test_cli_merges_world2_shards(tmp_path):
    run_dir = fsdp_toy.world2_run()
    weights = torch.load(run_dir / "rank0.pt", weights_only=False)["weights"]
    target = tmp_path / "merged"
    main(["merge", "--backend", "fsdp", "--local_dir", str(run_dir / "ckpt"), "--target_dir", str(target)])

    merged = AutoModelForCausalLM.from_pretrained(target)
    for name, tensor in weights.items():
        torch.testing.assert_close(merged.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    _assert_same_outputs(merged, _reference_model(weights))


def test_hf_model_path_supplies_config_and_tokenizer(world1_ckpt, tmp_path):
    ckpt, weights = world1_ckpt
    base = tmp_path / "base"
    base.mkdir()
    fsdp_toy.tiny_config(architectures=["Qwen2ForCausalLM"]).save_pretrained(base)
    fsdp_toy.tiny_tokenizer().save_pretrained(base)
    (base / "model.safetensors").write_bytes(b"base weights: must not be copied")
    target = merge_fsdp_checkpoint(ckpt, tmp_path / "merged", hf_model_path=base)

    assert (target / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 64
    _assert_same_outputs(AutoModelForCausalLM.from_pretrained(target), _reference_model(weights))


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_merge_token_classification_critic(tmp_path):
    ckpt = tmp_path / "critic"
    overrides = dict(model_cls_name="Qwen2ForTokenClassification", num_labels=1, tie_word_embeddings=False)
    with fsdp_toy.gloo_group():
        critic, optimizer, scheduler = fsdp_toy.build(1, **overrides)
        input_ids = torch.randint(4, fsdp_toy.VOCAB, (2, 12))
        critic(input_ids=input_ids).logits.pow(2).mean().backward()
        optimizer.step()
        manager = FSDPCheckpointManager(critic, checkpoint_contents=("model",))
        manager.save_checkpoint(str(ckpt), global_step=1)
        weights = fsdp_toy.full_weights(critic)
    target = merge_fsdp_checkpoint(ckpt, tmp_path / "merged")

    merged = AutoModelForTokenClassification.from_pretrained(target)
    assert type(merged).__name__ == "Qwen2ForTokenClassification"
    overrides.pop("model_cls_name")
    _assert_same_outputs(merged, _reference_model(weights, "Qwen2ForTokenClassification", **overrides))


def test_merge_rejects_incomplete_checkpoint(tmp_path):
    (tmp_path / "actor").mkdir()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        merge_fsdp_checkpoint(tmp_path / "actor", tmp_path / "out")


def test_merge_rejects_config_that_does_not_match_weights(world1_ckpt, tmp_path):
    ckpt, _ = world1_ckpt
    fsdp_toy.tiny_config(num_hidden_layers=1).save_pretrained(tmp_path / "one_layer")
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.1"):
        merge_fsdp_checkpoint(ckpt, tmp_path / "out", hf_model_path=tmp_path / "one_layer")
