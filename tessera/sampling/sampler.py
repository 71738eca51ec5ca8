"""The sampler: logits of every row sampled in a step -> chosen token ids (+ logprobs).

One call handles the whole batch. Per-row parameters become small tensors and every transform is
applied to all rows at once, in this order (vLLM's):

    raw logits (upcast to float32)                       ─┬─▶ logprobs (raw distribution)
      → repetition penalty (prompt + output tokens)       │
      → frequency and presence penalties (output tokens)  │
      → logit_bias, allowed_token_ids                     │
      → min_tokens: EOS and stop_token_ids masked         │
      → grammar mask (structured outputs, xgrammar)       │
      → greedy rows: argmax                               │
      → random rows: × 1/temperature → softmax → top-k → top-p → min-p
                     → inverse-CDF draw with one U[0, 1) per sample

Why not the exponential race (argmax(probs / Exp(1))): it needs vocab-many random numbers per
row. Measured here (1 thread, 64 rows x 49k vocab): Exp(1) noise + race 183 ms, a prefix sum +
binary search 3 ms. Both are exact samplers. Likewise a full sort for top-p costs ~550 ms, so
filters work on the top 64 candidates and widen only for rows whose kept set may reach past them
(or whose top-k does while top-p is on: top-p needs the top-k mass).

Seeds: a seeded row draws its uniforms from its own `torch.Generator` (one per sample), so its
tokens depend only on its own logits and generator state, never on the batch. Unseeded rows share
one draw from torch's default RNG for the device. Generators are never shared: each sequence of a
seeded request has its own (the runner's persistent batch creates them from the seed the
scheduler sends, `InputBatch._generator`, tessera/worker/input_batch.py). For `n > 1` the
first sequence's generator, seeded `seed`, draws all n first tokens at the fork (its row has
`num_samples = n`); child k (1 <= k < n) then continues with its own generator seeded `seed + k`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from tessera.kernels.fused import fused_ops_for
from tessera.sampling.grammar import GrammarState, apply_grammar_masks
from tessera.sampling.params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One row of logits and what the sampler needs to know about its sequence."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # for penalties and min_tokens
    # n when a prompt just completed and the engine will fork n-1 children from this row
    num_samples: int = 1
    # required when params.seed is set; may live on another device than the logits (noise is moved)
    generator: torch.Generator | None = None
    # masked (with params.stop_token_ids) while len(output_token_ids) < params.min_tokens
    eos_token_ids: tuple[int, ...] = ()
    # the sequence's place in its structured-output grammar (None: unconstrained)
    grammar: GrammarState | None = None


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # of token_id under the raw distribution (see `Sampler`)
    # params.logprobs top alternatives plus the chosen token; None when params.logprobs is None
    top_logprobs: dict[int, float] | None = None


@dataclass
class SamplerOutput:
    samples: list[list[SampledToken]]  # per row, row.num_samples entries


class Sampler:
    """Samples every row of a step at once.

    Logprobs (`SampledToken.logprob` and `top_logprobs`) are taken from the model's raw
    distribution: log_softmax of the logits as the model produced them, before penalties,
    min_tokens masking, temperature, top-k, top-p and min-p. They are what the model believes, not
    the distribution the token was drawn from (vLLM's default, and what OpenAI clients expect).
    """

    def __init__(self) -> None:
        self._fused: dict[torch.device, ModuleType | None] = {}

    def _fused_ops(self, device: torch.device) -> ModuleType | None:
        """The fused C++ ops for fp32 rows on `device`, looked up once (each lookup asks which
        build serves this CPU: ~10 us, every step before)."""
        if device not in self._fused:
            self._fused[device] = fused_ops_for(device, torch.float32)
        return self._fused[device]

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # logits: [num_rows, vocab], any float dtype, on any device
        # A step that raises is re-run without its culprit (engine/step_recovery.py); the seeded
        # rows must then draw the numbers they would have drawn, so their generators rewind.
        saved = [(r.generator, r.generator.get_state()) for r in rows if r.generator is not None]
        try:
            return self._sample_rows(logits, rows)
        except BaseException:
            for gen, state in saved:
                gen.set_state(state)
            raise

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        num_rows, vocab = logits.shape
        assert num_rows == len(rows), f"{num_rows} logit rows for {len(rows)} sampling rows"
        if not rows:
            return SamplerOutput([])
        device = logits.device
        raw = logits.float()  # [R, V]; never written to (may alias the caller's tensor)
        logits = self._penalize(raw, rows)

        # flat layout: row 0's samples, then row 1's, ...
        num_samples = [r.num_samples for r in rows]
        starts = [0] * num_rows
        for i in range(1, num_rows):
            starts[i] = starts[i - 1] + num_samples[i - 1]
        total = starts[-1] + num_samples[-1]
        if total == num_rows:  # one sample a row (all but a step that forks n > 1)
            row_of_sample = torch.arange(num_rows, device=device)
        else:
            row_of_sample = torch.repeat_interleave(
                torch.arange(num_rows, device=device), torch.tensor(num_samples, device=device))

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        randoms = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        # raw argmax and logsumexp [R] in one kernel call (two reads of each row, nothing written)
        fused = _fused_argmax_lse(raw, self._fused_ops(device))
        if not randoms and fused is not None and logits is raw:  # the common greedy step
            chosen = fused[0] if total == num_rows else fused[0][row_of_sample]  # [S]
        elif not randoms:  # fast path: no temperature, sort or noise
            chosen = logits.argmax(dim=-1)[row_of_sample]  # [S]
        else:
            chosen = torch.empty(total, dtype=torch.long, device=device)
            if greedy:
                g_pos = [starts[i] + j for i in greedy for j in range(num_samples[i])]
                g_rows = [i for i in greedy for _ in range(num_samples[i])]
                chosen[torch.tensor(g_pos, device=device)] = _rows(logits, g_rows).argmax(dim=-1)
            sub = _rows(logits, randoms)
            r_pos = [starts[i] + j for i in randoms for j in range(num_samples[i])]
            chosen[torch.tensor(r_pos, device=device)] = _sample(sub, [rows[i] for i in randoms])

        # logprobs from the raw distribution: logit - logsumexp from the kernel; without it
        # log_softmax (faster than torch's logsumexp on CPU). Rows asking for top logprobs take
        # theirs (and the chosen one) from log_softmax, so the two always agree.
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        if fused is None:
            raw_lp = raw.log_softmax(dim=-1)  # [R, V]
            chosen_lp = raw_lp[row_of_sample, chosen]  # [S]
            want_lp = _rows(raw_lp, want) if want else raw_lp
        else:
            lse = fused[1] if total == num_rows else fused[1][row_of_sample]
            chosen_lp = raw[row_of_sample, chosen] - lse  # [S]
            want_lp = _rows(raw, want).log_softmax(dim=-1) if want else raw
            for w, i in enumerate(want):
                for s in range(starts[i], starts[i] + num_samples[i]):
                    chosen_lp[s] = want_lp[w, chosen[s]]
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        if want:
            k_max = max(rows[i].params.logprobs for i in want)
            vals, ids = want_lp.topk(min(k_max, vocab), dim=-1)
            top_lps, top_ids = vals.tolist(), ids.tolist()  # [W, k_max]
        where_top = {i: w for w, i in enumerate(want)}

        chosen_list = chosen.tolist()
        chosen_lp_list = chosen_lp.tolist()
        samples: list[list[SampledToken]] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            out = []
            for s in range(starts[i], starts[i] + num_samples[i]):
                tok, lp = chosen_list[s], chosen_lp_list[s]
                top = None
                if k is not None:
                    top = {}
                    if k:
                        w = where_top[i]
                        top = dict(zip(top_ids[w][:k], top_lps[w][:k], strict=True))
                    top.setdefault(tok, lp)
                out.append(SampledToken(tok, lp, top))
            samples.append(out)
        return SamplerOutput(samples)

    @staticmethod
    def _penalize(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Penalties, biases and masks; returns `raw` itself when no row needs any."""
        num_rows, vocab = raw.shape
        device = raw.device
        pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
        biased = [i for i, r in enumerate(rows) if r.params.has_token_mask]
        constrained = any(r.grammar is not None for r in rows)
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        for i, r in enumerate(rows):
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = {*r.eos_token_ids, *r.params.stop_token_ids}
                cols = [t for t in banned if 0 <= t < vocab]
                mask_rows += [i] * len(cols)
                mask_cols += cols
        if not pen and not mask_rows and not biased and not constrained:
            return raw
        logits = raw.clone()
        if pen:
            _apply_penalties(logits, [rows[i] for i in pen], pen)
            # an extreme penalty (e.g. repetition_penalty=1e-300) must not make inf and then NaN
            # probabilities; this bound survives division by the smallest temperature in float32
            logits.clamp_(min=-_LOGIT_BOUND, max=_LOGIT_BOUND)
        for i in biased:
            _apply_bias(logits[i], rows[i].params)
        if mask_rows:
            logits[torch.tensor(mask_rows, device=device),
                   torch.tensor(mask_cols, device=device)] = _NEG_INF
        if constrained:
            apply_grammar_masks(logits, [r.grammar for r in rows], rows[0].eos_token_ids)
        return logits


_LOGIT_BOUND = 1e30


def _apply_bias(row: torch.Tensor, params: SamplingParams) -> None:
    """logit_bias (added, as OpenAI) and allowed_token_ids (all others -inf), in place; row [V]."""
    vocab = row.shape[0]
    if params.allowed_token_ids is not None:
        keep = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long,
                            device=row.device)
        kept = row[keep].clone()
        row.fill_(_NEG_INF)
        row[keep] = kept
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab]
        row[torch.tensor(ids, dtype=torch.long, device=row.device)] += torch.tensor(
            [params.logit_bias[t] for t in ids], dtype=row.dtype, device=row.device)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], row_ids: list[int]) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties, in place.

    Sparse: only (row, token) pairs that occur are touched, so the cost grows with the tokens
    seen, not with rows x vocab (dense [R, V] count tensors cost ~10x more on CPU).
    """
    vocab = logits.shape[1]
    device = logits.device
    flat = logits.view(-1)  # [R * V]
    lens_p = [len(r.prompt_token_ids) for r in rows]
    lens_o = [len(r.output_token_ids) for r in rows]
    tokens = torch.tensor([t for r in rows for t in (*r.prompt_token_ids, *r.output_token_ids)],
                          dtype=torch.long, device=device)
    lens = torch.tensor([n for pair in zip(lens_p, lens_o, strict=True) for n in pair],
                        device=device)
    base = torch.tensor([i * vocab for i in row_ids for _ in (0, 1)], device=device)
    from_output = torch.tensor([0.0, 1.0] * len(rows), device=device)
    keys = tokens + base.repeat_interleave(lens)  # flat index of each occurrence
    uniq, inverse = torch.unique(keys, return_inverse=True)  # [U]
    out_count = torch.zeros(len(uniq), device=device).scatter_add_(
        0, inverse, from_output.repeat_interleave(lens))  # [U] times seen in the output
    which = torch.searchsorted(torch.tensor(row_ids, device=device) * vocab, uniq, right=True) - 1
    params = [r.params for r in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[which]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[which]
    pres = torch.tensor([p.presence_penalty for p in params], device=device)[which]
    vals = flat[uniq]
    # HF/vLLM: a seen token's logit is divided by the penalty if positive, else multiplied
    vals = torch.where(vals > 0, vals / rep, vals * rep)
    vals = vals - freq * out_count - pres * (out_count > 0).float()
    flat[uniq] = vals


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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

    filtered = [i for i, p in enumerate(params) if _has_filter(p, vocab)]
    plain = [i for i, p in enumerate(params) if not _has_filter(p, vocab)]
    if plain:
        sub = _rows(probs, plain)
        pos, rep = _expand(plain, starts, num_samples, device)
        if len(pos) != len(plain):  # a row drawing several samples
            sub = sub.repeat_interleave(rep, dim=0)  # [S_plain, V]
        out[pos] = _inverse_cdf(sub, u[pos])
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
        cand_probs, cand_ids = _rows(probs, todo).topk(k, dim=-1)  # [T, k] sorted descending
        kept, resolved = _apply_filters(cand_probs, sub_params, vocab,
                                        row_mass[torch.tensor(todo, device=device)])
        done = [j for j, ok in enumerate(resolved.tolist()) if ok]
        if done:
            sel = torch.tensor(done, device=device)
            pos, rep = _expand([todo[j] for j in done], starts, num_samples, device)
            # float64: a prefix sum over few candidates is cheap and then exact enough to make the
            # choice independent of how many candidates were taken
            choice = _inverse_cdf(kept[sel].double().repeat_interleave(rep, dim=0), u[pos])
            out[pos] = cand_ids[sel].repeat_interleave(rep, dim=0).gather(
                1, choice[:, None]).squeeze(1)
        todo = [todo[j] for j, ok in enumerate(resolved.tolist()) if not ok]
    return out


def _fused_argmax_lse(
    raw: torch.Tensor, ops: ModuleType | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(argmax [R], logsumexp [R]) of float32 rows from the fused C++ kernel `ops`, or None where
    it does not serve them (another device, no build). Measured on 64 x 49152 logits here:
    10 ms, against 41 ms for argmax + log_softmax + gather; the greedy step's sampler was 3-4% of
    a decode step at batch 8-16 (benchmarks/step_profile.py)."""
    if raw.stride(-1) != 1 or ops is None:
        return None
    return ops.argmax_lse(raw)


def _rows(x: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
    """x[row_ids] without a copy when that is all of x; index_select beats fancy indexing on CPU."""
    if len(row_ids) == x.shape[0] and row_ids == list(range(len(row_ids))):
        return x
    return x.index_select(0, torch.tensor(row_ids, device=x.device))


def _has_filter(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def _expand(row_ids: list[int], starts: list[int], num_samples: list[int], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat sample positions of these rows, and how many samples each row has."""
    pos = [starts[i] + j for i in row_ids for j in range(num_samples[i])]
    rep = [num_samples[i] for i in row_ids]
    return torch.tensor(pos, device=device), torch.tensor(rep, device=device)


def _apply_filters(cand: torch.Tensor, params: list[SamplingParams], vocab: int,
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


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
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


def token_logprobs(logits: torch.Tensor, target_ids: list[int], k: int
                   ) -> list[dict[int, float]]:
    """For each row i of logits [m, vocab]: {top-k ids and target_ids[i]: logprob}, raw
    distribution (log_softmax of the logits as given). Use for prompt logprobs of a chunk."""
    assert logits.shape[0] == len(target_ids)
    if not target_ids:
        return []
    logprobs = logits.float().log_softmax(dim=-1)  # [m, V]
    targets = torch.tensor(target_ids, device=logprobs.device)
    target_lp = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    result: list[dict[int, float]] = [{} for _ in target_ids]
    if k > 0:
        vals, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
        for d, row_ids, row_lps in zip(result, ids.tolist(), vals.tolist(), strict=True):
            d.update(zip(row_ids, row_lps, strict=True))
    for d, tok, lp in zip(result, target_ids, target_lp, strict=True):
        d.setdefault(tok, lp)
    return result



def processed_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row's token would be drawn from, as full float32 rows [R, V] that
    sum to 1: penalties, biases, min_tokens, grammar, temperature, top-k, top-p and min-p applied
    exactly as the sampler applies them. A greedy row is a point mass on its argmax.

    For speculative verification with a draft model (tessera/sampling/rejection_sampler.py), which
    needs p(x) and q(x) at the drafted token and the residual max(0, p - q) over the vocabulary.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    penalized = Sampler._penalize(logits.float(), rows)
    out = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if greedy:
        g = torch.tensor(greedy, device=device)
        out[g, _rows(penalized, greedy).argmax(dim=-1)] = 1.0
    randoms = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if not randoms:
        return out
    params = [rows[i].params for i in randoms]
    inv_temp = torch.tensor([1.0 / p.temperature for p in params], device=device)
    probs = (_rows(penalized, randoms) * inv_temp[:, None]).softmax(dim=-1)  # [Rr, V]
    plain = [j for j, p in enumerate(params) if not _has_filter(p, vocab)]
    if plain:
        out[torch.tensor([randoms[j] for j in plain], device=device)] = _rows(probs, plain)
    todo = [j for j, p in enumerate(params) if _has_filter(p, vocab)]
    row_mass = probs.sum(dim=-1)
    for k in (64, 1024, vocab):  # the sampler's widening: most rows resolve in 64 candidates
        if not todo:
            break
        k = min(k, vocab)
        cand_probs, cand_ids = _rows(probs, todo).topk(k, dim=-1)  # [T, k]
        kept, resolved = _apply_filters(cand_probs, [params[j] for j in todo], vocab,
                                        row_mass[torch.tensor(todo, device=device)])
        ok = resolved.tolist()
        for t, j in enumerate(todo):
            if ok[t]:
                out[randoms[j]].scatter_(0, cand_ids[t], kept[t])
        todo = [j for t, j in enumerate(todo) if not ok[t]]
    return out / out.sum(dim=-1, keepdim=True)


def sampled_token(raw_logprobs: torch.Tensor, token_id: int, params: SamplingParams
                  ) -> SampledToken:
    """`token_id` with its logprob (and the params.logprobs top alternatives) under one row of the
    raw distribution, raw_logprobs [V] = log_softmax of the model's logits: what `Sampler` reports
    for a token it drew, for a token chosen elsewhere (draft-model verification)."""
    lp = float(raw_logprobs[token_id])
    top = None
    if params.logprobs is not None:
        top = {}
        if params.logprobs:
            vals, ids = raw_logprobs.topk(min(params.logprobs, raw_logprobs.shape[0]))
            top = dict(zip(ids.tolist(), vals.tolist(), strict=True))
        top.setdefault(token_id, lp)
    return SampledToken(token_id, lp, top)
