"""Prefix caching bookkeeping per sequence: the chained hashes of its full blocks, and how many of
its leading blocks it has offered to the device pool's cache table.

A full block is identified by hash(parent block's hash, its token ids), so equal hashes mean equal
whole prefixes, not just equal blocks. Only full blocks whose KV is computed are registered; the
pool keeps them reusable after they are freed until it evicts them (LRU). Like Python's own dict
keys, the 64-bit hash is trusted not to collide.
"""

from __future__ import annotations

from tessera.core.block_pool import BlockPool
from tessera.sequence import Sequence


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._hashes: dict[int, list[int]] = {}  # seq_id -> chained hashes of its full blocks
        self._num_cached: dict[int, int] = {}  # seq_id -> leading blocks already registered

    def _seq_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Hashes of the first `num_full_blocks` blocks, memoised per sequence (tokens are only
        ever appended, so the chain only grows)."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        if len(hashes) < num_full_blocks:
            bs = self.block_size
            tokens = seq.prompt_token_ids
            if num_full_blocks * bs > len(tokens):
                tokens = seq.get_token_ids()
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_full_blocks):
                parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
                hashes.append(parent)
        return hashes

    def hit_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the sequence's leading tokens (no side effects). Never all of its
        tokens: at least one is computed, so there is a position to sample from, and the block it
        lands in is private (a shared block is never written)."""
        num_tokens = seq.get_len()
        full = num_tokens // self.block_size
        if full == 0:
            return []
        hits = []
        for h in self._seq_hashes(seq, full)[:full]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        if len(hits) * self.block_size >= num_tokens:
            hits.pop()
        return hits

    def admitted(self, seq: Sequence, num_hit_blocks: int) -> None:
        """The sequence got its table; its first `num_hit_blocks` blocks came from the cache."""
        self._num_cached[seq.seq_id] = num_hit_blocks

    def register(self, seq: Sequence, table: list[int]) -> None:
        """Offer the sequence's blocks that are now full and computed to other requests."""
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        start = self._num_cached.get(seq.seq_id, 0)
        if full <= start:
            return
        hashes = self._seq_hashes(seq, full)
        for i in range(start, full):
            self.pool.register(table[i], hashes[i])
        self._num_cached[seq.seq_id] = full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._hashes[child.seq_id] = list(self._hashes.get(parent.seq_id, ()))
        self._num_cached[child.seq_id] = self._num_cached.get(parent.seq_id, 0)

    def forget(self, seq: Sequence) -> None:
        self._hashes.pop(seq.seq_id, None)
        self._num_cached.pop(seq.seq_id, None)
