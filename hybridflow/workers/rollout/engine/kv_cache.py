"""A preallocated KV cache: one (slots, nkv, max_len, hd) key and value tensor per layer.

Each running sequence owns one slot (a row). The engine keeps its running batch packed into the
first B slots, so a decode step reads plain slices; when a sequence finishes, the last running row is
moved into its slot (:meth:`KVCache.move_rows`). The slot count comes from a memory budget; a call
that knows its rows and lengths allocates only what it needs (:meth:`KVCache.allocate`), since the
cache is re-created for every rollout (``free_cache_engine``) and zeroing a budget-sized cache costs
more than decoding a few short answers.
"""

from __future__ import annotations

import torch

from hybridflow.workers.rollout.engine.model import ModelSpec


def bytes_per_slot(spec: ModelSpec, max_len: int, dtype: torch.dtype) -> int:
    """K and V for every layer of one sequence of ``max_len`` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * max_len * element


def slots_for_budget(
    spec: ModelSpec, max_len: int, dtype: torch.dtype, budget_bytes: int, max_slots: int
) -> int:
    """How many sequences fit in ``budget_bytes`` (at most ``max_slots``); raises if not even one."""
    per_slot = bytes_per_slot(spec, max_len, dtype)
    slots = min(int(max_slots), int(budget_bytes // per_slot))
    if slots < 1:
        raise MemoryError(
            f"KV cache budget {budget_bytes / 2**20:.1f} MiB holds no sequence of {max_len} tokens "
            f"({per_slot / 2**20:.1f} MiB each); raise the budget or lower max_model_len"
        )
    return slots


class KVCache:
    """``layers[i]`` is ``(keys, values)``, each (slots, nkv, max_len, hd). Empty after :meth:`release`."""

    def __init__(
        self, spec: ModelSpec, num_slots: int, max_len: int, dtype: torch.dtype, device, allocate: bool = True
    ) -> None:
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.capacity_slots, self.capacity_len = int(num_slots), int(max_len)
        # the allocated shape: the capacity unless allocate() was asked for less
        self.num_slots, self.max_len = self.capacity_slots, self.capacity_len
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        if allocate:  # else the first allocate() (the engine's resume) creates it, sized as asked
            self.allocate()

    @property
    def allocated(self) -> bool:
        return bool(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)

    def allocate(self, slots: int | None = None, length: int | None = None) -> None:
        """Create the cache tensors: ``slots`` rows of ``length`` positions (each at most the capacity;
        None: the capacity). A no-op while allocated."""
        if self.allocated:
            return
        self.num_slots = min(self.capacity_slots, int(slots)) if slots else self.capacity_slots
        self.max_len = min(self.capacity_len, int(length)) if length else self.capacity_len
        shape = (self.num_slots, self.spec.num_kv_heads, self.max_len, self.spec.head_dim)
        # zeros, not empty: masked positions still meet V in attention (0 x NaN garbage would be NaN)
        self.layers = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]

    def release(self) -> None:
        """Drop every cache tensor (the memory returns to the allocator)."""
        self.layers = []

    def flat_positions(self, lengths: torch.Tensor) -> torch.Tensor:
        """For rows 0..B-1 writing at positions ``lengths`` (B,): their (B * nkv,) row indices in a
        layer tensor viewed as (slots * nkv * max_len, hd), head-major within a row."""
        heads = torch.arange(self.spec.num_kv_heads, device=lengths.device)
        rows = torch.arange(lengths.shape[0], device=lengths.device)
        return (
            (rows[:, None] * self.spec.num_kv_heads + heads[None, :]) * self.max_len + lengths[:, None]
        ).reshape(-1)

    def move_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first ``length`` positions of slots ``src`` into slots ``dst`` (all layers)."""
        if not src:
            return
        src_index = torch.tensor(src, device=self.device)
        dst_index = torch.tensor(dst, device=self.device)
        for keys, values in self.layers:
            keys[dst_index, :, :length] = keys[src_index, :, :length]
            values[dst_index, :, :length] = values[src_index, :, :length]
