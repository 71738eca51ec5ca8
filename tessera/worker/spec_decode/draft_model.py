"""Draft-model proposer (vLLM's `draft_model` method, llama.cpp's "draft"): a small model with the
target's vocabulary guesses each decoding request's next k tokens, k forward passes batched over
the requests (one flat forward per step), before the target verifies them all in one pass.

Its KV cache is its own paged pool with the target's block ids: block b of the draft cache holds
the draft's K/V for the same token positions as block b of the target's, so the scheduler's
tables serve both, and swaps and copy-on-write copies are applied to both pools with the same
mappings (`apply_cache_ops`). No allocation of its own, nothing to leak.

With a sliding window the target releases blocks its window left, which the draft (attending to
the whole context) still reads; so the scheduler gives the draft a KV cache group of its own
(core/block_manager.py): a full table per request, `state.draft_block_ids`, in a pool of its own
(`own_pool_base`: where its ids start in the scheduler's numbering). Its blocks are never swapped
nor prefix-cached, so a request sent whole again always starts over from 0.

Which draft K/V is valid (`self.computed[req_id]`: positions below it):

    0 ........................ c ............ L-1 | L ..... L+k-2        positions
    [ draft KV valid           )[ catch-up: the    )[ drafts d_0..d_{k-2}  inputs of the
                                 accepted tokens,      as inputs            k - 1 later steps
                                 the new last one )

- step 0 runs the catch-up chunk (everything the target accepted since the draft last ran, the
  whole prompt for a new request) and drafts d_0 from its last row; steps 1..k-1 feed d_{j-1}.
- slots inside the request's block table are written in place: the target has written (or
  owns privately, as lookahead) every such block, and a shared block holds the same tokens for
  each sharer, so the same K/V; positions past the table go to scratch blocks past the
  scheduler's ids (`_scratch`), used for one call and forgotten.
- afterwards `computed` = min(L, table length): draft positions L.. are recomputed next time
  (rejected ones must be; accepted ones are cheap to redo in the catch-up chunk).
- a request sent whole again (preempted, or re-run by step recovery) starts over from 0 unless
  its blocks came back by swap-in, which moved the draft's K/V along with the target's.

Drafts: constrained requests draft within their grammar (walked through their drafts, rolled
back after). Greedy requests get the draft's argmax (verified by the point-mass rule); requests that
sample draw from the draft's processed distribution q (temperature, top-k/p, min-p, penalties as
for the target) and keep q for the general rejection rule (tessera/sampling/rejection_sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.attention import SeqSpan
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sampling.grammar import DraftWalk
from tessera.sampling.rejection_sampler import inverse_cdf, position_uniforms
from tessera.sampling.sampler import SamplingRow, processed_probs
from tessera.utils import cdiv
from tessera.worker.cache_engine import CacheEngine
from tessera.worker.input_batch import CachedRequestState


@dataclass
class DraftRequest:
    """One request to draft for: its runner state and the tokens it sampled this step."""

    state: CachedRequestState
    new_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    max_drafts: int | None = None  # fewer than k (tessera/worker/spec_decode/draft_length.py)


class DraftModelProposer:
    def __init__(self, model, cache_engine: CacheEngine, attn_backend, block_size: int,
                 num_speculative_tokens: int, max_model_len: int, device: torch.device,
                 own_pool_base: int | None = None):
        """`own_pool_base`: the draft has its own pool and table (a window; its block b is the
        scheduler's id own_pool_base + b); None: it follows the target's table."""
        self.model = model
        self.own_pool_base = own_pool_base
        self.cache = cache_engine
        self.num_blocks = cache_engine.num_gpu_blocks  # the scheduler's ids; scratch lies above
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = device
        self.computed: dict[str, int] = {}
        self.seeds: dict[str, int | None] = {}
        # req_id -> (drafts, q [len(drafts), V]) of its last proposal, for requests that sample
        self.draft_probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    # ---- following the scheduler ----------------------------------------------------------------
    def apply_cache_ops(self, out: SchedulerOutput) -> None:
        """Mirror the step's block moves on the draft pool, then forget what they invalidated."""
        base = self.own_pool_base
        if base is None:
            self.cache.swap_out(out.blocks_to_swap_out)
            self.cache.swap_in(out.blocks_to_swap_in)
            self.cache.copy(out.blocks_to_copy)
        else:  # its own pool: only its own copies (forked requests), nothing swapped
            self.cache.copy([(s - base, d - base) for s, d in out.blocks_to_copy if s >= base])
        for req_id in out.finished_req_ids:
            self.computed.pop(req_id, None)
            self.seeds.pop(req_id, None)
            self.draft_probs.pop(req_id, None)
        swapped_in = set(out.blocks_to_swap_in.values())
        bs = self.block_size
        for new in out.scheduled_new_reqs:
            self.seeds[new.req_id] = new.seed
            if base is not None:  # its blocks are fresh whenever it is sent whole
                self.computed[new.req_id] = 0
                continue
            valid = min(self.computed.get(new.req_id, 0), new.num_computed_tokens)
            blocks = new.block_ids[: cdiv(valid, bs)]
            # its K/V survived only if every block holding it was swapped back in this step
            self.computed[new.req_id] = valid if valid and swapped_in.issuperset(blocks) else 0

    # ---- proposing ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        """Up to k drafts for each request (fewer near max_model_len), k batched forwards."""
        bs = self.block_size
        num = [min(self.k if r.max_drafts is None else r.max_drafts,
                   self.max_model_len - (r.state.num_tokens + len(r.new_token_ids)) - 1)
               for r in reqs]
        live = [i for i, n in enumerate(num) if n > 0]
        drafts: list[list[int]] = [[] for _ in reqs]
        if not live:
            return drafts
        tables, contexts, starts = {}, {}, {}
        next_scratch = self.num_blocks
        for i in live:
            st = reqs[i].state
            ctx = st.prompt_token_ids + st.output_token_ids + reqs[i].new_token_ids
            last_input = len(ctx) - 1 + num[i] - 1  # position of d_{num-2}, the last input
            table = st.block_ids if self.own_pool_base is None else st.draft_block_ids
            extra = max(0, last_input // bs + 1 - len(table))
            tables[i] = table + list(range(next_scratch, next_scratch + extra))
            next_scratch += extra
            contexts[i] = ctx
            starts[i] = min(self.computed.get(st.req_id, 0), len(ctx) - 1)
        self._ensure_blocks(next_scratch)
        # step 0: the catch-up chunks, decodes (one new token after a cached context) first
        order = sorted(live, key=lambda i: len(contexts[i]) - starts[i] != 1 or starts[i] == 0)
        chunks = {i: (starts[i], len(contexts[i])) for i in order}
        probs_per_req: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        inputs = {i: contexts[i][s:e] for i, (s, e) in chunks.items()}
        uniforms = {i: position_uniforms(self.seeds.get(reqs[i].state.req_id),
                                         list(range(len(contexts[i]), len(contexts[i]) + num[i])),
                                         self.device)
                    for i in live if not reqs[i].state.sampling_params.is_greedy}
        # constrained requests draft within their grammar, walked through this step's tokens (the
        # matcher follows the scheduler's diffs: it has not seen them yet) and the drafts so far
        walked = {i: list(reqs[i].new_token_ids) for i in live if reqs[i].state.grammar is not None}
        walks = {i: DraftWalk(reqs[i].state.grammar, walked[i]) for i in walked}
        try:
            for j in range(max(num[i] for i in live)):
                if j > 0:
                    order = [i for i in order if num[i] > j]
                    chunks = {i: (len(contexts[i]) - 1 + j, len(contexts[i]) + j) for i in order}
                    inputs = {i: [drafts[i][-1]] for i in order}
                logits = self._forward(order, chunks, inputs, tables)  # [len(order), V]
                rows = [SamplingRow(
                    params=reqs[i].state.sampling_params,
                    prompt_token_ids=reqs[i].state.prompt_token_ids,
                    output_token_ids=contexts[i][len(reqs[i].state.prompt_token_ids):] + drafts[i],
                    eos_token_ids=reqs[i].eos_token_ids,
                    grammar=walks[i].row(len(walked[i])) if i in walks else None) for i in order]
                q = processed_probs(logits, rows)  # [len(order), V]
                argmax = q.argmax(dim=-1).tolist()
                for row, i in enumerate(order):
                    if i in uniforms:  # a sampling request draws d_j ~ q_j with its w
                        drafts[i].append(inverse_cdf(q[row], float(uniforms[i][j, 0])))
                        probs_per_req[i].append(q[row])
                    else:
                        drafts[i].append(argmax[row])
                    if i in walked:
                        walked[i].append(drafts[i][-1])
        finally:  # the matchers follow accepted tokens only
            for walk in walks.values():
                walk.restore()
        for i in live:
            st = reqs[i].state
            own = st.block_ids if self.own_pool_base is None else st.draft_block_ids
            self.computed[st.req_id] = min(len(contexts[i]), len(own) * bs)
            if i in uniforms:
                self.draft_probs[st.req_id] = (list(drafts[i]), torch.stack(probs_per_req[i]))
            else:
                self.draft_probs.pop(st.req_id, None)
        return drafts

    def draft_probs_for(self, req_id: str, drafts: list[int]) -> torch.Tensor:
        """q [len(drafts), V] of the drafts a request verifies (a prefix of its last proposal:
        the scheduler may have cut it short)."""
        proposed, q = self.draft_probs[req_id]
        assert proposed[: len(drafts)] == drafts, f"{req_id}: verifies drafts it was not proposed"
        return q[: len(drafts)]

    def _forward(self, order: list[int], chunks: dict[int, tuple[int, int]],
                 inputs: dict[int, list[int]], tables: dict[int, list[int]]) -> torch.Tensor:
        """One flat draft forward; logits at each request's last row."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        last_rows: list[int] = []
        for i in order:
            start, end = chunks[i]
            table = tables[i]
            spans.append(SeqSpan(len(input_ids), end - start, start, table))
            input_ids.extend(inputs[i])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            last_rows.append(len(input_ids) - 1)
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.cache.kv_caches, self.attn_backend.build_metadata(spans, slot_mapping, positions),
        )
        return self.model.compute_logits(
            hidden.index_select(0, torch.tensor(last_rows, dtype=torch.long, device=dev)))

    def _ensure_blocks(self, num_blocks: int) -> None:
        """Grow the device pool's scratch region (past the scheduler's ids) to `num_blocks`
        blocks in all; it only grows, to the most a step has needed (rounded up to 8 blocks)."""
        have = self.cache.gpu_cache.shape[2]
        if num_blocks <= have:
            return
        gpu = self.cache.gpu_cache
        more = torch.zeros(gpu.shape[:2] + (cdiv(num_blocks - have, 8) * 8,) + gpu.shape[3:],
                           dtype=gpu.dtype, device=gpu.device)
        self.cache.gpu_cache = torch.cat([gpu, more], dim=2)
