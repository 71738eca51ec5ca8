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

from types import ModuleType

import torch

from tessera.kernels.fused import fused_ops_for
from tessera.sampling.params import SamplingParams
from tessera.sampling.penalties import penalize
from tessera.sampling.random_draws import apply_filters, has_filter, sample_random, select_rows
from tessera.sampling.rows import SampledToken, SamplerOutput, SamplingRow

__all__ = ["Sampler", "SampledToken", "SamplerOutput", "SamplingRow", "processed_probs",
           "sampled_token", "token_logprobs"]


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
        logits = penalize(raw, rows)

        # flat layout: row 0's samples, then row 1's, ...
        num_samples = [r.num_samples for r in rows]
        starts = [0] * num_rows
        for i in range(1, num_rows):
            starts[i] = starts[i - 1] + num_samples[i - 1]
        total = starts[-1] + num_samples[-1]
        one_each = total == num_rows  # one sample a row (all but a step that forks n > 1)
        if one_each:
            row_of_sample = torch.arange(num_rows, device=device)
        else:
            row_of_sample = torch.repeat_interleave(
                torch.arange(num_rows, device=device), torch.tensor(num_samples, device=device))

        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        randoms = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        # raw argmax and logsumexp [R] in one kernel call (two reads of each row, nothing written)
        fused = _fused_argmax_lse(raw, self._fused_ops(device))
        if not randoms and fused is not None and logits is raw:  # the common greedy step
            chosen = fused[0] if one_each else fused[0][row_of_sample]  # [S]
        elif not randoms:  # fast path: no temperature, sort or noise
            chosen = logits.argmax(dim=-1)[row_of_sample]  # [S]
        else:
            chosen = torch.empty(total, dtype=torch.long, device=device)
            if greedy:
                g_pos = [starts[i] + j for i in greedy for j in range(num_samples[i])]
                g_rows = [i for i in greedy for _ in range(num_samples[i])]
                g_best = select_rows(logits, g_rows).argmax(dim=-1)
                chosen[torch.tensor(g_pos, device=device)] = g_best
            sub = select_rows(logits, randoms)
            r_pos = [starts[i] + j for i in randoms for j in range(num_samples[i])]
            drawn = sample_random(sub, [rows[i] for i in randoms])
            chosen[torch.tensor(r_pos, device=device)] = drawn

        # logprobs from the raw distribution: logit - logsumexp from the kernel; without it
        # log_softmax (faster than torch's logsumexp on CPU). Rows asking for top logprobs take
        # theirs (and the chosen one) from log_softmax, so the two always agree.
        want = [i for i, r in enumerate(rows) if r.params.logprobs]
        if fused is None:
            raw_lp = raw.log_softmax(dim=-1)  # [R, V]
            chosen_lp = raw_lp[row_of_sample, chosen]  # [S]
            want_lp = select_rows(raw_lp, want) if want else raw_lp
        else:
            lse = fused[1] if one_each else fused[1][row_of_sample]
            chosen_lp = raw[row_of_sample, chosen] - lse  # [S]
            want_lp = select_rows(raw, want).log_softmax(dim=-1) if want else raw
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
    penalized = penalize(logits.float(), rows)
    out = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if greedy:
        g = torch.tensor(greedy, device=device)
        out[g, select_rows(penalized, greedy).argmax(dim=-1)] = 1.0
    randoms = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if not randoms:
        return out
    params = [rows[i].params for i in randoms]
    inv_temp = torch.tensor([1.0 / p.temperature for p in params], device=device)
    probs = (select_rows(penalized, randoms) * inv_temp[:, None]).softmax(dim=-1)  # [Rr, V]
    plain = [j for j, p in enumerate(params) if not has_filter(p, vocab)]
    if plain:
        out[torch.tensor([randoms[j] for j in plain], device=device)] = select_rows(probs, plain)
    todo = [j for j, p in enumerate(params) if has_filter(p, vocab)]
    row_mass = probs.sum(dim=-1)
    for k in (64, 1024, vocab):  # the sampler's widening: most rows resolve in 64 candidates
        if not todo:
            break
        k = min(k, vocab)
        cand_probs, cand_ids = select_rows(probs, todo).topk(k, dim=-1)  # [T, k]
        kept, resolved = apply_filters(cand_probs, [params[j] for j in todo], vocab,
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
