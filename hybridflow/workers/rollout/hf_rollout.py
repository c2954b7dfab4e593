"""A simple, correct rollout on Hugging Face ``generate`` (the reference path; slower than an engine).

It runs on the actor's own module: with FSDP2 the training parameters are gathered in place for the
duration of generation (one all-gather, not one per decode step) and resharded afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.workers.fsdp_utils import gathered_for_inference
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
        responses = torch.cat(parts)
        output = assemble_output(prompts, responses, eos_ids, pad_id)
        output.meta_info.update({"temperature": params["temperature"] or 1.0})
        return output

    def _generate(self, prompts: DataProto, params: dict, eos_ids: list[int], pad_id: int) -> torch.Tensor:
        input_ids = prompts.batch[keys.INPUT_IDS]
        response_length = int(self.config.response_length)
        kwargs = {
            "do_sample": params["do_sample"],
            "max_new_tokens": response_length,
            "eos_token_id": None if self.config.get("ignore_eos") else eos_ids,
            "pad_token_id": pad_id,
        }
        if params["do_sample"]:
            kwargs.update(
                temperature=params["temperature"],
                top_p=params["top_p"],
                top_k=params["top_k"] if params["top_k"] > 0 else 0,
            )
        output = self.module.generate(
            input_ids=input_ids, attention_mask=prompts.batch[keys.ATTENTION_MASK], use_cache=True, **kwargs
        )
        generated = output[:, input_ids.shape[1] :]
        return F.pad(generated, (0, response_length - generated.shape[1]), value=pad_id)
