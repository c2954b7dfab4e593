"""The paged KV cache: one pool of blocks per layer, keys and values each (nkv, num_blocks, block_size, hd).

A sequence's positions live in the blocks of its block table, in order (position ``p`` at offset
``p % block_size`` of block ``table[p // block_size]``); which blocks are free, shared or cached is
the host's bookkeeping (:mod:`.block_pool`). The pool is sized once from a memory budget
(:func:`blocks_for_budget`: verl's ``gpu_memory_utilization`` or our ``kv_cache_memory_gb``) and
allocated whole; :meth:`PagedKVCache.allocate` may take fewer blocks for a call that knows its rows
and lengths (``free_cache_engine`` re-creates the cache per rollout, and zeroing a budget-sized cache
costs more than decoding a few short answers). Heads are the outer dimension, so one head's gathered
span is contiguous (:func:`.attention.gather_span`) and the CPU kernel reads it in place.
"""

from __future__ import annotations

import torch

from hybridflow.workers.rollout.engine.model import ModelSpec

DEFAULT_BLOCK_SIZE = 16  # positions per block (vLLM's GPU default); measured in docs/benchmarks.md


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer of one block of ``block_size`` positions."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * block_size * element


def blocks_for_budget(
    spec: ModelSpec, block_size: int, dtype: torch.dtype, budget_bytes: int, max_model_len: int
) -> int:
    """How many blocks fit in ``budget_bytes``; raises unless they hold one ``max_model_len`` sequence."""
    per_block = bytes_per_block(spec, block_size, dtype)
    blocks = int(budget_bytes // per_block)
    needed = -(-int(max_model_len) // block_size)
    if blocks < needed:
        raise MemoryError(
            f"KV cache budget {budget_bytes / 2**20:.1f} MiB holds {blocks} blocks of {block_size} "
            f"positions ({per_block / 2**20:.2f} MiB each), not one sequence of max_model_len="
            f"{max_model_len} ({needed} blocks); raise the budget or lower max_model_len"
        )
    return blocks


class PagedKVCache:
    """``layers[i]`` is ``(keys, values)``, each (nkv, num_blocks, block_size, hd); empty after
    :meth:`release`. ``capacity_blocks``: the most :meth:`allocate` creates."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device,
        allocate: bool = True,
    ) -> None:
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.block_size = int(block_size)
        self.capacity_blocks = int(num_blocks)
        self.num_blocks = self.capacity_blocks  # the allocated count (allocate() may take fewer)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if allocate:
            self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)

    def allocate(self, blocks: int | None = None) -> None:
        """Create the pool: ``blocks`` blocks (at most the capacity; None: the capacity). A no-op while
        allocated."""
        if self.allocated:
            return
        self.num_blocks = min(self.capacity_blocks, int(blocks)) if blocks else self.capacity_blocks
        shape = (self.spec.num_kv_heads, self.num_blocks, self.block_size, self.spec.head_dim)
        # zeros, not empty: a gathered span's masked positions still meet V (0 x NaN garbage is NaN)
        self.layers = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]

    def release(self) -> None:
        """Drop every pool tensor (the memory returns to the allocator)."""
        self.layers = []

    def slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot ids (block * block_size + offset) of ``positions`` (N,) of rows ``table`` (N, W)."""
        block = table.gather(1, (positions // self.block_size).unsqueeze(1)).squeeze(1)
        return block * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k and v (N, nkv, hd) at flat ``slots`` (N,) of ``layer``'s pool."""
        keys, values = self.layers[layer]
        nkv, hd = self.spec.num_kv_heads, self.spec.head_dim
        keys.view(nkv, -1, hd).index_copy_(1, slots, k.transpose(0, 1).to(keys.dtype))
        values.view(nkv, -1, hd).index_copy_(1, slots, v.transpose(0, 1).to(values.dtype))

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Copy whole blocks ``sources`` into ``targets`` in every layer (a prompt's partial last block
        into each of its other samples' own block)."""
        if not sources:
            return
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        for keys, values in self.layers:
            keys[:, dst] = keys[:, src]
            values[:, dst] = values[:, src]
