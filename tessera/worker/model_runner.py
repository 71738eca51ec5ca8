"""Turns one `SchedulerOutput` into flat tensors, runs ONE forward pass over every scheduled token
(prefill chunks and decodes mixed, no padding to the longest prompt), and samples.

Order inside the flat batch: decodes first (so decode attention is one padded SDPA over a contiguous
slice), then prompt chunks. Logits are computed only at sampled positions: the last token of a
sequence whose KV reaches its full length this step. The runner keeps no request state between
steps; per-sequence RNGs for seeded sampling are owned by the engine and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.core.scheduler_output import ScheduledSequence, SchedulerOutput
from tessera.kernels.paged_attention import paged_attention_available
from tessera.model.attention import AttentionMetadata, PrefillSpan
from tessera.sampling.sampler import SampledToken, Sampler, SamplingRow, token_logprobs
from tessera.worker.cache_engine import CacheEngine


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] flat positions whose logits are needed
    sampled: list[ScheduledSequence] = field(default_factory=list)  # one per logits row
    # seq_id -> (flat index of the first row, target token ids): rows whose logits score the
    # next prompt token, for requests that asked for prompt logprobs
    prompt_rows: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    # seq_id -> sampled tokens (num_samples of them: n when a prompt of an n>1 request completes)
    samples: dict[int, list[SampledToken]] = field(default_factory=dict)
    # seq_id -> (position of the first scored prompt token, {token: logprob} per position)
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)


def _slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class ModelRunner:
    def __init__(
        self,
        model,
        cache_engine: CacheEngine,
        block_size: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.cache_engine = cache_engine
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # built (or loaded from its cache) here, at start-up, rather than inside the first request;
        # when it serves this device/dtype, every token of a step attends through it
        self.use_paged_kernel = paged_attention_available(device, cache_engine.spec.dtype)

    # ---- input preparation -------------------------------------------------------------------
    def prepare_input(
        self, seqs: list[ScheduledSequence], want_prompt_logprobs: set[int] | None = None
    ) -> ModelInput:
        """Flatten the step; build all attention metadata once (not per layer)."""
        bs = self.block_size
        decodes = [s for s in seqs if s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0]
        prefills = [s for s in seqs if not (s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0)]
        ordered = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledSequence] = []
        spans: list[PrefillSpan] = []
        prompt_rows: dict[int, tuple[int, list[int]]] = {}
        for i, s in enumerate(ordered):
            start = s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            offset = len(input_ids)
            input_ids.extend(s.seq.get_token_ids_range(start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(_slots(s.block_table, bs, start, end))
            if i >= len(decodes):
                if not self.use_paged_kernel:
                    spans.append(self._prefill_span(s, offset, start, end))
                if want_prompt_logprobs and s.seq.seq_id in want_prompt_logprobs:
                    targets = s.seq.prompt_token_ids[start + 1 : end + 1]
                    if targets:
                        prompt_rows[s.seq.seq_id] = (offset, targets)
            if s.do_sample:
                logits_indices.append(offset + s.num_new_tokens - 1)
                sampled.append(s)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            num_decodes=len(decodes),
            prefills=spans,
        )
        if self.use_paged_kernel:
            meta.token_block_tables, meta.token_seq_lens = self._token_tables(ordered, positions)
        elif decodes:
            meta.decode_block_tables, meta.decode_mask = self._decode_tables(decodes)
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn_metadata=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampled=sampled,
            prompt_rows=prompt_rows,
        )

    def _token_tables(
        self, seqs: list[ScheduledSequence], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For the kernel: each token's sequence block table [num_tokens, max_blocks] (padded with
        block 0, never read) and how many tokens it attends to [num_tokens] (its position + 1)."""
        bs = self.block_size
        needed = [-(-(s.seq.num_computed_tokens + s.num_new_tokens) // bs) for s in seqs]
        max_blocks = max(needed)
        per_seq = [s.block_table[:n] + [0] * (max_blocks - n) for s, n in zip(seqs, needed, strict=True)]
        dev = self.device
        seq_tables = torch.tensor(per_seq, dtype=torch.long, device=dev)
        new_tokens = torch.tensor([s.num_new_tokens for s in seqs], device=dev)
        of_token = torch.repeat_interleave(torch.arange(len(seqs), device=dev), new_tokens)
        lens = torch.tensor(positions, dtype=torch.long, device=dev) + 1
        return seq_tables.index_select(0, of_token), lens

    def _decode_tables(self, decodes: list[ScheduledSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """For the gather + SDPA path: flattened block tables [B * max_blocks] (padded with block 0)
        covering each decode's whole context, and the padding mask [B, 1, 1, max_blocks * bs]."""
        bs = self.block_size
        lens = [s.seq.num_computed_tokens + 1 for s in decodes]
        max_blocks = -(-max(lens) // bs)
        tables = []
        for s, n in zip(decodes, lens, strict=True):
            used = s.block_table[: -(-n // bs)]
            tables.extend(used)
            tables.extend([0] * (max_blocks - len(used)))
        dev = self.device
        tables_t = torch.tensor(tables, dtype=torch.long, device=dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        mask = torch.arange(max_blocks * bs, device=dev).unsqueeze(0) < lens_t.unsqueeze(1)
        return tables_t, mask.view(len(decodes), 1, 1, -1)

    def _prefill_span(self, s: ScheduledSequence, offset: int, start: int, end: int) -> PrefillSpan:
        span = PrefillSpan(start=offset, end=offset + (end - start), num_context=start)
        if start > 0:  # continues a cached context: gather it (new tokens included) and mask
            dev = self.device
            blocks = s.block_table[: -(-end // self.block_size)]
            span.block_table = torch.tensor(blocks, dtype=torch.long, device=dev)
            q_pos = torch.arange(start, end, device=dev).unsqueeze(1)
            key_pos = torch.arange(len(blocks) * self.block_size, device=dev).unsqueeze(0)
            span.mask = key_pos <= q_pos  # [n, num_blocks * block_size]: causal, and < end
        return span

    # ---- execution ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, generators: dict[int, torch.Generator] | None = None
    ) -> ModelRunnerOutput:
        """Cache moves first (swap out, swap in, copy-on-write), then one forward pass and sampling."""
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        self.cache_engine.copy(out.blocks_to_copy)
        seqs = [s for g in out.scheduled_groups for s in g.seqs]
        if not seqs:
            return ModelRunnerOutput()
        group_of = {id(s): g.group for g in out.scheduled_groups for s in g.seqs}
        want_prompt_logprobs = {
            s.seq.seq_id for s in seqs if group_of[id(s)].sampling_params.prompt_logprobs is not None
        }
        inp = self.prepare_input(seqs, want_prompt_logprobs)
        hidden = self.model.forward(
            inp.input_ids, inp.positions, self.cache_engine.kv_caches, inp.attn_metadata
        )
        result = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(inp, hidden, seqs, group_of))
        if inp.sampled:
            result.samples = self._sample(inp, hidden, group_of, generators or {})
        return result

    def _prompt_logprobs(self, inp: ModelInput, hidden, seqs, group_of) -> dict:
        result = {}
        for s in seqs:
            if s.seq.seq_id in inp.prompt_rows:
                first, targets = inp.prompt_rows[s.seq.seq_id]
                logits = self.model.compute_logits(hidden[first : first + len(targets)])
                k = group_of[id(s)].sampling_params.prompt_logprobs
                result[s.seq.seq_id] = (s.seq.num_computed_tokens + 1, token_logprobs(logits, targets, k))
        return result

    def _sample(self, inp: ModelInput, hidden, group_of, generators) -> dict[int, list[SampledToken]]:
        logits = self.model.compute_logits(hidden.index_select(0, inp.logits_indices))
        rows = []
        for s in inp.sampled:
            group = group_of[id(s)]
            params = group.sampling_params
            fork_pending = len(group.seqs) < params.n and not s.seq.output_token_ids
            rows.append(
                SamplingRow(
                    params=params,
                    prompt_token_ids=s.seq.prompt_token_ids,
                    output_token_ids=s.seq.output_token_ids,
                    num_samples=params.n - len(group.seqs) + 1 if fork_pending else 1,
                    generator=generators.get(s.seq.seq_id),
                    eos_token_ids=self.eos_token_ids,
                )
            )
        result = self.sampler(logits, rows)
        return {s.seq.seq_id: toks for s, toks in zip(inp.sampled, result.samples, strict=True)}
