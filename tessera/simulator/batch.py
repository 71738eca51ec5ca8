"""The simulator's stand-in for the model runner: it reads a `SchedulerOutput` the way a real
runner does (keeping its own copy of each request from the messages alone), describes the step's
batch as a `BatchShape` for the cost model, and answers a `ModelRunnerOutput` with a synthetic
token wherever a real runner would sample.

The synthetic token is chosen so that no stop rule fires before the dataset's output length: every
simulated request has `ignore_eos` and `max_tokens` = its output length, and the token is no stop
token. So a request ends exactly where the dataset says (or at `max_model_len`, as on the server).

Speculative decoding plugs in here (tessera/simulator/spec_decode.py): with a
`SpeculativeConfig`, the runner drafts k synthetic tokens for every request that sampled one
(unless the running batch holds `disable_by_batch_size` requests or more), and when the scheduler
schedules
them (`scheduled_spec_decode_tokens`) an `AcceptanceModel` says how many a verification step
returns. A step with drafts and no acceptance model is an error rather than a silent guess.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from tessera.config import SpeculativeConfig
from tessera.core.context_sharing import BlockTables
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sequence import is_decode

SYNTHETIC_TOKEN_ID = 1  # appended for every sampled token; requests run with ignore_eos


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What a cost model may know about one step (all counts over the scheduled sequences).

    num_context_tokens: KV tokens attention reads (each sequence's context after this step);
    num_attention_pairs: (query, key) pairs attention scores, n * c + n * (n + 1) / 2 for n new
    tokens after c cached ones (c + 1 for a decode): attention FLOPs grow with it;
    swap_bytes: KV bytes moved between device and swap space before the step;
    num_shared_context_tokens: of num_context_tokens, those in KV blocks another sequence of the
    step reads too, beyond the first reader (a prefix-cache hit's blocks, a forked prompt's:
    tessera/core/context_sharing.py). One set of memory, read from the CPU's cache by the
    second reader: a shared prefix costs less than as many private tokens.
    """

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_context_tokens: int = 0
    num_seqs: int = 0
    swap_bytes: int = 0
    num_attention_pairs: int = 0
    num_shared_context_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_distinct_context_tokens(self) -> int:
        """The KV tokens of distinct blocks the step reads (shared blocks counted once)."""
        return self.num_context_tokens - self.num_shared_context_tokens


def batch_shape(reqs: Iterable[tuple[int, int]], swap_bytes: int = 0,
                num_shared_context_tokens: int = 0) -> BatchShape:
    """The shape of a step from each scheduled request's (new tokens, tokens computed before)
    and its shared context tokens: the simulated runner's and the real server's step log's
    (tessera/engine/step_log.py)."""
    prefill = decode = context = pairs = seqs = 0
    for n, c in reqs:
        seqs += 1
        context += c + n
        pairs += n * c + n * (n + 1) // 2
        if is_decode(n, c):
            decode += 1
        else:
            prefill += n
    if not 0 <= num_shared_context_tokens <= context:
        raise ValueError(f"num_shared_context_tokens ({num_shared_context_tokens}) must be "
                         f"between 0 and the step's context tokens ({context})")
    return BatchShape(prefill, decode, context, seqs, swap_bytes, pairs,
                      num_shared_context_tokens)


class AcceptanceModel(Protocol):
    """Seam for speculative decoding: tokens a verification step returns for `req_id` given its
    `num_draft_tokens` drafts (between 1 and num_draft_tokens + 1)."""

    def num_tokens_returned(self, req_id: str, num_draft_tokens: int) -> int: ...

    def proposes(self, req_id: str) -> bool:
        """Whether the proposer drafts for `req_id` after this step."""
        ...


class SyntheticRunner:
    """Plays the runner from the messages alone: request lengths and computed counters per req_id,
    no tensors. `block_bytes` turns swapped blocks into bytes; `block_tables` (None: no sharing
    counted) follows the block tables to count each step's shared context tokens."""

    def __init__(self, block_bytes: int, acceptance: AcceptanceModel | None = None,
                 speculative: SpeculativeConfig | None = None,
                 block_tables: BlockTables | None = None) -> None:
        if speculative is not None and acceptance is None:
            raise ValueError("--speculative-config needs an acceptance model "
                             "(--spec-acceptance-rate)")
        self.block_bytes = block_bytes
        self.acceptance = acceptance
        self.speculative = speculative
        self.block_tables = block_tables
        self._num_tokens: dict[str, int] = {}  # req_id -> prompt + output length the runner knows

    def execute(self, out: SchedulerOutput) -> tuple[BatchShape, ModelRunnerOutput]:
        num_tokens = self._num_tokens
        for req_id in out.finished_req_ids:
            num_tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        for diff in out.scheduled_cached_reqs:
            num_tokens[diff.req_id] += len(diff.new_token_ids)
        computed = out.num_computed_tokens_by_req()
        spec = out.scheduled_spec_decode_tokens
        if spec and self.acceptance is None:
            raise ValueError("the scheduler scheduled draft tokens, but the simulator has no "
                             "acceptance model for speculative decoding")
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, n in out.num_scheduled_tokens.items():
            if computed[req_id] + n >= num_tokens[req_id]:  # reaches its full length: it samples
                k = out.num_samples.get(req_id, 1)
                if spec and req_id in spec:
                    assert self.acceptance is not None
                    k = self.acceptance.num_tokens_returned(req_id, len(spec[req_id]))
                req_ids.append(req_id)
                sampled.append([SYNTHETIC_TOKEN_ID] * k)
        num_swapped = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        shared = 0
        if self.block_tables is not None:
            self.block_tables.update(out)
            shared = self.block_tables.num_shared_context_tokens(out)
        shape = batch_shape([(n, computed[r]) for r, n in out.num_scheduled_tokens.items()],
                            num_swapped * self.block_bytes, shared)
        result = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        sc = self.speculative
        if sc is not None and sc.is_enabled_for(out.speculation_batch_size):
            # the proposer's drafts for the next step, for requests that sampled one token
            drafts = [SYNTHETIC_TOKEN_ID] * sc.num_speculative_tokens
            proposes = self.acceptance.proposes  # type: ignore[union-attr]
            result.spec_token_ids = [
                drafts if out.num_samples.get(r, 1) == 1 and proposes(r) else [] for r in req_ids]
        return shape, result
