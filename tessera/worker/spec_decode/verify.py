"""Verifying a draft model's drafts for requests that sample: the general rejection rule
(tessera/sampling/rejection_sampler.py) against the draft's own distribution q, with the target's
distribution processed exactly as the sampler would (penalties, grammar, temperature, top-k/p,
min-p). Greedy requests and n-gram drafts are point masses and take the sampler's path instead."""

from __future__ import annotations

import torch

from tessera.sampling.rejection_sampler import position_uniforms, rejection_sample
from tessera.sampling.sampler import SampledToken, SamplingRow, processed_probs, sampled_token
from tessera.worker.input_batch import InputBatch
from tessera.worker.spec_decode.draft_model import DraftModelProposer


def verify_general(proposer: DraftModelProposer | None, requests: InputBatch,
                   general: dict[str, tuple[int, int]], logits: torch.Tensor,
                   rows: list[SamplingRow], spec: dict[str, list[int]]
                   ) -> dict[str, list[SampledToken]]:
    """The tokens each request of `general` (req_id -> its logits rows [start, end)) emits: its
    accepted drafts and one more. Every request's rows are processed in one batch (small per-row
    torch calls cost milliseconds each on a busy CPU); logprobs come from the raw distribution,
    as the sampler reports them."""
    assert proposer is not None
    idx = [i for a, b in general.values() for i in range(a, b)]
    sel = logits[idx]
    p_all = processed_probs(sel, [rows[i] for i in idx])  # [sum(m + 1), V]
    raw_all = sel.float().log_softmax(dim=-1)
    emitted = {}
    offset = 0
    for req_id, (a, b) in general.items():
        drafts = spec[req_id]
        q = proposer.draft_probs_for(req_id, drafts)
        p = p_all[offset : offset + b - a]
        first = requests[req_id].num_tokens  # position of the first draft
        u = position_uniforms(proposer.seeds.get(req_id),
                              list(range(first, first + len(drafts) + 1)), p.device)
        n, last = rejection_sample(p, q.to(p.device), drafts, u)
        params = rows[a].params
        emitted[req_id] = [sampled_token(raw_all[offset + j], t, params)
                           for j, t in enumerate([*drafts[:n], last])]
        offset += b - a
    return emitted
