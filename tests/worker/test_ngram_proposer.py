"""The n-gram proposer against a brute-force reference: for n from prompt_lookup_max down to
prompt_lookup_min, the latest earlier occurrence of the last n tokens, and the k tokens after it."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.worker.spec_decode import NgramProposer


def reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    num = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= num:
            continue
        suffix = tokens[num - n:]
        for i in range(num - n - 1, -1, -1):  # the match must have a token after it
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_examples():
    p = NgramProposer(3, 4, 2)
    assert p.propose([1, 2, 3, 4, 5, 6, 7, 1, 2, 3]) == [4, 5, 6]
    assert p.propose([5, 1, 2, 7, 1, 2, 8, 1, 2]) == [8, 1, 2]  # the latest occurrence
    assert p.propose([9, 1, 2, 3, 7, 0, 2, 3, 8, 1, 2, 3]) == [7, 0, 2]  # the longest match wins
    assert p.propose([1, 2, 3, 4, 5]) == []  # nothing matches: nothing proposed
    assert p.propose([1, 2, 1]) == []  # a 1-gram is below prompt_lookup_min
    assert NgramProposer(3, 4, 1).propose([1, 2, 1]) == [2, 1]


@pytest.mark.parametrize("seed", range(200))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 12))
    tokens = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
    k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    max_n = min_n + int(rng.integers(0, 4))
    assert NgramProposer(k, max_n, min_n).propose(tokens) == reference(tokens, k, max_n, min_n)
