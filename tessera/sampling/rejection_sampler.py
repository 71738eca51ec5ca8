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

Draft models at temperature > 0 sample their drafts from their own distribution q_j, which is no
point mass, so verification is the general rule (`rejection_sample`): accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from norm(max(0, p_j - q_j)); if all k
were accepted, draw the bonus from p_k. Each emitted token is then distributed as p (Leviathan et
al. 2023, theorem 1; Chen et al. 2023). Its randomness is three uniforms per token position
(`position_uniforms`): w draws the draft, u decides acceptance, v draws the replacement or bonus.
A seeded request takes them from a generator keyed by (seed, position), so its tokens depend
neither on the batch nor on how many of its drafts the token budget let it verify.
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


def position_uniforms(seed: int | None, positions: list[int], device: torch.device) -> torch.Tensor:
    """[len(positions), 3] uniforms (w, u, v) for these token positions of one request (see the
    module docstring); unseeded requests draw them from the default generator."""
    if seed is None:
        return torch.rand(len(positions), 3, device=device)
    rows = []
    for pos in positions:
        # splitmix-style mixing of (seed, position) into one 63-bit generator seed
        key = (seed * 0x9E3779B97F4A7C15 + pos * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**63
        rows.append(torch.rand(3, generator=torch.Generator().manual_seed(key)))
    return torch.stack(rows).to(device)


def inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """Index i drawn with probability weights[i] / sum(weights), weights [V] >= 0, from one
    u ~ U[0, 1); a zero weight is never chosen."""
    cdf = weights.double().cumsum(0)
    x = min(u * float(cdf[-1]), float(torch.nextafter(cdf[-1], torch.zeros_like(cdf[-1]))))
    i = int(torch.searchsorted(cdf, torch.tensor([x], dtype=cdf.dtype, device=cdf.device),
                               right=True))
    return min(i, weights.shape[0] - 1)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_token_ids: list[int], uniforms: torch.Tensor) -> tuple[int, int]:
    """The general rule for drafts d_j ~ q_j: (number accepted a, the token emitted after them).

    target_probs [m + 1, V]: processed p_j (row m scores the bonus position); draft_probs [m, V]:
    the q_j the drafts were drawn from; uniforms [m + 1, 3] from `position_uniforms` (u in
    column 1, v in column 2)."""
    m = len(draft_token_ids)
    a = m
    if m:
        d = torch.tensor(draft_token_ids, device=target_probs.device)
        rows = torch.arange(m, device=target_probs.device)
        p_d, q_d = target_probs[rows, d], draft_probs[rows, d]
        # accept with probability min(1, p/q): u < p / q, written without dividing by q
        accepted = (uniforms[:m, 1].to(p_d.device) * q_d < p_d).tolist()
        a = accepted.index(False) if False in accepted else m
    v = float(uniforms[a, 2])
    if a == m:  # every draft accepted: the bonus token from p_m
        return a, inverse_cdf(target_probs[m], v)
    residual = (target_probs[a] - draft_probs[a]).clamp_(min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
        residual = target_probs[a]
    return a, inverse_cdf(residual, v)
