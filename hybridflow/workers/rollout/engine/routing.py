"""Recording a mixture of experts' routing in the engine, for router replay (R3, verl's
``actor_rollout_ref.rollout.enable_rollout_routing_replay``; the trainer's side is
:mod:`hybridflow.workers.router_replay`).

With recording on (``LLMEngine(record_routing=True)``), every forward of the model hands each sparse
layer's top-k expert ids to the engine (:func:`.moe.moe_mlp`'s ``record``), and each running sequence
keeps them per position (:class:`RoutingRecord`): the prompt's from its prefill, each generated token's
from the decode step that fed it. A completion carries ``routed_experts`` (prompt + response tokens,
L sparse layers, k) in small ints; the last token, which no forward fed, has 0s (its outputs predict
nothing the trainer reads).

**Prefix caching is off while recording.** A cached block's keys and values are reused without running
its tokens through the model again, so their routing would be unknown; the engine turns the prefix cache
off (the ``n`` samples of a request still share their prompt's one prefill, and its routing). A preempted
sequence is recomputed from position 0, and its record is overwritten with the routing of the keys and
values its continuation attends to. Decoding takes the eager step (one token per step, read back each
step), since the static step's fixed buffers do not carry the ids.
"""

from __future__ import annotations

import logging

import torch

from hybridflow.models.moe import routed_ids_dtype

logger = logging.getLogger(__name__)


def prefix_caching_while_recording(spec, record: bool, enable_prefix_caching: bool) -> bool:
    """The engine's prefix caching given its recording: off while it records (logged when that turns
    it off); a dense model (``spec.moe`` None) cannot record."""
    if not record:
        return enable_prefix_caching
    if spec.moe is None:
        raise ValueError("record_routing: the model has no mixture-of-experts layer (a dense model)")
    if enable_prefix_caching:
        logger.info("routing replay: the engine's prefix cache is off (cached blocks keep no routing)")
    return False


class RoutingRecord:
    """One sequence's expert ids per position: ``ids`` (positions, L, k) on the host, grown as written."""

    def __init__(self, layers: int, top_k: int, dtype: torch.dtype) -> None:
        self.ids = torch.zeros(0, layers, top_k, dtype=dtype)
        self.written = 0  # positions 0 .. written - 1 hold ids

    def write(self, start: int, ids: torch.Tensor) -> None:
        """Positions ``start .. start + len(ids) - 1`` get ``ids`` (n, L, k)."""
        end = start + ids.shape[0]
        if start > self.written:
            raise RuntimeError(
                f"routing record: positions {self.written}..{start - 1} were never computed (a cached prefix)"
            )
        if end > self.ids.shape[0]:
            grown = torch.zeros(max(end, 2 * self.ids.shape[0]), *self.ids.shape[1:], dtype=self.ids.dtype)
            grown[: self.written] = self.ids[: self.written]
            self.ids = grown
        self.ids[start:end] = ids.to(self.ids.dtype)
        self.written = max(self.written, end)

    def copy(self) -> RoutingRecord:
        other = RoutingRecord(self.ids.shape[1], self.ids.shape[2], self.ids.dtype)
        other.ids, other.written = self.ids.clone(), self.written
        return other

    def upto(self, length: int) -> torch.Tensor:
        """(length, L, k): the ids of positions ``0 .. length - 1`` (0 where none was computed)."""
        out = torch.zeros(length, *self.ids.shape[1:], dtype=self.ids.dtype)
        kept = min(length, self.written)
        out[:kept] = self.ids[:kept]
        return out


def new_record(moe) -> RoutingRecord:
    """An empty record for a model of :class:`.moe.MoeSpec` ``moe``."""
    return RoutingRecord(sum(moe.sparse), moe.top_k, routed_ids_dtype(moe.num_experts))


def captured_ids(captured: list[torch.Tensor] | None, moe) -> torch.Tensor | None:
    """The sparse layers' ids of one forward, each (..., k), as (..., L, k) on the host (None: the
    forward recorded nothing)."""
    if captured is None:
        return None
    return torch.stack(captured, dim=-2).to(device="cpu", dtype=routed_ids_dtype(moe.num_experts))


def routed_experts_rows(
    prompt_mask: torch.Tensor, routed: list[torch.Tensor | None], response_length: int
) -> torch.Tensor:
    """The batch's ``routed_experts`` (B, T_p + T_r, L, k) in verl's layout: each row's
    ``(prompt + response tokens, L, k)`` ids (``routed``, in row order) from its prompt's first column
    (prompts left-padded: ``prompt_mask`` (B, T_p)), cut at ``response_length`` response columns; 0 on
    padding."""
    first = next(r for r in routed if r is not None)
    batch, prompt_width = prompt_mask.shape
    out = torch.zeros(batch, prompt_width + response_length, *first.shape[1:], dtype=first.dtype)
    for row, ids in enumerate(routed):
        if ids is None:  # a failed or aborted sample: no routing (its response is empty or dropped)
            continue
        start = prompt_width - int(prompt_mask[row].sum())
        end = min(start + ids.shape[0], prompt_width + response_length)
        out[row, start:end] = ids[: end - start]
    return out
