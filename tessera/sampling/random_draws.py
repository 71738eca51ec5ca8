"""The draw of a random (non-greedy) row: temperature, then top-k, top-p and min-p on the most
likely candidates, then the inverse CDF at one uniform per sample (sampler.py says why this
sampler). Shared by the sampler and by speculative verification's exact distributions."""

from __future__ import annotations

import torch

from tessera.sampling.params import SamplingParams
from tessera.sampling.rows import SamplingRow


def sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Random rows: [R, V] processed logits -> [sum(num_samples)] token ids, in row order."""
    num_rows, vocab = logits.shape
    device = logits.device
    params = [r.params for r in rows]
    inv_temp = torch.tensor([1.0 / p.temperature for p in params], device=device)
    probs = (logits * inv_temp[:, None]).softmax(dim=-1)  # [R, V]

    num_samples = [r.num_samples for r in rows]
    starts = [0] * num_rows
    for i in range(1, num_rows):
        starts[i] = starts[i - 1] + num_samples[i - 1]
    u = _uniforms(rows, device)  # [S]
    out = torch.empty(len(u), dtype=torch.long, device=device)

    filtered = [i for i, p in enumerate(params) if has_filter(p, vocab)]
    plain = [i for i, p in enumerate(params) if not has_filter(p, vocab)]
    if plain:
        sub = select_rows(probs, plain)
        pos, rep = _expand(plain, starts, num_samples, device)
        if len(pos) != len(plain):  # a row drawing several samples
            sub = sub.repeat_interleave(rep, dim=0)  # [S_plain, V]
        out[pos] = inverse_cdf(sub, u[pos])
    # Top-k/top-p/min-p rows: their kept tokens are a prefix of the tokens sorted by probability.
    # Sorting the whole vocabulary is slow on CPU (~0.5 s for 64 x 49k), so take the top K
    # candidates and widen K only for rows whose kept prefix might extend past them.
    todo = filtered
    # each row's probability mass as float32 computed it: a long flat tail makes it fall short
    # of 1 by more than top_p's rounding, and top-p with top-k off is relative to it
    row_mass = probs.sum(dim=-1)  # [R]
    for k in (64, 1024, vocab):
        if not todo:
            break
        k = min(k, vocab)
        sub_params = [params[i] for i in todo]
        cand_probs, cand_ids = select_rows(probs, todo).topk(k, dim=-1)  # [T, k] sorted descending
        kept, resolved = apply_filters(cand_probs, sub_params, vocab,
                                       row_mass[torch.tensor(todo, device=device)])
        done = [j for j, ok in enumerate(resolved.tolist()) if ok]
        if done:
            sel = torch.tensor(done, device=device)
            pos, rep = _expand([todo[j] for j in done], starts, num_samples, device)
            # float64: a prefix sum over few candidates is cheap and then exact enough to make the
            # choice independent of how many candidates were taken
            choice = inverse_cdf(kept[sel].double().repeat_interleave(rep, dim=0), u[pos])
            out[pos] = cand_ids[sel].repeat_interleave(rep, dim=0).gather(
                1, choice[:, None]).squeeze(1)
        todo = [todo[j] for j, ok in enumerate(resolved.tolist()) if not ok]
    return out


def select_rows(x: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
    """x[row_ids] without a copy when that is all of x; index_select beats fancy indexing on CPU."""
    if len(row_ids) == x.shape[0] and row_ids == list(range(len(row_ids))):
        return x
    return x.index_select(0, torch.tensor(row_ids, device=x.device))


def has_filter(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _expand(row_ids: list[int], starts: list[int], num_samples: list[int], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat sample positions of these rows, and how many samples each row has."""
    pos = [starts[i] + j for i in row_ids for j in range(num_samples[i])]
    rep = [num_samples[i] for i in row_ids]
    return torch.tensor(pos, device=device), torch.tensor(rep, device=device)


def apply_filters(cand: torch.Tensor, params: list[SamplingParams], vocab: int,
                   row_mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p, then min-p (vLLM's order) on each row's top candidates.

    cand: [T, K] probabilities sorted descending, the first K of `vocab`; row_mass: [T] each
    row's total over the whole vocabulary (default 1). Returns the candidates
    with dropped ones zeroed and, per row, whether the kept prefix provably ends inside the K
    candidates and is the one the complete vocabulary would give (always, when K == vocab).
    """
    num_rows, k = cand.shape
    device = cand.device
    # top_k of 0, -1 or >= vocab is off; as `vocab` it keeps every candidate
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    keep = torch.arange(k, device=device)[None, :] < top_k[:, None]  # [T, K]
    kept = cand * keep
    # top-p on the top-k-renormalised distribution: keep a token while the mass strictly above
    # it is below top_p (so the most likely token always stays). top_p == 1 is off: in float32
    # the mass above a tail token can round up to the total and would drop it.
    use_k = top_k <= k  # the top-k mass is the kept candidates' sum
    p_off = top_p >= 1
    # with top-k off the total is the whole distribution's (row_mass); with K < top_k < vocab it is
    # not
    # known from the candidates, so such a row resolves only once top-p is off or K reaches top_k
    whole = row_mass.to(top_p.dtype) if row_mass is not None else torch.ones_like(top_p)
    total = torch.where(use_k, kept.sum(dim=-1), whole)  # [T]
    total_known = use_k | (top_k == vocab) | p_off
    above = kept.cumsum(dim=-1) - kept
    keep &= (above < (top_p * total)[:, None]) | p_off[:, None]
    # min-p compares with the most likely token; renormalising does not change that ratio
    keep &= cand >= (min_p * cand[:, 0])[:, None]
    keep[:, 0] = True  # the most likely token always survives (top_p may underflow to 0)
    kept = cand * keep
    # the next token past the candidates is dropped if any active filter already drops it
    ends_inside = (use_k | (~p_off & (cand.sum(dim=-1) >= top_p * total))
                   | ((min_p > 0) & (cand[:, -1] < min_p * cand[:, 0])))
    return kept, total_known & ends_inside


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i drawn with probability weights[i] / sum(weights), row by row, from u ~ U[0, 1).

    weights: [S, K] >= 0 (need not sum to 1), u: [S]. A zero weight is never chosen: the pick is
    the first i whose prefix sum exceeds u * total, and a zero weight does not raise the sum.
    """
    cdf = weights.cumsum(dim=-1)  # [S, K]
    total = cdf[:, -1]
    # u * total may round up to total; the float just below it still lands on a nonzero weight
    x = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, x[:, None], right=True).squeeze(1)
    return picked.clamp_(max=weights.shape[1] - 1)  # never past the end, whatever the weights


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per sample, in row order: a seeded row's from its own generator (so its draws
    never depend on the batch), the others' from one shared draw of the device's default RNG."""
    unseeded = sum(r.num_samples for r in rows if r.generator is None)
    shared = torch.rand(unseeded, device=device) if unseeded else None
    parts: list[torch.Tensor] = []
    taken = 0
    for r in rows:
        if r.generator is None:
            assert r.params.seed is None, "a seeded row needs its generator (SamplingRow.generator)"
            parts.append(shared[taken : taken + r.num_samples])
            taken += r.num_samples
        else:
            gen = r.generator
            parts.append(torch.rand(r.num_samples, generator=gen, device=gen.device).to(device))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
