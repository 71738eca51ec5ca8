"""Turns one `SchedulerOutput` into flat tensors, runs ONE forward pass over every scheduled token
(prefill chunks and decodes mixed, no padding to the longest prompt), and samples.

Order inside the flat batch: decodes first, then prompt chunks (the attention backend's contract,
tessera/attention/backend.py). Logits are computed only at sampled positions: the last token of a
sequence whose KV reaches its full length this step. The runner keeps no request state between
steps; per-sequence RNGs for seeded sampling are owned by the engine and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.attention import AttentionMetadata, SeqSpan, is_decode, select_attention_backend
from tessera.core.scheduler_output import ScheduledSequence, SchedulerOutput
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
        # chosen once, at start-up (the C++ kernel is built or loaded here, not in the first request)
        self.attn_backend = select_attention_backend(device, cache_engine.spec.dtype, block_size)

    # ---- input preparation -------------------------------------------------------------------
    def prepare_input(
        self, seqs: list[ScheduledSequence], want_prompt_logprobs: set[int] | None = None
    ) -> ModelInput:
        """Flatten the step; build all attention metadata once (not per layer)."""
        bs = self.block_size
        decodes = [s for s in seqs if is_decode(s.num_new_tokens, s.seq.num_computed_tokens)]
        prefills = [s for s in seqs if not is_decode(s.num_new_tokens, s.seq.num_computed_tokens)]
        ordered = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledSequence] = []
        spans: list[SeqSpan] = []
        prompt_rows: dict[int, tuple[int, list[int]]] = {}
        for i, s in enumerate(ordered):
            start = s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            offset = len(input_ids)
            input_ids.extend(s.seq.get_token_ids_range(start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(_slots(s.block_table, bs, start, end))
            spans.append(
                SeqSpan(
                    query_start=offset,
                    num_new_tokens=s.num_new_tokens,
                    num_computed_tokens=start,
                    block_table=s.block_table,
                )
            )
            if i >= len(decodes) and want_prompt_logprobs and s.seq.seq_id in want_prompt_logprobs:
                targets = s.seq.prompt_token_ids[start + 1 : end + 1]
                if targets:
                    prompt_rows[s.seq.seq_id] = (offset, targets)
            if s.do_sample:
                logits_indices.append(offset + s.num_new_tokens - 1)
                sampled.append(s)

        dev = self.device
        slots = torch.tensor(slot_mapping, dtype=torch.long, device=dev)
        meta = self.attn_backend.build_metadata(spans, slots, positions)
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn_metadata=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampled=sampled,
            prompt_rows=prompt_rows,
        )

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
