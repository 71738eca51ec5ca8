"""`SchedulerStats`: what the scheduler tells the rest of the engine about itself, from one method,
`Scheduler.stats()`. Metrics, the dashboard, the step log and the simulator read these plain,
frozen values instead of the scheduler's queues, block manager or counters.

The plain call reads counters only (a handful of lengths and totals: cheap enough for every
step). `stats(detail=True)` adds what a sample of the live view needs and walks the queues for it:
the block maps, a row per running or swapped request, the oldest waiting request and the adapters
in use. Call it per sample or per scrape, not per step. `collect_stats` and `collect_detail`
build them from the scheduler's queues and parts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tessera.core.block_manager import BlockManager
from tessera.core.remote_kv import RemoteKVTracker
from tessera.core.request_queue import RequestQueue
from tessera.core.step_update import StepUpdate
from tessera.sequence import SequenceGroup


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One running or swapped request: ids and counts only, nothing of its content."""

    request_id: str
    state: str  # "prefill" | "decode" | "swapped"
    lora_name: str | None
    num_prompt_tokens: int
    num_output_tokens: int  # the longest of its sequences
    num_computed_tokens: int  # of its first sequence
    max_num_tokens: int  # prompt + max_tokens, at most max_model_len
    num_seqs: int

    @classmethod
    def of(cls, group: SequenceGroup, swapped: bool, max_model_len: int) -> RequestStats:
        seq = group.seqs[0]
        num_prompt = len(seq.prompt_token_ids)
        max_tokens = group.sampling_params.max_tokens
        state = "swapped" if swapped else "decode" if seq.is_decoding() else "prefill"
        return cls(
            request_id=group.request_id,
            state=state,
            lora_name=None if group.lora_request is None else group.lora_request.lora_name,
            num_prompt_tokens=num_prompt,
            num_output_tokens=max(len(s.output_token_ids) for s in group.seqs),
            num_computed_tokens=seq.num_computed_tokens,
            max_num_tokens=(min(num_prompt + max_tokens, max_model_len) if max_tokens
                            else max_model_len),
            num_seqs=len(group.seqs),
        )


@dataclass(frozen=True, slots=True)
class SchedulerDetail:
    """The walks `stats(detail=True)` adds."""

    gpu_block_states: bytes  # one byte per device block: BlockPool.block_states()
    cpu_block_states: bytes
    oldest_waiting_arrival: float | None  # arrival time of the longest-waiting request
    oldest_swapped_arrival: float | None
    requests: tuple[RequestStats, ...]  # running (best first), then swapped; at most max_requests
    running_lora_adapters: tuple[str, ...]  # distinct, sorted; empty without --enable-lora
    waiting_lora_adapters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    # queues
    num_waiting: int
    num_running: int
    num_swapped: int
    num_waiting_for_remote_kvs: int
    # the KV pools
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    # counters since start
    num_preemptions_total: int
    num_prompt_tokens_total: int  # prompt tokens computed (chunks, recomputes; not cache hits)
    num_generation_tokens_total: int
    num_prefix_cache_queries_total: int  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits_total: int  # of which found there
    num_spec_drafts_total: int  # requests that verified drafts, summed over steps
    num_spec_draft_tokens_total: int
    num_spec_accepted_tokens_total: int
    num_spec_accepted_tokens_per_pos: tuple[int, ...]  # [i]: drafts accepted at position i
    kv_transfer: bool  # a KV connector is configured (disaggregated prefill/decode)
    num_kv_transfer_requests_total: int
    num_kv_transfer_bytes_total: int
    num_kv_transfer_failures_total: int
    detail: SchedulerDetail | None = None  # stats(detail=True) only

    @property
    def gpu_usage(self) -> float:
        """Fraction of device blocks in use (0..1)."""
        return _usage(self.num_free_gpu_blocks, self.num_gpu_blocks)

    @property
    def cpu_usage(self) -> float:
        """Fraction of CPU swap blocks in use (0..1)."""
        return _usage(self.num_free_cpu_blocks, self.num_cpu_blocks)


def _usage(num_free: int, num_blocks: int) -> float:
    return 1.0 - num_free / num_blocks if num_blocks else 0.0


def collect_stats(
    waiting: RequestQueue[SequenceGroup], running: list[SequenceGroup],
    swapped: Sequence[SequenceGroup], bm: BlockManager, update: StepUpdate,
    remote: RemoteKVTracker, num_preemptions_total: int, detail: SchedulerDetail | None,
) -> SchedulerStats:
    """`Scheduler.stats()`: the queues' lengths, the block manager's pools and the counters of
    the scheduler's parts; reads counters only."""
    return SchedulerStats(
        num_waiting=len(waiting),
        num_running=len(running),
        num_swapped=len(swapped),
        num_waiting_for_remote_kvs=len(remote.waiting),
        num_gpu_blocks=bm.num_gpu_blocks,
        num_free_gpu_blocks=bm.get_num_free_gpu_blocks(),
        num_cpu_blocks=bm.num_cpu_blocks,
        num_free_cpu_blocks=bm.get_num_free_cpu_blocks(),
        num_preemptions_total=num_preemptions_total,
        num_prompt_tokens_total=update.num_prompt_tokens_total,
        num_generation_tokens_total=update.num_generation_tokens_total,
        num_prefix_cache_queries_total=bm.num_prefix_cache_queries,
        num_prefix_cache_hits_total=bm.num_prefix_cache_hits,
        num_spec_drafts_total=update.num_spec_drafts_total,
        num_spec_draft_tokens_total=update.num_spec_draft_tokens_total,
        num_spec_accepted_tokens_total=update.num_spec_accepted_tokens_total,
        num_spec_accepted_tokens_per_pos=tuple(update.num_spec_accepted_tokens_per_pos),
        kv_transfer=remote.connector is not None,
        num_kv_transfer_requests_total=remote.num_requests_total,
        num_kv_transfer_bytes_total=remote.num_bytes_total,
        num_kv_transfer_failures_total=remote.num_failures_total,
        detail=detail,
    )


def collect_detail(
    waiting: RequestQueue[SequenceGroup], running: list[SequenceGroup],
    swapped: Sequence[SequenceGroup], bm: BlockManager, priority: bool, lora: bool,
    max_model_len: int, max_requests: int,
) -> SchedulerDetail:
    """The walks of `Scheduler.stats(detail=True)` over the scheduler's queues and pools.
    `priority`: the waiting queue is ordered by priority, not arrival; `lora`: adapters in use
    are listed (--enable-lora)."""
    if not waiting:
        oldest = None
    elif priority:  # no single head by arrival: walk the queue
        oldest = min(g.arrival_time for g in waiting)
    else:
        oldest = waiting.peek().arrival_time  # a preempted request keeps its place first
    rows: list[RequestStats] = []
    for is_swapped, groups in ((False, running), (True, swapped)):
        for group in groups:
            if len(rows) == max_requests:
                break
            rows.append(RequestStats.of(group, is_swapped, max_model_len))
    return SchedulerDetail(
        gpu_block_states=bm.gpu.block_states(),
        cpu_block_states=bm.cpu.block_states(),
        oldest_waiting_arrival=oldest,
        oldest_swapped_arrival=swapped[0].arrival_time if swapped else None,
        requests=tuple(rows),
        running_lora_adapters=_adapters(running) if lora else (),
        waiting_lora_adapters=_adapters(waiting) if lora else (),
    )


def _adapters(groups: Iterable[SequenceGroup]) -> tuple[str, ...]:
    """The distinct adapters of `groups`, in name order."""
    return tuple(sorted({g.lora_request.lora_name for g in groups if g.lora_request is not None}))
