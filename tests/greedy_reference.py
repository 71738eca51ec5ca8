"""Greedy comparison against the HF reference, with honest near-tie reporting.

Two greedy runs may part ways only at a numerical near-tie: where the reference's two best logits
are within `NEAR_TIE` of each other, float sums in a different order can flip the argmax. Such a
divergence is reported (returned), never hidden; any other divergence is a failure.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's own forward with its DynamicCache, argmax at every step. EOS is neither masked nor a
    stop:
    `generate(min_new_tokens=...)` would mask it and so change the argmax."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = hf_model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


@torch.inference_mode()
def check_greedy(hf_model, prompt: list[int], expected: list[int], got: list[int]) -> str | None:
    """None if identical; a near-tie description if they first differ at a near-tie; else fail."""
    n = min(len(expected), len(got))
    for i in range(n):
        if expected[i] != got[i]:
            logits = hf_model(torch.tensor([prompt + expected[:i]])).logits[0, -1].float()
            top2 = logits.topk(2).values
            gap = (top2[0] - top2[1]).item()
            msg = (f"first difference at output token {i}: reference {expected[i]}, "
                   f"ours {got[i]}, top-2 gap {gap:.2e}")
            assert gap <= NEAR_TIE, "not a near-tie: " + msg
            return "near-tie: " + msg
    assert len(expected) == len(got), f"lengths differ: {len(expected)} vs {len(got)}"
    return None
