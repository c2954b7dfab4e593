"""``main_generation`` with ``rollout.name=hf``: image rows through a vision-language model's processor and
HF ``generate`` (the backend that takes images; docs/vlm.md), in this process.

Rows follow the RL dataset's format (``data.image_key`` column, ``<image>`` placeholders in the prompt);
each row is checked when read (a bad one is named: unreadable image, placeholders against images, too long
once its image tokens are expanded) and generated with
:class:`~hybridflow.workers.rollout.hf_rollout.HFRollout` on ``model.path``'s weights, ``data.n_samples``
samples per row, batch ``b`` seeded from ``(rollout.seed, b)``.
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig, OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto


def hf_generate(config: DictConfig, table, tokenizer) -> list[list[str]]:
    """``data.n_samples`` response strings for every row of ``table`` (special tokens skipped)."""
    from hybridflow.models.loading import get_generation_eos_ids
    from hybridflow.utils.dataset.multimodal import ImageRows, load_processor
    from hybridflow.workers.model_builder import load_hf_model
    from hybridflow.workers.rollout.hf_rollout import HFRollout

    data, rollout = config.data, config.rollout
    model_path = os.path.expanduser(str(config.model.path))
    processor = load_processor(model_path, tokenizer)
    if processor is None:
        raise ValueError(
            f"rollout.name=hf generates image rows with a vision-language model; {model_path} has no "
            "preprocessor_config.json (a text-only model): use rollout.name=engine"
        )
    images = ImageRows(processor, str(data.image_key), True)
    where = str(data.path)
    images.check_columns(where, table.column_names, "videos")
    rows = table.to_pylist()
    encoded = []
    for number, row in enumerate(rows):
        name = f"{where} row {number}"
        images.check_row(row, row[str(data.prompt_key)], name)
        prompt = images.encode(row, row[str(data.prompt_key)], name)
        images.check_length(len(prompt.ids), int(rollout.prompt_length), name)
        encoded.append(prompt)
    model = load_hf_model(config.model, "causal_lm", torch.float32).eval()
    sampler = HFRollout(model, _rollout_section(rollout))
    eos = get_generation_eos_ids(tokenizer)
    n, batch_size = int(data.n_samples), int(data.batch_size)
    responses: list[list[str]] = []
    for batch, first in enumerate(range(0, len(encoded), batch_size)):
        prompts = _prompt_batch(encoded[first : first + batch_size], tokenizer.pad_token_id).repeat(n)
        prompts.meta_info = {
            "eos_token_id": eos,
            "pad_token_id": tokenizer.pad_token_id,
            "global_steps": batch,
        }
        output = sampler.generate_sequences(prompts)
        ids = output.batch[keys.RESPONSES]
        mask = output.batch[keys.RESPONSE_MASK].bool()
        texts = tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(ids, mask, strict=True)], skip_special_tokens=True
        )
        responses += [texts[i : i + n] for i in range(0, len(texts), n)]
    return responses


def _rollout_section(rollout: DictConfig) -> DictConfig:
    """The sampling keys HFRollout reads, from generation.yaml's ``rollout`` section."""
    keys_read = ("temperature", "top_k", "top_p", "do_sample", "response_length", "ignore_eos", "seed")
    section = {key: rollout.get(key) for key in keys_read}
    section.update({"n": 1, "calculate_log_probs": False, "max_num_seqs": int(rollout.max_num_seqs)})
    return OmegaConf.create(section)


def _prompt_batch(prompts: list, pad_id: int) -> DataProto:
    """Left-padded ``input_ids`` / ``attention_mask`` / ``position_ids`` (b, T_p) and the rows'
    ``multi_modal_inputs``."""
    width = max(len(p.ids) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt.ids) :] = torch.tensor(prompt.ids)
        mask[row, width - len(prompt.ids) :] = 1
    positions = torch.clamp(mask.cumsum(-1) - 1, min=0)
    tensors = {keys.INPUT_IDS: ids, keys.ATTENTION_MASK: mask, keys.POSITION_IDS: positions}
    return DataProto.from_dict(tensors, {keys.MULTI_MODAL_INPUTS: [dict(p.inputs) for p in prompts]})
