"""Micro-batches for gradient accumulation and memory-bounded forwards.

Fixed size (``*_micro_batch_size_per_gpu``) or by token budget (``use_dynamic_bsz`` with
``*_max_token_len_per_gpu``). Every rank of an FSDP group must run the same number of micro-batches
(each forward/backward is a collective), so the dynamic count is agreed with an all-reduce(max).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow import keys
from hybridflow.algorithms import GlobalBatchInfo
from hybridflow.protocol import DataProto
from hybridflow.utils.seqlen_balancing import rearrange_micro_batches_indices


def _agreed_count(local: int, device: torch.device) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    count = torch.tensor([local], dtype=torch.int64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def split_micro_batches(
    data: DataProto,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool = False,
    max_token_len: int | None = None,
) -> tuple[list[DataProto], list[int] | None]:
    """Split ``data`` into micro-batches.

    Returns ``(micro_batches, order)``: with dynamic batching rows are regrouped and ``order`` lists
    the original row index of each output row in concatenation order (``None`` when order is kept)."""
    if not use_dynamic_bsz:
        size = int(micro_batch_size or len(data))
        return data.split(size), None
    if not max_token_len:
        raise ValueError("use_dynamic_bsz needs a positive max_token_len_per_gpu")
    seqlens = data.batch[keys.ATTENTION_MASK].sum(dim=-1).tolist()
    local = len(rearrange_micro_batches_indices(seqlens, max_token_len))
    agreed = _agreed_count(local, data.batch[keys.ATTENTION_MASK].device)
    bins = rearrange_micro_batches_indices(seqlens, max_token_len, min_num_micro_batch=agreed)
    order = [i for b in bins for i in b]
    return [data.select_idxs(b) for b in bins], order


def restore_order(values: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """Undo the regrouping of :func:`split_micro_batches` on rows of ``values`` (first dim)."""
    if order is None:
        return values
    inverse = torch.empty(len(order), dtype=torch.long, device=values.device)
    inverse[torch.tensor(order, device=values.device)] = torch.arange(len(order), device=values.device)
    return values[inverse]


def global_batch_info(
    mini: DataProto, loss_scale_factor: float | None = None, dp_group: dist.ProcessGroup | None = None
) -> GlobalBatchInfo:
    """This rank's mini-batch as part of the whole one: ``dp_size`` ranks, ``batch_num_tokens`` =
    valid response tokens and ``global_batch_size`` = sequences with at least one, both summed over
    the ranks (one all-reduce). Every micro-batch's loss is normalised by these, so the gradient of
    a mini-batch does not depend on how it is split into micro-batches and ranks (verl semantics).

    ``dp_group``: the data-parallel ranks (None: the whole world). With tensor parallelism the ranks of
    one TP group hold the same rows, so they are counted once: the group is the dp dimension."""
    mask = mini.batch[keys.RESPONSE_MASK]
    counts = torch.stack([mask.sum(), (mask.sum(dim=-1) > 0).sum()]).to(torch.float64)
    dp_size = 1
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dp_size = dist.get_world_size(dp_group)
        dist.all_reduce(counts, group=dp_group)
    tokens, sequences = counts.tolist()
    return GlobalBatchInfo(dp_size, tokens, sequences, loss_scale_factor)
