"""The KV block pool's bookkeeping: which physical blocks are free, who holds them, which hold a prefix.

The KV cache (:mod:`.kv_cache`) is one pool of ``num_blocks`` blocks of ``block_size`` positions. A
sequence's keys and values live in the blocks of its *block table*, in order; it takes a block as it
grows and gives it back when it ends. This module keeps the host's view of the pool, as vLLM's block
manager does:

- **Reference counts.** A block held by k sequences has count k (the n samples of a prompt share its
  full blocks; a prefix cache hit shares a block with a finished or running sequence).
- **Automatic prefix caching.** A *full* block can carry a key: a digest of its parent block's key,
  its token ids and an ``extra`` digest (a vision-language prompt's image contents), so a key names
  the whole prefix up to the block's end (:func:`block_keys`). A new sequence looks its prompt's keys
  up in order and shares every block found (:meth:`BlockPool.lookup`); only the tokens past them are
  prefilled.
- **LRU eviction.** A keyed block whose count drops to 0 stays cached, evictable; a block is taken
  from the never-keyed free blocks first, then from the least recently released cached one (its key
  dropped).
- **Flush.** :meth:`BlockPool.flush` forgets every key (the weights changed: cached keys and values
  were computed with the old ones).

Counters (``stats``): ``prefix_queries`` and ``prefix_hits`` in tokens (vLLM's
``vllm:prefix_cache_queries`` / ``_hits``), ``evictions``, ``peak_blocks``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


def block_keys(tokens: list[int], block_size: int, extra: bytes = b"", parent: bytes = b"") -> list[bytes]:
    """The keys of the full blocks of ``tokens`` (``len(tokens) // block_size`` of them): block i's key
    digests block i-1's key (``parent`` for the first), its ``block_size`` token ids and ``extra``."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chunk = array("q", tokens[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk + extra, digest_size=16).digest()
        keys.append(parent)
    return keys


def next_key(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """The key of one full block of ``tokens`` (``block_size`` ids) after a block keyed ``parent``."""
    return block_keys(tokens, len(tokens), extra, parent)[0]


class BlockPool:
    """Block ids ``1..num_blocks`` of a pool of ``num_blocks + 1``: block 0 is scratch, never given to
    a sequence (a padded batch's rows write there, :mod:`.decode_step`). ``caching``: whether full
    blocks are keyed and looked up."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.num_blocks, self.block_size, self.caching = int(num_blocks), int(block_size), bool(caching)
        self.refs = [0] * (self.num_blocks + 1)
        self._free: deque[int] = deque(range(1, self.num_blocks + 1))  # count 0, no key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0, keyed; oldest first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.stats = {"prefix_queries": 0, "prefix_hits": 0, "evictions": 0, "peak_blocks": 0}

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now (free, or cached and evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """Share of the pool held by sequences (0..1), vLLM's ``kv_cache_usage_perc``."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def num_cached(self) -> int:
        """Blocks that carry a prefix key (held or evictable)."""
        return len(self._key_of)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` keys and values."""
        return -(-int(positions) // self.block_size)

    # ------------------------------------------------------------------ taking and giving back
    def take(self) -> int:
        """A block for one sequence (count 1): a never-keyed free one, else the least recently released
        cached one (evicted: its key is dropped). Raises ``MemoryError`` when every block is held."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.stats["evictions"] += 1
        else:
            raise MemoryError(f"every one of the {self.num_blocks} KV blocks is held")
        self.refs[block] = 1
        self._note_peak()
        return block

    def hold(self, block: int) -> None:
        """One more sequence holds ``block`` (shared prompt blocks, a cache hit)."""
        if self.refs[block] == 0:
            self._evictable.pop(block, None)
        self.refs[block] += 1
        self._note_peak()

    def drop(self, blocks: list[int]) -> None:
        """A sequence gives ``blocks`` back; those no one holds become free (keyed ones: evictable, the
        most recently released last, so a block freed later is evicted later)."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"KV block {block} released more often than taken")
            if self.refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # ------------------------------------------------------------------ prefix caching
    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (not yet held: :meth:`hold` each one
        used; :meth:`count_query` once the sequence is admitted)."""
        if not self.caching:
            return []
        found = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def count_query(self, queried_tokens: int, hit_blocks: int) -> None:
        """An admitted prompt of ``queried_tokens`` found ``hit_blocks`` cached (vLLM counts both in
        tokens)."""
        self.stats["prefix_queries"] += int(queried_tokens)
        self.stats["prefix_hits"] += int(hit_blocks) * self.block_size

    def evictable_among(self, blocks: list[int]) -> int:
        """How many of ``blocks`` no one holds now (holding them takes them from the free count)."""
        return sum(1 for block in blocks if self.refs[block] == 0)

    def register(self, block: int, key: bytes) -> None:
        """Key a full, held ``block`` (its contents are final). A key already cached elsewhere, or a
        block already keyed, is left as it is (the block then stays private to its holders)."""
        if self.caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def flush(self) -> int:
        """Forget every prefix key (the weights changed); evictable blocks become free. Returns how
        many keys were dropped. Held blocks keep their contents for the sequences holding them."""
        dropped = len(self._key_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        return dropped

    def _note_peak(self) -> None:
        used = self.num_used
        if used > self.stats["peak_blocks"]:
            self.stats["peak_blocks"] = used
