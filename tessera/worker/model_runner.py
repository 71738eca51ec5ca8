"""Runs one step: applies a `SchedulerOutput` to the persistent batch, moves cache blocks, runs ONE
forward pass over every scheduled token (prefill chunks and decodes mixed, no padding to the
longest prompt), samples, and answers with a torch-free `ModelRunnerOutput`.

Order inside the flat batch: decodes first, then prompt chunks (the attention backend's contract,
tessera/attention/backend.py). Logits are computed only at sampled positions: the
last token of a request whose KV reaches its full length this step. All request state the runner
reads (tokens, block tables, seeded generators) is its own copy, in `self.requests`.

Speculative decoding: a request verifying k draft tokens (`scheduled_spec_decode_tokens`) runs its
last token and the k drafts as k + 1 new tokens of the same flat batch (to attention, a chunk that
continues a cached context), with logits at all k + 1 positions; the sampler draws at each, and
the request keeps the drafts the draws confirm plus one (tessera/sampling/rejection_sampler.py).
After sampling, the proposer (tessera/worker/spec_decode/) drafts the next step's tokens of every
request that sampled one token, unless the step ran `disable_by_batch_size` requests or more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tessera.attention import SeqSpan, is_decode, select_attention_backend
from tessera.config import SpeculativeConfig
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sampling.grammar import GrammarBackend
from tessera.sampling.rejection_sampler import num_accepted, rewind_generator
from tessera.sampling.sampler import Sampler, SamplingRow, token_logprobs
from tessera.worker.cache_engine import CacheEngine
from tessera.worker.input_batch import CachedRequestState, InputBatch
from tessera.worker.spec_decode import NgramProposer

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
        kv_connector=None,
    ):
        self.model = model
        # the KV connector's worker half (tessera/distributed/kv_transfer/), None when off
        self.kv_connector = kv_connector
        self.speculative_config = speculative_config
        self.proposer: NgramProposer | None = None
        if speculative_config is not None:
            if speculative_config.method != "ngram":
                raise ValueError(
                    f"speculative_config: method {speculative_config.method!r} is not built yet "
                    "(only ngram is)"
                )
            self.proposer = NgramProposer(
                speculative_config.num_speculative_tokens, speculative_config.prompt_lookup_max,
                speculative_config.prompt_lookup_min,
            )
        self.proposer_seconds = 0.0  # time spent proposing, summed (benchmarks report it)
        self.num_propose_calls = 0
        self.eos_token_ids = eos_token_ids
        self.cache_engine = cache_engine
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.requests = InputBatch(device, grammar_backend)
        # chosen once (the C++ kernel is built, or loaded from its cache, here at start-up)
        self.attn_backend = select_attention_backend(
            device, cache_engine.spec.dtype, block_size, name=attention_backend
        )

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

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampled: list[str] = []
        spans: list[SeqSpan] = []
        prompt_rows: dict[str, tuple[int, list[int]]] = {}
        spec = out.scheduled_spec_decode_tokens
        spec_drafts: dict[str, list[int]] = {}
        for state, n in decodes + prefills:
            start = state.num_computed_tokens
            end = start + n
            offset = len(input_ids)
            drafts = spec.get(state.req_id) if spec else None
            if drafts:  # its last token, then the drafts; logits at every one of them
                input_ids.extend(state.token_ids_range(start, state.num_tokens))
                input_ids.extend(drafts)
                positions.extend(range(start, end))
                slot_mapping.extend(_slots(state.block_ids, bs, start, end))
                spans.append(SeqSpan(offset, n, start, state.block_ids))
                logits_indices.extend(range(offset, offset + n))
                sampled.append(state.req_id)
                spec_drafts[state.req_id] = drafts
                continue
            input_ids.extend(state.token_ids_range(start, end))
            positions.extend(range(start, end))
            slot_mapping.extend(_slots(state.block_ids, bs, start, end))
            spans.append(SeqSpan(offset, n, start, state.block_ids))
            if state.sampling_params.prompt_logprobs is not None:
                targets = state.prompt_token_ids[start + 1 : end + 1]
                if targets:
                    prompt_rows[state.req_id] = (offset, targets)
            if end == state.num_tokens:  # brings its KV to the full length: sample
                logits_indices.append(offset + n - 1)
                sampled.append(state.req_id)

        dev = self.device
        slots = torch.tensor(slot_mapping, dtype=torch.long, device=dev)
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn_metadata=self.attn_backend.build_metadata(spans, slots, positions),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            sampled_req_ids=sampled,
            prompt_rows=prompt_rows,
            spec_drafts=spec_drafts,
        )

    # ---- execution ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Update the persistent batch, move blocks (swap out, swap in, copy-on-write), then one
        forward pass and sampling."""
        self.requests.update(out)
        if self.kv_connector is not None:  # before the cache ops: a cancelled block may be reused
            self.kv_connector.bind_connector_metadata(out.kv_connector_metadata)
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        self.cache_engine.copy(out.blocks_to_copy)
        if not out.num_scheduled_tokens:
            return self._kv_finished(ModelRunnerOutput())
        inp = self.prepare_input(out)
        hidden = self.model.forward(
            inp.input_ids, inp.positions, self.cache_engine.kv_caches, inp.attn_metadata
        )
        result = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(inp, hidden))
        if inp.sampled_req_ids:
            self._sample(inp, hidden, out.num_samples, result)
            if self.proposer is not None:
                self._propose(len(out.num_scheduled_tokens), out.num_samples, result)
        return self._kv_finished(result)

    def _kv_finished(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        """Add the KV connector's transfers that ended (after a forward pass that succeeded: a
        step that raises leaves them for the next)."""
        if self.kv_connector is not None:
            (result.finished_sending, result.finished_recving, result.failed_recving,
             result.kv_transfer_stats) = self.kv_connector.get_finished()
        return result

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
        for req_id in inp.sampled_req_ids:
            state = self.requests[req_id]
            drafts = spec.get(req_id) if spec else None
            # a verifying request: one row per position, each seeing the drafts before it as output
            contexts = (
                [state.output_token_ids + drafts[:j] for j in range(len(drafts) + 1)]
                if drafts else [state.output_token_ids]
            )
            if drafts and state.generator is not None and not state.sampling_params.is_greedy:
                rewinds.append((state.generator, state.generator.get_state()))
            for output_token_ids in contexts:
                rows.append(
                    SamplingRow(
                        params=state.sampling_params,
                        prompt_token_ids=state.prompt_token_ids,
                        output_token_ids=output_token_ids,
                        num_samples=num_samples.get(req_id, 1),
                        generator=state.generator,
                        eos_token_ids=self.eos_token_ids,
                        grammar=state.grammar,  # never with drafts: see _propose
                    )
                )
        samples = self.sampler(logits, rows).samples
        result.req_ids = inp.sampled_req_ids
        if not spec:
            result.sampled_token_ids = [[t.token_id for t in toks] for toks in samples]
            result.logprobs = [
                [t.top_logprobs or {t.token_id: t.logprob} for t in toks] for toks in samples
            ]
        else:
            self._verify(inp, samples, rewinds, result)

    def _verify(self, inp: ModelInput, samples: list, rewinds: list, result: ModelRunnerOutput) -> None:
        """Keep each verifying request's confirmed drafts plus the target's next token (one row
        per position in `samples`); other requests keep their one row."""
        spec = inp.spec_drafts
        row = 0
        rewind_at = {id(gen): (gen, state) for gen, state in rewinds}
        for req_id in inp.sampled_req_ids:
            state = self.requests[req_id]
            drafts = spec.get(req_id)
            if drafts is None:
                toks = samples[row]
                row += 1
            else:
                drawn = [samples[row + j][0] for j in range(len(drafts) + 1)]
                row += len(drafts) + 1
                a = num_accepted([t.token_id for t in drawn], drafts)
                toks = drawn[: a + 1]
                gen = state.generator
                if gen is not None and id(gen) in rewind_at:
                    rewind_generator(gen, rewind_at[id(gen)][1], a + 1)
            result.sampled_token_ids.append([t.token_id for t in toks])
            result.logprobs.append([t.top_logprobs or {t.token_id: t.logprob} for t in toks])

    def _propose(self, num_reqs: int, num_samples: dict[str, int], result: ModelRunnerOutput) -> None:
        """Drafts for the next step of every request that sampled one token this step (none for a
        step at or above `disable_by_batch_size`: verifying there only costs)."""
        assert self.proposer is not None and self.speculative_config is not None
        if not self.speculative_config.is_enabled_for(num_reqs):
            return
        t0 = time.perf_counter()
        propose = self.proposer.propose
        proposals = []
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids, strict=True):
            state = self.requests[req_id]
            # a grammar would have to be advanced through each draft to mask the positions after
            # it (and rolled back on rejection); constrained requests decode one token a step
            if num_samples.get(req_id, 1) != 1 or state.grammar is not None:
                proposals.append([])
                continue
            proposals.append(propose(state.prompt_token_ids + state.output_token_ids + tokens))
        result.spec_token_ids = proposals
        self.proposer_seconds += time.perf_counter() - t0
        self.num_propose_calls += 1
