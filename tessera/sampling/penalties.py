"""The logit edits a sampled row may ask for, applied before the token is chosen: repetition,
frequency and presence penalties, logit_bias and allowed_token_ids, min_tokens (EOS and stop ids
masked) and structured-output grammars. Shared by the sampler (sampler.py) and the exact
distributions of speculative verification (`processed_probs`)."""

from __future__ import annotations

import torch

from tessera.sampling.grammar import apply_grammar_masks
from tessera.sampling.params import SamplingParams
from tessera.sampling.rows import SamplingRow

_NEG_INF = float("-inf")
_LOGIT_BOUND = 1e30


def penalize(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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
