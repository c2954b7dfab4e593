"""Image rows through the rollout and the actor's forward, against transformers' own forward: the HF
rollout's log-probs of image prompts equal the actor's recompute and HF's forward (its get_rope_index
positions) on the same image+text; placeholder tokens are never sampled; freeze_vision_tower stops the
vision tower's gradients (it trains otherwise); LoRA lands on the language model only."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.models.loading import load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.utils.dataset import RLHFDataset, collate_fn
from hybridflow.utils.dataset.multimodal import load_processor
from hybridflow.workers.actor.dp_actor import response_log_probs
from hybridflow.workers.model_builder import _lm_only_lora, freeze_vision_tower, load_hf_model
from hybridflow.workers.rollout.hf_rollout import HFRollout

PROMPT_KEYS = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS]


@pytest.fixture(scope="module")
def rolled_out(vlm_model_dir, visual_data):
    """``(model, tokenizer, processor, rollout output with multi_modal_inputs)``: 6 image prompts x 2."""
    tokenizer = load_tokenizer(vlm_model_dir)
    processor = load_processor(vlm_model_dir, tokenizer)
    dataset = RLHFDataset(visual_data[0], tokenizer, {"max_prompt_length": 32}, processor=processor)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(6)])).repeat(2, interleave=True)
    prompts = batch.select(batch_keys=PROMPT_KEYS, non_tensor_batch_keys=[keys.MULTI_MODAL_INPUTS])
    prompts.meta_info = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    model = load_hf_model(OmegaConf.create({"path": vlm_model_dir}), "causal_lm", torch.float32)
    config = OmegaConf.create(
        {
            "response_length": 8,
            "calculate_log_probs": True,
            "temperature": 1.0,
            "top_k": -1,
            "top_p": 1.0,
            "do_sample": True,
            "n": 1,
            "ignore_eos": True,
        }
    )
    output = HFRollout(model, config).generate_sequences(prompts)
    output.non_tensor_batch[keys.MULTI_MODAL_INPUTS] = prompts.non_tensor_batch[keys.MULTI_MODAL_INPUTS]
    return model, tokenizer, processor, output


def test_rollout_log_probs_equal_actor_and_hf_forward(rolled_out, vlm_model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model, _, processor, output = rolled_out
    mask = output.batch[keys.RESPONSE_MASK].bool()
    rollout = output.batch[keys.ROLLOUT_LOG_PROBS]
    with torch.no_grad():
        actor, _ = response_log_probs(model, output, temperature=1.0)
    assert (actor - rollout)[mask].abs().max() < 1e-5
    # transformers' forward with its own M-RoPE (mm_token_type_ids), eager attention, the same two
    # placeholder columns excluded from the softmax
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_model_dir, attn_implementation="eager")
    ids, attention = output.batch[keys.INPUT_IDS], output.batch[keys.ATTENTION_MASK]
    inputs = output.non_tensor_batch[keys.MULTI_MODAL_INPUTS]
    prompt_len = output.batch[keys.PROMPTS].shape[1]
    token_type = torch.zeros_like(ids, dtype=torch.int)
    token_type[:, :prompt_len] = (ids[:, :prompt_len] == processor.image_token_id) & attention[
        :, :prompt_len
    ].bool()
    with torch.no_grad():
        logits = reference(
            input_ids=ids,
            attention_mask=attention,
            pixel_values=torch.cat([r["pixel_values"] for r in inputs]),
            image_grid_thw=torch.cat([r["image_grid_thw"] for r in inputs]),
            mm_token_type_ids=token_type,
        ).logits.float()
    logits[..., [reference.config.image_token_id, reference.config.video_token_id]] = float("-inf")
    responses = output.batch[keys.RESPONSES]
    hf = torch.log_softmax(logits[:, prompt_len - 1 : -1], -1).gather(-1, responses[..., None]).squeeze(-1)
    assert (hf - rollout)[mask].abs().max() < 1e-5
    assert not bool((responses == processor.image_token_id).any())  # suppressed in sampling


def test_image_tokens_and_features_mismatch_names_the_row(rolled_out):
    model, _, _, output = rolled_out
    broken = output.select()
    inputs = list(broken.non_tensor_batch[keys.MULTI_MODAL_INPUTS])
    inputs[3] = {}  # row 3 lost its image
    broken.non_tensor_batch[keys.MULTI_MODAL_INPUTS] = np.array(inputs, dtype=object)
    broken.non_tensor_batch["index"] = np.arange(100, 100 + len(inputs), dtype=object)
    with pytest.raises(
        ValueError, match=r"row 3 \(dataset index 103\): 4 image tokens in the prompt but 0 image"
    ):
        response_log_probs(model, broken, temperature=1.0)


def _vision_and_text_grads(model, output) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    log_probs, _ = response_log_probs(model, output, temperature=1.0)
    log_probs.sum().backward()
    vision = [p.grad for p in model.model.visual.parameters()]
    text = [p.grad for p in model.model.language_model.parameters()]
    norm = lambda grads: sum(float(g.abs().sum()) for g in grads if g is not None)  # noqa: E731
    return norm(vision), norm(text)


def test_vision_tower_trains_unless_frozen(vlm_model_dir, rolled_out):
    _, _, _, output = rolled_out
    model = load_hf_model(OmegaConf.create({"path": vlm_model_dir}), "causal_lm", torch.float32)
    vision, text = _vision_and_text_grads(model, output)
    assert vision > 0 and text > 0
    freeze_vision_tower(model)
    vision, text = _vision_and_text_grads(model, output)
    assert vision == 0 and text > 0


def test_lora_targets_the_language_model_only(vlm_model_dir):
    from hybridflow.workers.lora import apply_lora

    model = load_hf_model(OmegaConf.create({"path": vlm_model_dir}), "causal_lm", torch.float32)
    section = OmegaConf.create(
        {"path": vlm_model_dir, "lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    )
    peft_model = apply_lora(model, _lm_only_lora(section))
    adapted = [name for name, _ in peft_model.named_parameters() if "lora_A" in name]
    assert adapted and all("language_model" in name for name in adapted)
    assert all(not p.requires_grad for n, p in peft_model.named_parameters() if "visual" in n)
