"""Which sequences run, on which KV blocks: admission by free blocks, growth, preemption, prefix keys.

The engine's scheduling over the paged cache (:mod:`.block_pool` is the pool's bookkeeping, this is
the policy), as vLLM schedules:

- **Admission** (:meth:`BlockScheduler.admit`): preempted sequences first (oldest first), then waiting
  requests in order, while there are rows (``max_num_seqs``), prefill room (``max_num_batched_tokens``
  padded new tokens, at least one item) and free blocks. A request's prompt is looked up in the prefix
  cache; its cached blocks are shared, its other full blocks are taken once and shared by its ``n``
  samples, and each sample takes one block of its own: the prompt's partial last block (copied from
  the first sample's after the prefill) or, after a whole last block, the block its first token goes to.
  Within one admission round a prompt also shares the full blocks an earlier item of the round takes
  for the same tokens (a system prompt many new requests start with, as vLLM's scheduler does): the
  round is prefilled together, and each layer writes every row's keys and values before any row
  attends, so those blocks hold their contents when the later row reads them as its prefix
  (:attr:`PrefillItem.lenders` names the items it reads from).
- **Growth** (:meth:`BlockScheduler.grow`): before a decode step (or burst of k), every running
  sequence gets the blocks that its next positions need. When the pool runs out, the most recently
  admitted sequence is **preempted**: its blocks go back (its full blocks stay cached) and it waits to
  be recomputed (its prompt and tokens prefilled again, from the cache where they still are; its
  pending token, draws and log-probs are kept, so its output is what it would have been).
- **Prefix keys** (:meth:`BlockScheduler.register_full`): a sequence's blocks are keyed as they fill,
  prompt and generated tokens alike, so the next turn of a conversation finds its whole context.

A cached prefix never covers a prompt's last token: its logits are needed (at most
``(len - 1) // block_size`` blocks are looked up).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from hybridflow.workers.rollout.engine.block_pool import BlockPool, block_keys, next_key
from hybridflow.workers.rollout.engine.requests import EngineRequest, RunningSequence, cached_tokens


@dataclass
class PrefillItem:
    """One prefill row: ``tokens`` of which the first ``start`` are cached; ``tables[i]`` is sample i's
    block table (the prefill writes through ``tables[0]``; the others share its full blocks and own a
    copy of its partial last block). ``request`` set: a new request's ``n`` samples; ``resumed`` set:
    a preempted sequence recomputed (its logits are not used)."""

    tokens: list[int]
    start: int
    keys: list[bytes]
    tables: list[list[int]]
    request: EngineRequest | None = None
    resumed: RunningSequence | None = None
    partial_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, target) blocks
    lenders: set[int] = field(default_factory=set)  # earlier items of the round whose new blocks it reads

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.start


class BlockScheduler:
    """Admission and block bookkeeping for one engine; ``waiting`` requests and ``preempted``
    sequences queue here (``lock`` guards ``waiting``: requests join from other threads)."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.waiting: list[EngineRequest] = []
        self.preempted: deque[RunningSequence] = deque()
        self.lock = threading.Lock()
        self.preemptions = 0

    # ------------------------------------------------------------------ admission
    def admission_blocks(self, prompt_len: int, n: int) -> int:
        """Free blocks a prompt of ``prompt_len`` tokens with ``n`` samples needs to be admitted with
        nothing cached (its full blocks once, one block per sample)."""
        return prompt_len // self.pool.block_size + n

    def can_join(self, running: int) -> bool:
        """Whether a queued item could be admitted now by rows and free blocks (a burst then stops)."""
        item = self._head()
        if item is None:
            return False
        n, tokens = item
        fits = self.pool.num_free >= self.admission_blocks(len(tokens), n)
        return running + n <= self.max_num_seqs and fits

    def admit(self, running: int) -> list[PrefillItem]:
        """Items to prefill now, together (see the module docstring); their blocks are taken."""
        admitted: list[PrefillItem] = []
        rows, widest = running, 0
        round_blocks: dict[bytes, tuple[int, int]] = {}  # key -> (block, item) of blocks this round fills
        with self.lock:
            while True:
                head = self._head()
                if head is None:
                    break
                n, tokens = head
                if rows + n > self.max_num_seqs:
                    break
                item = self._plan(tokens, n, round_blocks)
                if item is None:
                    break
                width = max(widest, item.new_tokens)
                if admitted and (len(admitted) + 1) * width > self.max_num_batched_tokens:
                    self._undo(item)
                    break
                if self.preempted:
                    item.resumed = self.preempted.popleft()
                else:
                    item.request = self.waiting.pop(0)
                self.pool.count_query(len(tokens), item.start // self.pool.block_size)
                if self.pool.caching:  # its full blocks past the prefix: later items of the round share them
                    for i in range(item.start // self.pool.block_size, len(tokens) // self.pool.block_size):
                        round_blocks.setdefault(item.keys[i], (item.tables[0][i], len(admitted)))
                admitted.append(item)
                rows += n
                widest = width
        return admitted

    def _head(self) -> tuple[int, list[int]] | None:
        """``(n, tokens to prefill)`` of the next item to admit, or None."""
        if self.preempted:
            return 1, cached_tokens(self.preempted[0])
        if self.waiting:
            return self.waiting[0].n, self.waiting[0].prompt_ids
        return None

    def _plan(
        self, tokens: list[int], n: int, round_blocks: dict[bytes, tuple[int, int]]
    ) -> PrefillItem | None:
        """Take the blocks of ``tokens`` for ``n`` samples (cached ones and those this admission round
        fills, ``round_blocks``, held), or None when the pool cannot hold them now."""
        pool, size = self.pool, self.pool.block_size
        extra = self._digest()
        keys = block_keys(tokens, size, extra)
        limit = (len(tokens) - 1) // size
        hits = pool.lookup(keys[:limit])
        lenders: set[int] = set()
        while len(hits) < limit and keys[len(hits)] in round_blocks:  # the chain goes on in this round
            block, lender = round_blocks[keys[len(hits)]]
            hits.append(block)
            lenders.add(lender)
        full = len(tokens) // size
        if pool.num_free - pool.evictable_among(hits) < (full - len(hits)) + n:
            return None
        for block in hits:
            pool.hold(block)
        shared = hits + [pool.take() for _ in range(full - len(hits))]
        for _ in range(n - 1):
            for block in shared:
                pool.hold(block)
        owned = [pool.take() for _ in range(n)]
        tables = [[*shared, block] for block in owned]
        copies = [(owned[0], block) for block in owned[1:]] if len(tokens) % size else []
        return PrefillItem(tokens, len(hits) * size, keys, tables, partial_copies=copies, lenders=lenders)

    def _digest(self) -> bytes:
        """The image digest of the head item's request (every prefix key of the prompt covers it)."""
        if self.preempted:
            return self.preempted[0].request.image_digest
        return self.waiting[0].image_digest

    def _undo(self, item: PrefillItem) -> None:
        for table in item.tables:
            self.pool.drop(table)

    # ------------------------------------------------------------------ running sequences
    def grow(self, running: list[RunningSequence], positions: int) -> list[RunningSequence]:
        """Give every sequence of ``running`` (admission order) blocks for its next ``positions``
        positions, preempting from the end when the pool runs out. Returns the preempted ones (removed
        from ``running``, queued to be recomputed)."""
        preempted: list[RunningSequence] = []
        index = 0
        while index < len(running):
            seq = running[index]
            needed = self.pool.blocks_for(seq.length + positions) - len(seq.blocks)
            while needed > 0 and self.pool.num_free < needed and running[-1] is not seq:
                preempted.append(self._preempt(running.pop()))
            if needed > 0 and self.pool.num_free < needed:  # seq is the last one left to take from
                preempted.append(self._preempt(running.pop()))
                continue
            seq.blocks.extend(self.pool.take() for _ in range(max(needed, 0)))
            index += 1
        return preempted

    def _preempt(self, seq: RunningSequence) -> RunningSequence:
        self.release(seq)
        self.preempted.appendleft(seq)  # preempted from the end: the queue keeps admission order
        self.preemptions += 1
        return seq

    def release(self, seq: RunningSequence) -> None:
        """``seq`` gives its blocks back (its keyed full blocks stay cached)."""
        self.pool.drop(seq.blocks)
        seq.blocks, seq.keys = [], []

    def register_full(self, seq: RunningSequence) -> None:
        """Key the blocks ``seq`` has filled since the last call (they hold positions < ``length``)."""
        size = self.pool.block_size
        if not (seq.cacheable and self.pool.caching) or (len(seq.keys) + 1) * size > seq.length:
            return
        tokens = (seq.request.prompt_ids + seq.token_ids)[: seq.length]  # mid-step too: positions < length
        extra = seq.request.image_digest
        while (len(seq.keys) + 1) * size <= seq.length:
            i = len(seq.keys)
            key = next_key(seq.keys[-1] if seq.keys else b"", tokens[i * size : (i + 1) * size], extra)
            self.pool.register(seq.blocks[i], key)
            seq.keys.append(key)
