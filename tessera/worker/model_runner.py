"""Runs one step: applies a `SchedulerOutput` to the persistent batch, moves cache blocks, runs ONE
forward pass over every scheduled token (prefill chunks and decodes mixed, no padding to the
longest prompt), samples, and answers with a torch-free `ModelRunnerOutput`.

Order inside the flat batch: decodes first, then prompt chunks (the attention backend's contract,
tessera/attention/backend.py). Logits are computed only at sampled positions: the
last token of a request whose KV reaches its full length this step. An embedding request
(`pooling_params`) samples nothing: its chunks' final hidden states are pooled
(tessera/worker/pooler.py) and the step that completes its prompt returns the vector. All
request state the runner reads (tokens, block tables, seeded generators, pooling states) is its
own copy, in `self.requests`.

Speculative decoding: a request verifying k draft tokens (`scheduled_spec_decode_tokens`) runs its
last token and the k drafts as k + 1 new tokens of the same flat batch (to attention, a chunk that
continues a cached context), with logits at all k + 1 positions; the sampler draws at each, and
the request keeps the drafts the draws confirm plus one (tessera/sampling/rejection_sampler.py).
Draft-model drafts of requests that sample are verified instead by the general rejection rule
against the draft's own distribution (tessera/worker/spec_decode/verify.py). A constrained
request's rows are masked
by its grammar walked through the drafts (`DraftWalk`, rolled back after sampling).
LoRA (--enable-lora): the decodes, and the prompt chunks, are ordered by adapter, so each
adapter's rows are contiguous; the `LoRAManager` turns the rows' adapters into the step's
`LoRAMapping`, which travels to the model in the attention metadata.
After sampling, the proposer (tessera/worker/spec_decode/) drafts the next step's tokens of every
request that sampled one token, unless the running batch holds `disable_by_batch_size` requests
or more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tessera.attention import SeqSpan, is_decode, select_attention_backend
from tessera.config import LoRAConfig, SpeculativeConfig
from tessera.core.kv_cache_groups import layer_slots
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sampling.grammar import DraftWalk, GrammarBackend
from tessera.sampling.rejection_sampler import num_accepted, rewind_generator
from tessera.sampling.sampler import Sampler, SamplingRow, token_logprobs
from tessera.worker.cache_engine import CacheEngine
from tessera.worker.input_batch import CachedRequestState, InputBatch
from tessera.worker.lora_manager import LoRAManager
from tessera.worker.spec_decode import DraftModelProposer, DraftRequest, NgramProposer
from tessera.worker.spec_decode.draft_length import DraftLength
from tessera.worker.spec_decode.verify import verify_general

__all__ = ["ModelInput", "ModelRunner", "ModelRunnerOutput"]


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: object  # the attention backend's own metadata (see tessera/attention)
    logits_indices: torch.Tensor  # [num_sampled] flat positions whose logits are needed
    sampled_req_ids: list[str] = field(default_factory=list)  # one per sampling request
    # req_id -> draft tokens it verifies; its logits rows are k + 1 consecutive ones
    spec_drafts: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> (flat index of the first row, target token ids): rows whose logits score the
    # next prompt token, for requests that asked for prompt logprobs
    prompt_rows: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # embedding requests: (req_id, flat index of the chunk's first row, its first position)
    pool_rows: list[tuple[str, int, int]] = field(default_factory=list)


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
        attention_backend: str | None = None,
        speculative_config: SpeculativeConfig | None = None,
        grammar_backend: GrammarBackend | None = None,
        draft_proposer: DraftModelProposer | None = None,
        is_driver: bool = True,
        kv_connector=None,
        lora_config: LoRAConfig | None = None,
    ):
        self.model = model
        # --enable-lora: the adapters' caches; wraps the model's projections once
        self.lora_manager = None if lora_config is None else LoRAManager(model, lora_config)
        # False on tensor-parallel ranks > 0: they run the forward pass and the logits
        # collectives, and leave sampling (and structured outputs) to rank 0
        self.is_driver = is_driver
        # the KV connector's worker half (tessera/distributed/kv_transfer/), None when off
        self.kv_connector = kv_connector
        self.speculative_config = speculative_config
        self.proposer: NgramProposer | None = None
        self.draft_proposer = draft_proposer
        if speculative_config is not None and speculative_config.method == "ngram":
            self.proposer = NgramProposer(
                speculative_config.num_speculative_tokens, speculative_config.prompt_lookup_max,
                speculative_config.prompt_lookup_min,
            )
        elif speculative_config is not None and draft_proposer is None:
            raise ValueError("speculative_config: method draft_model needs its draft model "
                             "(tessera.engine.loading builds it from model)")
        # per-request draft length from its recent acceptance (False: always the configured k)
        self.adaptive_num_drafts = True
        self.draft_length = DraftLength(
            speculative_config.num_speculative_tokens if speculative_config is not None else 0)
        self.proposer_seconds = 0.0  # time spent proposing, summed (benchmarks report it)
        self.num_propose_calls = 0
        self.eos_token_ids = eos_token_ids
        self.cache_engine = cache_engine
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # the draft model's own pool (a window): its ids follow the target's, in the tables
        self._draft_base = None if draft_proposer is None else draft_proposer.own_pool_base
        self.requests = InputBatch(
            device, grammar_backend, needs_grammars=is_driver,
            draft_table=None if self._draft_base is None else (
                cache_engine.spec.num_groups + 1, self._draft_base),
        )
        # chosen once (the C++ kernel is built, or loaded from its cache, here at start-up)
        self.attn_backend = select_attention_backend(
            device, cache_engine.spec.dtype, block_size, name=attention_backend
        )
        # KV cache groups (a hybrid model): block tables arrive interleaved, one per group
        self.num_kv_cache_groups = cache_engine.spec.num_groups
        self._layer_groups = [g for g, _ in layer_slots(cache_engine.spec.groups)]

    # ---- input preparation -------------------------------------------------------------------
    def prepare_input(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the step from the persistent batch; attention metadata is built once (not
        per layer) by the backend."""
        bs = self.block_size
        requests = self.requests.requests
        decodes: list[tuple[CachedRequestState, int]] = []
        prefills: list[tuple[CachedRequestState, int]] = []
        for req_id, n in out.num_scheduled_tokens.items():
            state = requests[req_id]
            (decodes if is_decode(n, state.num_computed_tokens) else prefills).append((state, n))
        if self.lora_manager is not None:  # each adapter's rows contiguous (stable: FCFS kept)
            decodes.sort(key=lambda item: item[0].lora_int_id)
            prefills.sort(key=lambda item: item[0].lora_int_id)

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampled: list[str] = []
        spans: list[SeqSpan] = []
        prompt_rows: dict[str, tuple[int, list[int]]] = {}
        spec = out.scheduled_spec_decode_tokens
        spec_drafts: dict[str, list[int]] = {}
        pool_rows: list[tuple[str, int, int]] = []
        one_group = self.num_kv_cache_groups == 1  # else the slots are per group (below)
        for state, n in decodes + prefills:
            start = state.num_computed_tokens
            end = start + n
            offset = len(input_ids)
            drafts = spec.get(state.req_id) if spec else None
            if drafts:  # its last token, then the drafts; logits at every one of them
                input_ids.extend(state.token_ids_range(start, state.num_tokens))
                input_ids.extend(drafts)
                positions.extend(range(start, end))
                if one_group:
                    slot_mapping.extend(_slots(state.block_ids, bs, start, end))
                spans.append(SeqSpan(offset, n, start, state.block_ids))
                logits_indices.extend(range(offset, offset + n))
                sampled.append(state.req_id)
                spec_drafts[state.req_id] = drafts
                continue
            input_ids.extend(state.token_ids_range(start, end))
            positions.extend(range(start, end))
            if one_group:
                slot_mapping.extend(_slots(state.block_ids, bs, start, end))
            spans.append(SeqSpan(offset, n, start, state.block_ids))
            if state.pooling is not None:  # an embedding request: pooled, never sampled
                pool_rows.append((state.req_id, offset, start))
                continue
            if state.sampling_params.prompt_logprobs is not None:
                targets = state.prompt_token_ids[start + 1 : end + 1]
                if targets:
                    prompt_rows[state.req_id] = (offset, targets)
            if end == state.num_tokens:  # brings its KV to the full length: sample
                logits_indices.append(offset + n - 1)
                sampled.append(state.req_id)

        dev = self.device
        if one_group:
            slots = torch.tensor(slot_mapping, dtype=torch.long, device=dev)
            meta = self.attn_backend.build_metadata(spans, slots, positions)
        else:
            meta = self._group_metadata(spans, positions)
        if self.lora_manager is not None:
            meta.lora_mapping = self._lora_mapping(decodes + prefills)
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn_metadata=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampled_req_ids=sampled,
            prompt_rows=prompt_rows,
            spec_drafts=spec_drafts,
            pool_rows=pool_rows,
        )

    def _group_metadata(self, spans: list[SeqSpan], positions: list[int]):
        """KV cache groups: one metadata per group, from that group's entries of each interleaved
        table (its own blocks and slots); the layers of a group attend with its metadata
        (`AttentionMetadata.for_layer`)."""
        bs, ng = self.block_size, self.num_kv_cache_groups
        metas = []
        for g in range(ng):
            group_spans = []
            slot_mapping: list[int] = []
            for s in spans:
                table = s.block_table[g::ng]
                group_spans.append(SeqSpan(s.query_start, s.num_new_tokens, s.num_computed_tokens,
                                           table))
                slot_mapping.extend(_slots(table, bs, s.num_computed_tokens, s.num_tokens))
            slots = torch.tensor(slot_mapping, dtype=torch.long, device=self.device)
            metas.append(self.attn_backend.build_metadata(group_spans, slots, positions))
        meta = metas[0]
        meta.layer_metadata = [metas[g] for g in self._layer_groups]
        return meta

    def _lora_mapping(self, scheduled: list[tuple[CachedRequestState, int]]):
        """Each request's adapter and rows, in flat-batch order, as the model's segments."""
        assert self.lora_manager is not None
        runs: list[tuple[int, int]] = []
        requests = {}
        for state, n in scheduled:
            lid = state.lora_int_id
            runs.append((lid, n))
            if lid:
                requests[lid] = state.lora_request
        return self.lora_manager.mapping(runs, requests)

    # ---- execution ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Update the persistent batch, move blocks (swap out, swap in, copy-on-write), then one
        forward pass and sampling."""
        self.requests.update(out)
        self.draft_length.forget(out.finished_req_ids)
        if self.kv_connector is not None:  # before the cache ops: a cancelled block may be reused
            self.kv_connector.bind_connector_metadata(out.kv_connector_metadata)
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        copies = out.blocks_to_copy
        if self._draft_base is not None and copies:  # the draft's copies are its own
            copies = [(src, dst) for src, dst in copies if src < self._draft_base]
        self.cache_engine.copy(copies)
        if self.draft_proposer is not None:
            self.draft_proposer.apply_cache_ops(out)
        if not out.num_scheduled_tokens:
            return self._kv_finished(ModelRunnerOutput())
        inp = self.prepare_input(out)
        hidden = self.model.forward(
            inp.input_ids, inp.positions, self.cache_engine.kv_caches, inp.attn_metadata
        )
        if not self.is_driver:
            self._follow_logits(inp, hidden)
            return ModelRunnerOutput()
        result = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(inp, hidden))
        if inp.pool_rows:
            self._pool(inp, hidden, out.num_scheduled_tokens, result)
        if inp.sampled_req_ids:
            self._sample(inp, hidden, out.num_samples, result)
            if self.speculative_config is not None:
                self._propose(out.speculation_batch_size, out.num_samples, result)
        return self._kv_finished(result)

    def _kv_finished(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        """Add the KV connector's transfers that ended (after a forward pass that succeeded: a
        step that raises leaves them for the next)."""
        if self.kv_connector is not None:
            (result.finished_sending, result.finished_recving, result.failed_recving,
             result.kv_transfer_stats) = self.kv_connector.get_finished()
        return result

    def _follow_logits(self, inp: ModelInput, hidden: torch.Tensor) -> None:
        """A tensor-parallel rank > 0: the same `compute_logits` collectives, in the same order,
        as rank 0's `_prompt_logprobs` and `_sample` (the gathered logits land on rank 0)."""
        for first, targets in inp.prompt_rows.values():
            self.model.compute_logits(hidden[first : first + len(targets)])
        if inp.sampled_req_ids:
            self.model.compute_logits(hidden.index_select(0, inp.logits_indices))

    def _pool(self, inp: ModelInput, hidden: torch.Tensor, num_scheduled: dict[str, int],
              result: ModelRunnerOutput) -> None:
        """Fold each embedding request's chunk into its pooling state; a request whose prompt
        this step completes gets its vector in `pooler_output`."""
        for req_id, first, start in inp.pool_rows:
            state = self.requests[req_id]
            assert state.pooling is not None
            rows = hidden[first : first + num_scheduled[req_id]]  # [n, hidden_size]
            vector = state.pooling.add(rows, start, len(state.prompt_token_ids))
            if vector is not None:
                result.pooler_output[req_id] = vector

    def _prompt_logprobs(self, inp: ModelInput, hidden: torch.Tensor) -> dict:
        result = {}
        for req_id, (first, targets) in inp.prompt_rows.items():
            state = self.requests[req_id]
            logits = self.model.compute_logits(hidden[first : first + len(targets)])
            k = state.sampling_params.prompt_logprobs
            result[req_id] = (state.num_computed_tokens + 1, token_logprobs(logits, targets, k))
        return result

    def _sample(
        self, inp: ModelInput, hidden: torch.Tensor, num_samples: dict[str, int],
        result: ModelRunnerOutput,
    ) -> None:
        logits = self.model.compute_logits(hidden.index_select(0, inp.logits_indices))
        rows = []
        spec = inp.spec_drafts
        rewinds: list[tuple[torch.Generator, torch.Tensor]] = []
        # draft-model drafts of sampling requests: general rejection rule, not the sampler's draws
        general: dict[str, tuple[int, int]] = {}  # req_id -> its rows [start, end)
        walks: list[DraftWalk] = []  # constrained requests' grammars, walked through their drafts
        for req_id in inp.sampled_req_ids:
            state = self.requests[req_id]
            drafts = spec.get(req_id) if spec else None
            # a verifying request: one row per position, each seeing the drafts before it as output
            contexts = (
                [state.output_token_ids + drafts[:j] for j in range(len(drafts) + 1)]
                if drafts else [state.output_token_ids]
            )
            if drafts and self.draft_proposer is not None and not state.sampling_params.is_greedy:
                general[req_id] = (len(rows), len(rows) + len(contexts))
            elif drafts and state.generator is not None and not state.sampling_params.is_greedy:
                rewinds.append((state.generator, state.generator.get_state()))
            grammars = [state.grammar] * len(contexts)
            if drafts and state.grammar is not None:
                walks.append(DraftWalk(state.grammar, drafts))
                grammars = [walks[-1].row(j) for j in range(len(contexts))]
            for output_token_ids, grammar in zip(contexts, grammars, strict=True):
                rows.append(
                    SamplingRow(
                        params=state.sampling_params,
                        prompt_token_ids=state.prompt_token_ids,
                        output_token_ids=output_token_ids,
                        num_samples=num_samples.get(req_id, 1),
                        generator=state.generator,
                        eos_token_ids=self.eos_token_ids,
                        grammar=grammar,
                    )
                )
        try:
            samples, emitted = self._draw(logits, rows, general, spec)
        finally:  # the matchers follow accepted tokens only (the next step's diffs)
            for walk in walks:
                walk.restore()
        result.req_ids = inp.sampled_req_ids
        if not spec:
            result.sampled_token_ids = [[t.token_id for t in toks] for toks in samples]
            result.logprobs = [
                [t.top_logprobs or {t.token_id: t.logprob} for t in toks] for toks in samples
            ]
        else:
            self._verify(inp, samples, rewinds, emitted, result)

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], general: dict, spec: dict
              ) -> tuple[list, dict]:
        """The sampler's draws for every row but those of `general` requests, which the general
        rejection rule verifies (their emitted tokens, by req_id)."""
        if general:
            skip = [i for a, b in general.values() for i in range(a, b)]
            emitted = verify_general(
                self.draft_proposer, self.requests, general, logits, rows, spec
            )
            skipped = set(skip)
            keep = [i for i in range(len(rows)) if i not in skipped]
            drawn = self.sampler(logits[keep], [rows[i] for i in keep]).samples
            samples: list = [None] * len(rows)
            for i, toks in zip(keep, drawn, strict=True):
                samples[i] = toks
            return samples, emitted
        return self.sampler(logits, rows).samples, {}

    def _verify(self, inp: ModelInput, samples: list, rewinds: list, emitted: dict,
                result: ModelRunnerOutput) -> None:
        """Keep each verifying request's confirmed drafts plus the target's next token (one row
        per position in `samples`); other requests keep their one row; requests in `emitted`
        were verified by the general rule already."""
        spec = inp.spec_drafts
        row = 0
        rewind_at = {id(gen): (gen, state) for gen, state in rewinds}
        for req_id in inp.sampled_req_ids:
            state = self.requests[req_id]
            drafts = spec.get(req_id)
            if drafts is None:
                toks = samples[row]
                row += 1
            elif req_id in emitted:
                toks = emitted[req_id]
                row += len(drafts) + 1
                self.draft_length.update(req_id, len(drafts), len(toks) - 1)
            else:
                drawn = [samples[row + j][0] for j in range(len(drafts) + 1)]
                row += len(drafts) + 1
                a = num_accepted([t.token_id for t in drawn], drafts)
                toks = drawn[: a + 1]
                self.draft_length.update(req_id, len(drafts), a)
                gen = state.generator
                if gen is not None and id(gen) in rewind_at:
                    rewind_generator(gen, rewind_at[id(gen)][1], a + 1)
            result.sampled_token_ids.append([t.token_id for t in toks])
            result.logprobs.append([t.top_logprobs or {t.token_id: t.logprob} for t in toks])

    def _propose(
        self, num_reqs: int, num_samples: dict[str, int], result: ModelRunnerOutput
    ) -> None:
        """Drafts for the next step of every request that sampled one token this step (none while
        the running batch is at or above `disable_by_batch_size`: verifying there only costs)."""
        assert self.speculative_config is not None
        if not self.speculative_config.is_enabled_for(num_reqs):
            return
        t0 = time.perf_counter()
        proposals: list[list[int]] = [[] for _ in result.req_ids]
        todo: list[tuple[int, CachedRequestState, list[int]]] = []
        for i, (req_id, tokens) in enumerate(zip(result.req_ids, result.sampled_token_ids,
                                                 strict=True)):
            state = self.requests[req_id]
            # constrained requests speculate too: verification walks their grammar through the
            # drafts (DraftWalk); the proposers themselves ignore it
            if num_samples.get(req_id, 1) != 1 or not tokens:
                continue
            todo.append((i, state, tokens))
        if self.proposer is not None:
            propose = self.proposer.propose
            for i, state, tokens in todo:
                proposals[i] = propose(state.prompt_token_ids + state.output_token_ids + tokens)
        elif todo:
            assert self.draft_proposer is not None
            limit = self.draft_length.limit if self.adaptive_num_drafts else None
            drafted = self.draft_proposer.propose(
                [DraftRequest(state, tokens, self.eos_token_ids,
                              limit(state.req_id) if limit else None)
                 for _, state, tokens in todo])
            for (i, _, _), drafts in zip(todo, drafted, strict=True):
                proposals[i] = drafts
        if self.adaptive_num_drafts:
            limit = self.draft_length.limit
            proposals = [p[: limit(req_id)] if p else p
                         for req_id, p in zip(result.req_ids, proposals, strict=True)]
        result.spec_token_ids = proposals
        self.proposer_seconds += time.perf_counter() - t0
        self.num_propose_calls += 1
