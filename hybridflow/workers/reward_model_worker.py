"""The optional reward-model worker: a value-head model scores whole responses.

As in verl, the reward model is loaded with a one-unit token-classification head
(``AutoModelForTokenClassification``; a ``*ForSequenceClassification`` checkpoint's ``score`` head
loads into it) and a sequence's score is that head's output at the sequence's last attended token.
The score is placed at the same position of the policy's sequence, cut to the response part, as
``rm_scores`` (B, T_r). "Last attended" is read from ``attention_mask`` and nothing else: multi-turn
masks with gaps (tool output inside the response) and pad == eos do not move it.

When the reward model's tokenizer differs from the policy's (``model.input_tokenizer``), each prompt +
response is decoded and re-encoded with the reward model's tokenizer (right-truncated to
``max_length`` when set).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from hybridflow.utils.profiler import annotate
from hybridflow.workers.fsdp_workers import FSDPWorkerBase, _own_copy, _per_rank
from hybridflow.workers.micro_batch import restore_order, split_micro_batches
from hybridflow.workers.model_builder import build_fsdp_module, resolve_local_path
from hybridflow.workers.ulysses import (
    configured_sp_size,
    scale_token_budgets,
    sequence_parallel_scores,
    sequence_parallel_state,
)

# the ranks of one Ulysses group score the same rows (one dp rank); without SP every rank is its own
RM_DISPATCH = make_nd_compute_dataproto_dispatch_fn("rm")


def last_valid_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last position with ``attention_mask == 1`` in each row of (B, T) (0 for an
    all-zero row). verl's ``argmax(position_ids * attention_mask)``: the largest attended index."""
    index = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (index * (attention_mask != 0)).argmax(dim=-1)


def place_on_last_token(scores: torch.Tensor, attention_mask: torch.Tensor, response_length: int):
    """(B,) sequence scores → (B, T_r) float32 tensor holding each score at the row's last attended
    position of the full (B, T) sequence, cut to its last ``response_length`` columns (zero elsewhere;
    a row whose last attended token is in the prompt gets no score, as in verl)."""
    full = torch.zeros(attention_mask.shape, dtype=torch.float32, device=attention_mask.device)
    rows = torch.arange(len(scores), device=attention_mask.device)
    full[rows, last_valid_positions(attention_mask)] = scores.float().to(attention_mask.device)
    return full[:, -response_length:]


@torch.no_grad()
def score_sequences(
    module: nn.Module,
    data: DataProto,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool = False,
    max_token_len: int | None = None,
) -> torch.Tensor:
    """(B,) float32: the value head at each row's last attended token of ``data``'s ``input_ids``,
    ``attention_mask``, ``position_ids`` (B, T), run in micro-batches (fixed or by token budget)."""
    micros, order = split_micro_batches(data, micro_batch_size, use_dynamic_bsz, max_token_len)
    module.eval()
    scores = []
    for micro in micros:
        if sequence_parallel_state(module) is not None:  # each sequence split over the SP group
            scores.append(sequence_parallel_scores(module, micro).float().cpu())
            continue
        mask = micro.batch[keys.ATTENTION_MASK]
        logits = module(
            input_ids=micro.batch[keys.INPUT_IDS],
            attention_mask=mask,
            position_ids=micro.batch[keys.POSITION_IDS],
            use_cache=False,
        ).logits[..., 0]  # (b, T): one value per token
        scores.append(logits.float()[torch.arange(len(mask)), last_valid_positions(mask)].cpu())
    return restore_order(torch.cat(scores), order)


class RewardModelWorker(FSDPWorkerBase):
    """``config`` is the ``reward_model`` section."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = _own_copy(config)
        self.sp = configured_sp_size(self.config, self.config.model.get("fsdp_config"))
        dp = self.register_tp_dispatch("rm", self.sp)
        scale_token_budgets(self.config, self.sp, ("forward_max_token_len_per_gpu",))
        if self.config.get("micro_batch_size"):  # verl's deprecated global form
            self.config.micro_batch_size_per_gpu = _per_rank(
                int(self.config.micro_batch_size), dp, "reward_model.micro_batch_size"
            )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridflow.models.loading import load_tokenizer

        cfg = self.config
        trust = bool(cfg.model.get("trust_remote_code", False))
        rm_path = resolve_local_path(cfg.model.path)
        self.module = build_fsdp_module(
            cfg.model, cfg.model.fsdp_config, self.device_mesh, kind="token_value", trainable=False
        )
        self._sequence_parallel(self.module, self.sp)
        self.rm_tokenizer = load_tokenizer(rm_path, trust_remote_code=trust)
        input_path = cfg.model.get("input_tokenizer")
        same = input_path is None or os.path.realpath(os.path.expanduser(input_path)) == os.path.realpath(
            rm_path
        )
        self.input_tokenizer = (
            None if same else load_tokenizer(resolve_local_path(input_path), trust_remote_code=trust)
        )

    @register(dispatch_mode=RM_DISPATCH)
    @annotate("reward")  # named in a profiled process's trace (the reward model has no profiler section)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B, T_r): the sequence score on the last attended response token."""
        cfg = self.config
        scores = score_sequences(
            self.module,
            self._rm_inputs(data),
            cfg.micro_batch_size_per_gpu,
            bool(cfg.get("use_dynamic_bsz", False)),
            cfg.get("forward_max_token_len_per_gpu"),
        )
        response_length = data.batch[keys.RESPONSES].shape[-1]
        rm_scores = place_on_last_token(scores, data.batch[keys.ATTENTION_MASK], response_length)
        return DataProto.from_dict({"rm_scores": rm_scores})

    def _rm_inputs(self, data: DataProto) -> DataProto:
        if self.input_tokenizer is None:
            return data.select(batch_keys=[keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS])
        texts = [
            self.input_tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(data.batch[keys.INPUT_IDS], data.batch[keys.ATTENTION_MASK], strict=True)
        ]
        max_length = self.config.get("max_length")
        encoded = [self.rm_tokenizer(t, return_tensors="pt")["input_ids"][0] for t in texts]
        if max_length:  # verl truncates the re-encoded text on the right
            encoded = [e[: int(max_length)] for e in encoded]
        width = max(len(e) for e in encoded)
        pad = self.rm_tokenizer.pad_token_id
        input_ids = torch.stack([F.pad(e, (0, width - len(e)), value=pad) for e in encoded])
        mask = torch.stack([F.pad(torch.ones_like(e), (0, width - len(e))) for e in encoded])
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        return DataProto.from_dict(
            {keys.INPUT_IDS: input_ids, keys.ATTENTION_MASK: mask, keys.POSITION_IDS: positions}
        )
