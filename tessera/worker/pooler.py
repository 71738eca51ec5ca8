"""Pooling a prompt's final hidden states into one embedding, chunk by chunk.

With chunked prefill a prompt's hidden states arrive over several steps, and the runner never
keeps them: each step hands `PoolingState.add` the rows of the chunk it computed, and the state
keeps only what the pooling type needs (vLLM's types):

    LAST  the last prompt position's row (seen in the chunk that completes the prompt)
    MEAN  a float32 running sum of every row, divided by the prompt length at the end
    CLS   the first position's row (seen in the chunk that starts at 0)

`covered` counts the leading positions already folded in, so a chunk that is run again (a step
re-run after a failure) is not counted twice, and a chunk that would leave a gap is refused.
Preemption by recompute restarts the prompt at 0 and the state with it; a swapped-out request
keeps its state in the runner and resumes where it left off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from tessera.pooling_params import PoolingParams


@dataclass
class PoolingState:
    params: PoolingParams
    covered: int = 0  # positions [0, covered) are folded into `acc`
    acc: torch.Tensor | None = None  # [hidden_size] float32: the sum (MEAN) or the CLS row

    def add(self, rows: torch.Tensor, start: int, num_prompt_tokens: int) -> list[float] | None:
        """Fold in `rows` (`[n, hidden_size]`, the hidden states of positions [start, start + n));
        returns the embedding when they complete the prompt, else None."""
        end = start + rows.shape[0]
        if start == 0:
            self.covered, self.acc = 0, None  # (re)started from the beginning
        kind = self.params.pooling_type
        if start > self.covered and kind != "LAST":  # LAST may start after a prefix-cache hit
            raise RuntimeError(f"pooling: positions [{self.covered}, {start}) were never seen "
                               "(a prefix-cache hit on a request that pools every position)")
        new = rows[self.covered - start:] if self.covered > start else rows
        if kind == "MEAN" and new.shape[0]:
            part = new.float().sum(dim=0)
            self.acc = part if self.acc is None else self.acc + part
        elif kind == "CLS" and start == 0:
            self.acc = rows[0].float()
        self.covered = max(self.covered, end)
        if end < num_prompt_tokens:
            return None
        if kind == "LAST":
            vector = rows[-1].float()
        elif kind == "MEAN":
            assert self.acc is not None
            vector = self.acc / num_prompt_tokens
        else:
            assert self.acc is not None, "CLS pooling without the first position"
            vector = self.acc
        if self.params.normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector.tolist()
