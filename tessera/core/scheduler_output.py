"""What the scheduler decides for one step: the message from `core/` to the model runner.

Plain, picklable data keyed by `req_id` (no tensors, no live scheduler objects), so that a runner in
another process (a tensor-parallel rank, a remote worker) can receive it. The runner keeps its own
copy of every request it has seen (its persistent batch) and updates it from these messages:

    scheduled_new_reqs     everything about a request the runner does not have yet (first
                           admission, a forked child, or a request resumed after preemption:
                           its state is then replaced, its seeded generator kept)
    scheduled_cached_reqs  diffs for requests the runner has: tokens appended since it last saw
                           them, new block ids (or a replaced table), the new num_computed_tokens
    finished_req_ids       requests whose state the runner can drop (finished, aborted)

A "request" here is one stream of tokens: a request with n > 1 becomes n streams after its prompt
is computed (the children's `req_id`s are "{k}_{request_id}"). Apply the cache operations in the
order swap-out, swap-in, copy, before the forward pass: a block freed by a swap-out may be the
destination of a swap-in or a copy in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.core.kv_connector import KVConnectorMetadata
from tessera.lora.request import LoRARequest
from tessera.pooling_params import PoolingParams
from tessera.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner does not hold (new, forked, or back from a preemption), whole. Its
    own data: tuples and a copy of the request's SamplingParams, never the scheduler's lists."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # non-empty for a forked child or a resumed request
    sampling_params: SamplingParams  # a copy (SamplingParams.clone)
    block_ids: tuple[int, ...]  # the whole device block table
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hits, swap-in)
    seed: int | None = None  # of this stream's generator (child k of a seeded request: seed + k)
    # set for an embedding request: the runner pools its prompt's hidden states, samples nothing
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs under (None: the base model)


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner holds: what changed since it last saw it. The lists are fresh
    slices or copies, never the scheduler's own (not frozen: built for every running request
    every step, where a frozen dataclass's slower construction shows)."""

    req_id: str
    new_token_ids: list[int]  # tokens appended since the runner last saw this request
    new_block_ids: list[int]  # appended to its block table ...
    replace_block_ids: bool  # ... or, when True, the whole new table (copy-on-write moved a block)
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step, for every scheduled request (new and cached)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # req_id -> draft tokens to verify this step (speculative decoding; empty without it)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # cache operations: {src: dst} device -> CPU and CPU -> device; (src, dst) device copies (CoW)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    # req_id -> tokens to sample if this step completes its prompt, where that is not 1: a
    # request with n > 1 before its fork (see SequenceGroup.is_fork_pending)
    num_samples: dict[str, int] = field(default_factory=dict)
    # what happened to whole requests this step (engine-facing bookkeeping, by request id)
    preempted_request_ids: list[str] = field(default_factory=list)
    ignored_request_ids: list[str] = field(default_factory=list)  # rejected: can never fit
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_prefix_cache_hit_tokens: int = 0
    # requests in the running queue once this step is scheduled (vLLM's running_queue_size): the
    # batch that speculative decoding's `disable_by_batch_size` compares against
    num_running_reqs: int = 0
    # the KV connector's instructions for its worker half (None without a connector, or when
    # there is nothing to move this step)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def speculation_batch_size(self) -> int:
        """The batch size `disable_by_batch_size` is checked against: the running queue, or this
        step's requests when more are scheduled (a message built without a scheduler). Counting
        only the step's requests let speculation run during a prefill ramp whose running batch was
        already large."""
        return max(self.num_running_reqs, len(self.num_scheduled_tokens))

    def num_computed_tokens_by_req(self) -> dict[str, int]:
        """Tokens each scheduled request had computed before this step (its KV context)."""
        computed = {new.req_id: new.num_computed_tokens for new in self.scheduled_new_reqs}
        computed.update((d.req_id, d.num_computed_tokens) for d in self.scheduled_cached_reqs)
        return computed

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted_request_ids)
