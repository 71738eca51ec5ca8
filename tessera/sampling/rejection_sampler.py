"""Verifying draft tokens without changing the distribution of what comes out.

A request verifying k drafts d_0..d_{k-1} gets target logits at k + 1 positions: row j scores the
token after its context plus d_0..d_{j-1}. The sampler draws one token t_j per row from the
*processed* target distribution p_j (penalties, min_tokens, temperature, top-k, top-p, min-p
applied exactly as for a plain decode, with d_0..d_{j-1} counted as output), and the request
keeps the longest prefix where t_j == d_j, plus the first t_j that differs (or the bonus t_k).

This is Leviathan et al. / Chen et al. rejection sampling for drafts that are point masses
(q_j = one-hot(d_j): n-gram lookup, and greedy draft models). Their rule accepts d_j with
probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j) and, on rejection, samples from
norm(max(0, p_j - q_j)) = p_j with d_j removed, renormalised. Drawing t_j ~ p_j and accepting iff
t_j == d_j does exactly that: P(accept) = p_j(d_j), and t_j given t_j != d_j is p_j without d_j,
renormalised. So every emitted token is distributed as the target's, and greedy rows (argmax)
accept while the argmax equals the draft.

Why this form: each emitted token is drawn from its own row with one uniform, the same draw a
plain decode would make at that position. A seeded request (its own generator) therefore emits
the very tokens it would emit without speculation, whatever was drafted; the runner rewinds the
generator past the draws of rejected positions (`rewind_generator`).
"""

from __future__ import annotations

import torch


def num_accepted(sampled: list[int], draft_token_ids: list[int]) -> int:
    """How many leading drafts the target's own samples confirm (t_j == d_j). The request then
    emits sampled[: accepted + 1]: the confirmed drafts and the target's next token."""
    a = 0
    for t, d in zip(sampled, draft_token_ids, strict=False):
        if t != d:
            break
        a += 1
    return a


def rewind_generator(gen: torch.Generator, state: torch.Tensor, num_draws: int) -> None:
    """Put a request's generator where it would be after `num_draws` single draws from `state`
    (the sampler draws one uniform per row, row by row): rejected positions' draws are undone."""
    gen.set_state(state)
    for _ in range(num_draws):
        torch.rand(1, generator=gen, device=gen.device)
