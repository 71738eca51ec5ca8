"""One pool of KV block ids (device or CPU swap): ref counts, a free list and, for the device pool
with prefix caching, the table of cached full blocks.

A block is in exactly one of three states:

    used       ref_count > 0            held by >= 1 block tables
    free       ref_count == 0, no hash  on `_free` (a LIFO stack: recently freed blocks are reused
                                        first, which keeps the working set small)
    evictable  ref_count == 0, hashed   on `_evictable` (an OrderedDict in LRU order); its KV is
                                        still valid, so a later prompt with the same prefix can take
                                        it back; it is evicted (hash dropped) only when `_free` is
                                        empty

A hashed block also keeps what its hash was computed from (its parent's hash and its token ids), and
`lookup` returns a block only when both match the caller's: a key collision is a miss, never
another request's KV. The hash itself comes from `prefix_cache.hash_block_tokens`; the pool treats
it as an opaque bytes key.

Free counts include evictable blocks: they can be handed out at any moment. Every operation is
O(1) per block (O(block_size) for a lookup's compare). Pure Python: the pool only hands out ids,
the cache engine owns the tensors.
"""

from __future__ import annotations

import logging
import operator
from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat

logger = logging.getLogger(__name__)

# what a cached block's hash was computed from: (parent block's hash or None, its token ids)
BlockContent = tuple[bytes | None, tuple[int, ...]]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False, first_id: int = 0) -> None:
        """Ids `first_id` .. `first_id + num_blocks - 1`: a second pool (the draft model's,
        core/block_manager.py) numbers its blocks past the first's, so one table and one copy
        list can name blocks of both."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if first_id < 0:
            raise ValueError(f"first_id must be >= 0, got {first_id}")
        self.num_blocks = num_blocks
        self.first_id = first_id
        self.enable_caching = enable_caching
        end = first_id + num_blocks
        self.ref_counts = [0] * end  # indexed by id; ids below first_id stay 0
        # popped from the end, so the first id is handed out first
        self._free: list[int] = list(range(end - 1, first_id - 1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_hash: list[bytes | None] = [None] * end
        self._block_content: list[BlockContent | None] = [None] * end  # set iff hashed
        self._cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        """A fresh block with ref count 1; evicts the least recently used cached block if needed."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self._block_hash[block]
            self._block_hash[block] = None
            self._block_content[block] = None
            if self._cached.get(h) == block:  # type: ignore[arg-type]
                del self._cached[h]  # type: ignore[arg-type]
        else:
            raise RuntimeError("out of KV blocks: the caller must check free counts first")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Share a block (fork, swap mapping, prefix hit); revives it if it was evictable."""
        if self.ref_counts[block] == 0:
            # only hashed (evictable) blocks can be revived: lookups never return a plain free block
            del self._evictable[block]
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        rc = self.ref_counts[block] - 1
        if rc < 0:
            raise AssertionError(f"block {block} freed more often than it was allocated")
        self.ref_counts[block] = rc
        if rc == 0:
            if self._block_hash[block] is not None:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.append(block)

    # prefix cache

    def lookup(
        self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]
    ) -> int | None:
        """The block holding the computed KV of `token_ids` after the prefix whose last block
        hashed to `parent_hash` (None for the first block), if it is cached under `block_hash`."""
        block = self._cached.get(block_hash)
        if block is None:
            return None
        if self._block_content[block] != (parent_hash, tuple(token_ids)):
            logger.warning("prefix cache key collision on block %d: treated as a miss", block)
            return None
        return block

    def register(
        self, block: int, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int]
    ) -> None:
        """Mark a full, computed, used block as reusable under `block_hash`, computed from
        `parent_hash` and `token_ids`. A block that already has a hash, or a hash already cached
        in another block (the same content, or a collision), is left as it is."""
        if self._block_hash[block] is not None or block_hash in self._cached:
            return
        self._block_hash[block] = block_hash
        self._block_content[block] = (parent_hash, tuple(token_ids))
        self._cached[block_hash] = block

    def is_hashed(self, block: int) -> bool:
        return self._block_hash[block] is not None

    def block_states(self) -> bytes:
        """One byte per block for a live view (tessera/engine/dashboard): bit 0 set when the
        block is used (ref count > 0), bit 1 when it holds a prefix-cached hash; so 0 free,
        1 used, 2 cached and evictable, 3 used and cached. Built when sampled, never kept up to
        date on the hot path: each bit is one pass in C (`map` into `bytes`) and the two are
        added as big integers, where one byte never carries into the next."""
        first = self.first_id
        used = bytes(map(bool, self.ref_counts[first:]))
        if not self.enable_caching:
            return used
        hashed = bytes(map(operator.is_not, self._block_hash[first:], repeat(None)))
        total = int.from_bytes(used, "little") + 2 * int.from_bytes(hashed, "little")
        return total.to_bytes(self.num_blocks, "little")

    def check_integrity(self, refs: dict[int, int], name: str) -> None:
        """`refs`: block id -> number of block tables holding it. Raises AssertionError on any
        leak, double ownership or ref-count drift."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{name}: a block is on the free list twice")
        evictable = set(self._evictable)
        if free & evictable:
            raise AssertionError(f"{name}: blocks both free and evictable: {free & evictable}")
        if any(b < self.first_id for b in refs):
            raise AssertionError(f"{name}: a table holds a block of another pool")
        for block in range(self.first_id, self.first_id + self.num_blocks):
            rc = self.ref_counts[block]
            if rc != refs.get(block, 0):
                raise AssertionError(
                    f"{name}: block {block} has ref count {rc} but {refs.get(block, 0)} tables "
                    f"hold it"
                )
            unowned = block in free or block in evictable
            if (rc == 0) != unowned:
                raise AssertionError(f"{name}: block {block} ref {rc} but free={unowned}")
            h = self._block_hash[block]
            if block in free and h is not None:
                raise AssertionError(f"{name}: free block {block} still has a hash")
            if block in evictable and h is None:
                raise AssertionError(f"{name}: evictable block {block} has no hash")
            if h is not None and self._cached.get(h) != block:
                raise AssertionError(f"{name}: block {block} hash not in the cache table")
            if (h is None) != (self._block_content[block] is None):
                raise AssertionError(f"{name}: block {block} hash and stored tokens disagree")
        used = sum(1 for rc in self.ref_counts if rc > 0)
        if used + self.num_free != self.num_blocks:
            raise AssertionError(f"{name}: used {used} + free {self.num_free} != {self.num_blocks}")
        if len(self._cached) != sum(1 for h in self._block_hash if h is not None):
            raise AssertionError(f"{name}: cache table and block hashes disagree")
