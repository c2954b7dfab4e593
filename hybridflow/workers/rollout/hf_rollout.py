"""A simple, correct rollout on Hugging Face ``generate`` (the reference path; slower than an engine).

It runs on the actor's own module: with FSDP2 the training parameters are gathered in place for the
duration of generation (one all-gather, not one per decode step) and resharded afterwards.

It samples exactly the configured distribution (temperature, top-k, top-p; greedy when ``do_sample``
is off). A checkpoint's ``generation_config.json`` (repetition_penalty, top_k, min_p, eos ids, ...)
never reaches ``generate``: PPO's ratio is taken against the plain softmax the actor recomputes, so a
hidden logits processor would make the rollout sample from another policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.workers import vision_forward
from hybridflow.workers.fsdp_utils import gathered_for_inference
from hybridflow.workers.lora import unwrap_peft
from hybridflow.workers.rollout.base import (
    BaseRollout,
    assemble_output,
    generation_seed,
    register_rollout,
    sampling_params,
)


@register_rollout("hf")
class HFRollout(BaseRollout):
    """``config`` is the ``actor_rollout_ref.rollout`` section."""

    def __init__(self, module: nn.Module, config, rank: int = 0, **unused) -> None:
        self.module = module
        self.config = config
        self.rank = rank

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        meta = prompts.meta_info
        eos_ids = meta["eos_token_id"] if isinstance(meta["eos_token_id"], list) else [meta["eos_token_id"]]
        pad_id = int(meta["pad_token_id"])
        params = sampling_params(self.config, meta)
        torch.manual_seed(generation_seed(self.config.get("seed", 0), meta.get("global_steps", 0), self.rank))
        chunk = int(self.config.get("max_num_seqs", 256))
        self.module.eval()
        with gathered_for_inference(self.module):
            parts = [self._generate(p, params, eos_ids, pad_id) for p in prompts.split(chunk)]
        responses = torch.cat([r for r, _ in parts])
        log_probs = torch.cat([lp for _, lp in parts]) if parts[0][1] is not None else None
        mask_eos = [] if self.config.get("ignore_eos") else eos_ids  # ignore_eos: every row is full length
        return assemble_output(prompts, responses, mask_eos, pad_id, rollout_log_probs=log_probs)

    def _generate(
        self, prompts: DataProto, params: dict, eos_ids: list[int], pad_id: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(responses (b, T_r), rollout log-probs (b, T_r) | None)``; log-probs for image prompts
        (:mod:`hybridflow.workers.vision_forward`) with ``calculate_log_probs``."""
        input_ids = prompts.batch[keys.INPUT_IDS]
        response_length = int(self.config.response_length)
        stop_ids = None if self.config.get("ignore_eos") else eos_ids
        config = generation_config(params, response_length, stop_ids, pad_id)
        images = vision_forward.has_images(prompts)
        extra = vision_forward.generate_kwargs(self.module, prompts) if images else {}
        with_log_probs = images and bool(self.config.get("calculate_log_probs", False))
        if images:
            model_config = vision_forward.vision_config(self.module)
            config.suppress_tokens = vision_forward.vision_token_ids(model_config)
            config.return_dict_in_generate = config.output_logits = with_log_probs
        with model_defaults_cleared(self.module):
            output = self.module.generate(
                input_ids=input_ids,
                attention_mask=prompts.batch[keys.ATTENTION_MASK],
                generation_config=config,
                **extra,
            )
        sequences = output.sequences if with_log_probs else output
        generated = sequences[:, input_ids.shape[1] :]
        log_probs = None
        if with_log_probs:
            temperature = params.get("temperature", 1.0) if params["do_sample"] else 1.0
            log_probs = vision_forward.sampled_log_probs(output.logits, generated, temperature, model_config)
            log_probs = F.pad(log_probs, (0, response_length - log_probs.shape[1]))
        return F.pad(generated, (0, response_length - generated.shape[1]), value=pad_id), log_probs


def generation_config(params: dict, max_new_tokens: int, eos_ids: list[int] | None, pad_id: int):
    """A ``GenerationConfig`` holding only our sampling settings (``params`` from
    :func:`~hybridflow.workers.rollout.base.sampling_params`), every other logits processor explicitly
    off. ``top_k=0`` is needed: HF's global default is 50."""
    from transformers import GenerationConfig

    sampling = {}
    if params["do_sample"]:
        top_k = params["top_k"] if params["top_k"] > 0 else 0
        sampling = {"temperature": params["temperature"], "top_k": top_k, "top_p": params["top_p"]}
    return GenerationConfig(
        do_sample=params["do_sample"],
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        num_beams=1,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_length=0,
        use_cache=True,
        **sampling,
    )


@contextlib.contextmanager
def model_defaults_cleared(module: nn.Module) -> Iterator[None]:
    """``generate`` fills every field our config leaves unset from ``model.generation_config`` (the
    checkpoint's file); a blank one for the duration means unset fields get HF's neutral defaults."""
    from transformers import GenerationConfig

    model = unwrap_peft(module)
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved
