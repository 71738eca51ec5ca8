"""The prefix-cache key is stable across processes, and a key collision is never a hit."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from core_fakes import make_group

import tessera.core.prefix_cache as prefix_cache
from tessera.core.block_manager import BlockManager
from tessera.core.prefix_cache import ROOT_HASH, hash_block_tokens
from tessera.sequence import SequenceStatus

REPO = Path(__file__).resolve().parents[2]
BLOCKS = [[1, 2, 3, 4], [5, 6, 7, 2**40], [0, 0, 0, 0]]


# run in a subprocess: the chained keys of the blocks in argv[1], as hex
CHAIN = """
import json, sys
from tessera.core.prefix_cache import hash_block_tokens
hashes, parent = [], None
for tokens in json.loads(sys.argv[1]):
    parent = hash_block_tokens(parent, tokens)
    hashes.append(parent.hex())
print(json.dumps(hashes))
"""


def test_hash_is_sha256_of_parent_and_int64_tokens():
    first = hashlib.sha256(ROOT_HASH + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first
    assert (
        hash_block_tokens(first, (9, 8))
        == hashlib.sha256(first + struct.pack("<2q", 9, 8)).digest()
    )
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(first, [1, 2])


def test_hash_is_the_same_in_other_processes():
    expected, parent = [], None
    for tokens in BLOCKS:
        parent = hash_block_tokens(parent, tokens)
        expected.append(parent.hex())
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, "-c", CHAIN, json.dumps(BLOCKS)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(out.stdout) == expected


# Block-manager level: admit, compute, and see what a second prompt gets from the cache.


def new_bm() -> BlockManager:
    return BlockManager(
        block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True
    )


def admit(bm: BlockManager, req_id: str, prompt: list[int]):
    group = make_group(req_id, 0, prompt=prompt)
    (hit_tokens,) = bm.allocate(group)
    seq = group.seqs[0]
    seq.num_computed_tokens = hit_tokens  # as the scheduler's set_progress does
    seq.status = SequenceStatus.RUNNING
    bm.check_integrity()
    return seq


def compute(bm: BlockManager, seq) -> None:
    seq.num_computed_tokens = seq.get_len()
    bm.cache_computed_blocks(seq)
    bm.check_integrity()


def test_hits_share_blocks_including_blocks_filled_by_decode():
    bm = new_bm()
    a = admit(bm, "a", [10, 11, 12, 13, 14, 15])
    compute(bm, a)
    for t in (16, 17, 18):  # block 1 is now prompt[4:6] + two generated tokens
        a.output_token_ids.append(t)
        bm.append_slots(a)
        compute(bm, a)
    b = admit(bm, "b", a.get_token_ids() + [99])
    assert b.num_computed_tokens == 8
    assert bm.get_block_table(b)[:2] == bm.get_block_table(a)[:2]
    miss = admit(bm, "miss", [10, 11, 12, 13, 0, 15, 16, 17, 99])
    assert miss.num_computed_tokens == 4  # only the first block is the same


def test_constant_hash_never_serves_another_prompt(monkeypatch: pytest.MonkeyPatch):
    # every block of every prompt gets the same key: only a token-for-token equal block may hit
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, tokens: b"\0" * 32)
    bm = new_bm()
    a = admit(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    other = admit(bm, "other", [50, 51, 52, 53, 54, 55, 56, 57, 58])
    assert other.num_computed_tokens == 0
    assert not set(bm.get_block_table(other)) & set(bm.get_block_table(a))
    same_head = admit(bm, "same_head", [1, 2, 3, 4, 60, 61, 62, 63, 64])
    assert same_head.num_computed_tokens == 4  # a genuine hit still works
    assert bm.get_block_table(same_head)[0] == bm.get_block_table(a)[0]


def test_hash_that_ignores_the_parent_never_serves_a_block_after_another_prefix(
    monkeypatch: pytest.MonkeyPatch,
):
    # keys collide for equal blocks at different places: the stored parent hash tells them apart
    monkeypatch.setattr(
        prefix_cache, "hash_block_tokens", lambda parent, tokens: hash_block_tokens(None, tokens)
    )
    bm = new_bm()
    a = admit(bm, "a", [5, 6, 7, 8, 1, 2, 3, 4, 0])
    compute(bm, a)
    moved = admit(bm, "moved", [1, 2, 3, 4, 0])  # block a's second block, now first
    assert moved.num_computed_tokens == 0
    same = admit(bm, "same", [5, 6, 7, 8, 1, 2, 3, 4, 7])
    assert same.num_computed_tokens == 8
    assert bm.get_block_table(same)[:2] == bm.get_block_table(a)[:2]


def test_integrity_catches_a_hashed_block_without_tokens():
    bm = new_bm()
    a = admit(bm, "a", [1, 2, 3, 4, 5])
    compute(bm, a)
    block = bm.get_block_table(a)[0]
    bm.gpu._block_content[block] = None
    with pytest.raises(AssertionError, match="stored tokens"):
        bm.check_integrity()
