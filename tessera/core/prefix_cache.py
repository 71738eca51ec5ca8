"""Prefix caching bookkeeping per sequence: the chained hashes of its full blocks, and how many of
its leading blocks it has offered to the device pool's cache table.

A full block is keyed by `hash_block_tokens(parent block's hash, its token ids)`, so equal keys
mean equal whole prefixes, not just equal blocks. The key is SHA-256 over a fixed byte encoding,
the same in every process and run (Python's `hash()` is salted per process by PYTHONHASHSEED, and
its 64 bits can be made to collide), so a prefill process and a decode process can compare keys.
On a hit the pool also compares the block's stored parent hash and token ids with the caller's, so a
key collision, even a forced one, is a miss rather than another request's KV. (A wrong hit would
need two different prefixes whose chained SHA-256 digests are equal.)

Only full blocks whose KV is computed are registered; the pool keeps them reusable after they are
freed until it evicts them (LRU).

With KV cache groups (core/kv_cache_groups.py) each group has its own `PrefixCache`: group g's
chain starts from its own root (`group_root_hash`), so the same tokens key a different block in
each group, and it reads its entries of the interleaved table (i * num_groups + g). Group 0 keeps
the plain chain, so one-group keys are those of a model without groups.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as SequenceABC

from tessera.core.block_pool import BlockPool
from tessera.sequence import Sequence

# The parent of a sequence's first block. A fixed 32-byte value, so every hash input is a 32-byte
# parent followed by 8 bytes per token, and no two (parent, tokens) pairs share an encoding.
ROOT_HASH = hashlib.sha256(b"tessera prefix cache v1").digest()


def lora_root_hash(lora_int_id: int) -> bytes | None:
    """The parent of the first block of a sequence under LoRA adapter `lora_int_id` (None for the
    base model, whose first block hashes from ROOT_HASH): the same tokens under two adapters have
    different KV, so every key of their chains differs, and so does the stored parent a hit is
    checked against."""
    if lora_int_id == 0:
        return None
    return hashlib.sha256(b"tessera prefix cache v1 lora" + struct.pack("<q", lora_int_id)).digest()


def group_root_hash(root: bytes | None, group: int) -> bytes | None:
    """The parent of the first block in KV cache group `group`, given the sequence's root (None:
    ROOT_HASH): unchanged for group 0, a distinct digest per group otherwise."""
    if group == 0:
        return root
    head = ROOT_HASH if root is None else root
    return hashlib.sha256(head + b"kv cache group" + struct.pack("<q", group)).digest()


def hash_block_tokens(parent: bytes | None, token_ids: SequenceABC[int]) -> bytes:
    """The prefix-cache key of a block: the 32-byte SHA-256 digest of `parent` (the previous
    block's key, or ROOT_HASH for the first block when None) followed by the token ids as
    little-endian int64. Deterministic across processes, machines and Python versions."""
    head = ROOT_HASH if parent is None else parent
    return hashlib.sha256(head + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, group: int = 0,
                 num_groups: int = 1) -> None:
        self.pool = pool
        self.block_size = block_size
        self.group = group  # the KV cache group whose table entries this cache reads
        self.num_groups = num_groups
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> chained hashes of its full blocks
        self._num_cached: dict[int, int] = {}  # seq_id -> leading blocks already registered

    def _root(self, seq: Sequence) -> bytes | None:
        return group_root_hash(lora_root_hash(seq.lora_int_id), self.group)

    def _block_tokens(self, seq: Sequence, i: int) -> list[int]:
        return seq.get_token_ids_range(i * self.block_size, (i + 1) * self.block_size)

    def _seq_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Hashes of the first `num_full_blocks` blocks, memoised per sequence (tokens are only
        ever appended, so the chain only grows)."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        if len(hashes) < num_full_blocks:
            parent = hashes[-1] if hashes else self._root(seq)
            for i in range(len(hashes), num_full_blocks):
                parent = hash_block_tokens(parent, self._block_tokens(seq, i))
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
        parent = self._root(seq)
        for i, h in enumerate(self._seq_hashes(seq, full)[:full]):
            block = self.pool.lookup(h, parent, self._block_tokens(seq, i))
            if block is None:
                break
            hits.append(block)
            parent = h
        if len(hits) * self.block_size >= num_tokens:
            hits.pop()
        return hits

    def admitted(self, seq: Sequence, num_hit_blocks: int) -> None:
        """The sequence got its table; its first `num_hit_blocks` blocks came from the cache."""
        self._num_cached[seq.seq_id] = num_hit_blocks

    def register(self, seq: Sequence, table: list[int]) -> None:
        """Offer the sequence's blocks that are now full and computed to other requests (`table`:
        the sequence's whole table, groups interleaved)."""
        ng, g = self.num_groups, self.group
        full = min(seq.num_computed_tokens // self.block_size, len(table) // ng)
        start = self._num_cached.get(seq.seq_id, 0)
        if full <= start:
            return
        hashes = self._seq_hashes(seq, full)
        root = self._root(seq)
        for i in range(start, full):
            block = table[i * ng + g]
            if block < 0:  # released by the sliding window (block_manager.NULL_BLOCK)
                continue
            parent = hashes[i - 1] if i else root
            self.pool.register(block, hashes[i], parent, self._block_tokens(seq, i))
        self._num_cached[seq.seq_id] = full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._hashes[child.seq_id] = list(self._hashes.get(parent.seq_id, ()))
        self._num_cached[child.seq_id] = self._num_cached.get(parent.seq_id, 0)

    def forget(self, seq: Sequence) -> None:
        self._hashes.pop(seq.seq_id, None)
        self._num_cached.pop(seq.seq_id, None)
