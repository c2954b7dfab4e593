"""The optional reward-model worker: a sequence-classification model scores whole responses.

Its score is placed on the last valid response token as ``rm_scores`` (B, T_r); the reward manager
returns it (plus nothing else) when present. When the reward model's tokenizer differs from the
policy's, each prompt + response is decoded and re-encoded with the reward model's tokenizer.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, register
from hybridflow.workers.fsdp_workers import FSDPWorkerBase, _own_copy
from hybridflow.workers.micro_batch import split_micro_batches
from hybridflow.workers.model_builder import build_fsdp_module, resolve_local_path


class RewardModelWorker(FSDPWorkerBase):
    """``config`` is the ``reward_model`` section."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = _own_copy(config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridflow.models.loading import load_tokenizer

        cfg = self.config
        rm_path = resolve_local_path(cfg.model.path)
        self.module = build_fsdp_module(
            cfg.model, cfg.model.fsdp_config, self.device_mesh, kind="sequence_score", trainable=False
        )
        self.rm_tokenizer = load_tokenizer(rm_path)
        input_path = cfg.model.get("input_tokenizer")
        same = input_path is None or os.path.realpath(os.path.expanduser(input_path)) == os.path.realpath(
            rm_path
        )
        self.input_tokenizer = None if same else load_tokenizer(resolve_local_path(input_path))

    @torch.no_grad()
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B, T_r): the sequence score on the last valid response token."""
        rm_input = self._rm_inputs(data)
        micros, _ = split_micro_batches(rm_input, self.config.micro_batch_size_per_gpu)
        self.module.eval()
        scores = torch.cat([self._score(m) for m in micros])
        response_mask = data.batch[keys.RESPONSE_MASK]
        last = (response_mask.sum(dim=-1) - 1).clamp(min=0)
        rm_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
        rm_scores[torch.arange(len(data)), last] = scores
        return DataProto.from_dict({"rm_scores": rm_scores})

    def _score(self, micro: DataProto) -> torch.Tensor:
        output = self.module(
            input_ids=micro.batch[keys.INPUT_IDS],
            attention_mask=micro.batch[keys.ATTENTION_MASK],
            position_ids=micro.batch[keys.POSITION_IDS],
            use_cache=False,
        )
        return output.logits[:, 0].float()

    def _rm_inputs(self, data: DataProto) -> DataProto:
        if self.input_tokenizer is None:
            return data.select(batch_keys=[keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS])
        texts = [
            self.input_tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(data.batch[keys.INPUT_IDS], data.batch[keys.ATTENTION_MASK], strict=True)
        ]
        encoded = [self.rm_tokenizer(t, return_tensors="pt")["input_ids"][0] for t in texts]
        width = max(len(e) for e in encoded)
        pad = self.rm_tokenizer.pad_token_id
        # Right padding: HF sequence classifiers score the last non-pad token.
        input_ids = torch.stack([F.pad(e, (0, width - len(e)), value=pad) for e in encoded])
        mask = torch.stack([F.pad(torch.ones_like(e), (0, width - len(e))) for e in encoded])
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        return DataProto.from_dict(
            {keys.INPUT_IDS: input_ids, keys.ATTENTION_MASK: mask, keys.POSITION_IDS: positions}
        )
