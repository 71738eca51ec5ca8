"""The runner's persistent batch: its own copy of every request it has been sent.

The scheduler sends a request whole once (`NewRequestData`) and then only diffs
(`CachedRequestData`); this is where they are applied. The runner reads token ids, block tables
and seeded generators from here and never from a scheduler object, so it could live in another
process. A request resent whole (resumed after preemption) keeps its generator: a seeded request
draws the same numbers however often it was preempted. A request with structured outputs has a
grammar matcher here, advanced by the tokens the scheduler accepted (the diffs), and rebuilt by
replaying its output when the request is resent whole. An embedding request has its pooling
state here (tessera/worker/pooler.py), which survives a swap but not a recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.core.scheduler_output import NewRequestData, SchedulerOutput
from tessera.lora.request import LoRARequest
from tessera.sampling.grammar import GrammarBackend, GrammarState
from tessera.sampling.params import SamplingParams
from tessera.utils import token_range
from tessera.worker.pooler import PoolingState


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None
    pooling: PoolingState | None = None  # an embedding request: what its chunks pooled so far
    lora_request: LoRARequest | None = None
    # the draft model's own table (speculative decoding with a window: the scheduler's draft
    # KV cache group, ids of the draft's pool); empty when the draft follows `block_ids`
    draft_block_ids: list[int] = field(default_factory=list)

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        return token_range(self.prompt_token_ids, self.output_token_ids, start, end)


class InputBatch:
    def __init__(self, device: torch.device, grammar_backend: GrammarBackend | None = None,
                 needs_grammars: bool = True,
                 draft_table: tuple[int, int] | None = None) -> None:
        """`draft_table`: (entries per logical block, first id of the draft's pool) when the
        scheduler's tables carry a draft KV cache group (the last of each logical block): its
        entries go to `draft_block_ids` (as ids of the draft's pool, from 0) and the rest,
        the target's groups, to `block_ids`."""
        self.device = device
        self.draft_table = draft_table
        self.grammar_backend = grammar_backend
        # False where nothing is sampled (tensor-parallel ranks > 0): no matchers to keep
        self.needs_grammars = needs_grammars
        self.requests: dict[str, CachedRequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self.requests[req_id]

    def update(self, out: SchedulerOutput) -> None:
        """Drop finished requests, add (or replace) new ones, apply the diffs of cached ones."""
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            generator = old.generator if old is not None else self._generator(new.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),  # the runner's own copies
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=generator,
                grammar=self._grammar(new.sampling_params, new.output_token_ids),
                pooling=self._pooling(new, old),
                lora_request=new.lora_request,
            )
            if self.draft_table is not None:
                state = self.requests[new.req_id]
                state.block_ids, state.draft_block_ids = self._split(new.block_ids)
        for diff in out.scheduled_cached_reqs:
            state = self.requests[diff.req_id]
            state.output_token_ids.extend(diff.new_token_ids)
            if state.grammar is not None:
                state.grammar.accept(diff.new_token_ids)
            if self.draft_table is not None:
                target, draft = self._split(diff.new_block_ids)
                if diff.replace_block_ids:
                    state.block_ids, state.draft_block_ids = target, draft
                else:
                    state.block_ids.extend(target)
                    state.draft_block_ids.extend(draft)
            elif diff.replace_block_ids:
                state.block_ids = list(diff.new_block_ids)
            else:
                state.block_ids.extend(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def _split(self, ids) -> tuple[list[int], list[int]]:
        """Interleaved entries (whole logical blocks) -> (target's entries, draft's ids)."""
        assert self.draft_table is not None
        stride, base = self.draft_table
        assert len(ids) % stride == 0, "tables grow by whole logical blocks"
        draft = stride - 1
        return ([b for i, b in enumerate(ids) if i % stride != draft],
                [b - base for b in ids[draft::stride]])

    @staticmethod
    def _pooling(new: NewRequestData, old: CachedRequestState | None) -> PoolingState | None:
        """An embedding request's pooling state: kept when it comes back from a swap (its KV and
        progress survive), fresh when it starts (or restarts, after a recompute) at 0."""
        if new.pooling_params is None:
            return None
        if old is not None and old.pooling is not None and new.num_computed_tokens > 0:
            return old.pooling
        return PoolingState(new.pooling_params)

    def _grammar(self, params: SamplingParams, output_token_ids: list[int]
                 ) -> GrammarState | None:
        if params.structured_outputs is None or not self.needs_grammars:
            return None
        assert self.grammar_backend is not None, "structured outputs need a grammar backend"
        return self.grammar_backend.matcher(params.structured_outputs, output_token_ids)

    def _generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)
