"""N-gram prompt lookup (vLLM's `ngram` method, llama.cpp's "lookup"): if the last n tokens of a
request occurred before in its prompt + output, propose the tokens that followed them there.

Pays off when the output copies from the input (code edits, extraction, quoting) and costs a few
numpy comparisons when it does not: then it proposes nothing, the request decodes plainly, and the
step is what it would have been without speculation.

Matching, vectorised over the whole context at once (L tokens):

    ... a b c d x y z ... a b c d        last token d at L-1, n from prompt_lookup_max down to min
            ^ e                 ^ L-1    candidates e: earlier positions holding d (one comparison)
    match length at e = how many of d, c, b, a agree going backwards (one comparison per n)
    proposal = tokens[e+1 : e+1+k] for the latest e with the longest match >= prompt_lookup_min

The latest occurrence is taken: when the output is copying a passage, it is the one being copied.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        assert 1 <= prompt_lookup_min <= prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, token_ids: list[int] | np.ndarray) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (prompt + output); [] when nothing matches."""
        tokens = np.asarray(token_ids)
        num = tokens.shape[0]
        if num <= self.min_n:
            return []
        # candidate ends e < L-1 whose token equals the last one (and has a token after it)
        ends = np.flatnonzero(tokens[: num - 1] == tokens[num - 1])
        if ends.size == 0:
            return []
        # match length of each candidate, up to max_n, going backwards; it must stay inside
        # the context (e - j >= 0)
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, min(self.max_n, num - 1)):
            back = ends - j
            ok = back >= 0
            ok[ok] = tokens[back[ok]] == tokens[num - 1 - j]
            alive &= ok
            if not alive.any():
                break
            length += alive
        best = length.max()
        if best < self.min_n:
            return []
        e = int(ends[np.flatnonzero(length == best)[-1]])  # the latest of the longest
        return tokens[e + 1 : e + 1 + self.k].tolist()
