"""Runs one step: applies a `SchedulerOutput` to the persistent batch, moves cache blocks, runs ONE
forward pass over every scheduled token (prefill chunks and decodes mixed, no padding to the
longest prompt), samples, and answers with a torch-free `ModelRunnerOutput`.

Order inside the flat batch: decodes first, then prompt chunks (the attention backend's contract,
tessera/attention/backend.py). Logits are computed only at sampled positions: the
last token of a request whose KV reaches its full length this step. All request state the runner
reads (tokens, block tables, seeded generators) is its own copy, in `self.requests`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.attention import SeqSpan, is_decode, select_attention_backend
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sampling.grammar import GrammarBackend
from tessera.sampling.sampler import Sampler, SamplingRow, token_logprobs
from tessera.worker.cache_engine import CacheEngine
from tessera.worker.input_batch import CachedRequestState, InputBatch

__all__ = ["ModelInput", "ModelRunner", "ModelRunnerOutput"]


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: object  # the attention backend's own metadata (see tessera/attention)
    logits_indices: torch.Tensor  # [num_sampled] flat positions whose logits are needed
    sampled_req_ids: list[str] = field(default_factory=list)  # one per logits row
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
        grammar_backend: GrammarBackend | None = None,
    ):
        self.model = model
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
        for state, n in decodes + prefills:
            start = state.num_computed_tokens
            end = start + n
            offset = len(input_ids)
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
        )

    # ---- execution ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Update the persistent batch, move blocks (swap out, swap in, copy-on-write), then one
        forward pass and sampling."""
        self.requests.update(out)
        self.cache_engine.swap_out(out.blocks_to_swap_out)
        self.cache_engine.swap_in(out.blocks_to_swap_in)
        self.cache_engine.copy(out.blocks_to_copy)
        if not out.num_scheduled_tokens:
            return ModelRunnerOutput()
        inp = self.prepare_input(out)
        hidden = self.model.forward(
            inp.input_ids, inp.positions, self.cache_engine.kv_caches, inp.attn_metadata
        )
        result = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(inp, hidden))
        if inp.sampled_req_ids:
            self._sample(inp, hidden, out.num_samples, result)
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
        for req_id in inp.sampled_req_ids:
            state = self.requests[req_id]
            rows.append(
                SamplingRow(
                    params=state.sampling_params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=state.output_token_ids,
                    num_samples=num_samples.get(req_id, 1),
                    generator=state.generator,
                    eos_token_ids=self.eos_token_ids,
                    grammar=state.grammar,
                )
            )
        sampled = self.sampler(logits, rows)
        result.req_ids = inp.sampled_req_ids
        result.sampled_token_ids = [[t.token_id for t in toks] for toks in sampled.samples]
        result.logprobs = [
            [t.top_logprobs or {t.token_id: t.logprob} for t in toks] for toks in sampled.samples
        ]
