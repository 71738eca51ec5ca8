"""The scheduler: three queues (`waiting`, `running`, `swapped`) and one rule. Every sequence has
`num_computed_tokens` and wants to reach `get_len()`; each step hands some sequences
`num_new_tokens` under the token budget. That covers prefill, chunked prefill, decode, prefix-cache
hits (which start the counter above zero) and recompute (which resets it).

A step, in order (each step's home in brackets):
  0. (priority policy) a waiting request with strictly better priority than the running tail
     preempts the tail while it cannot otherwise fit [core/preemption.py];
  1. running, oldest (best) first: reserve slots for decodes and prefill chunks; when blocks run out
     preempt from the tail (newest / worst priority); the group being scheduled goes last [here,
     with the token budget's rules in core/token_budget.py];
  2. swapped: swap back in, oldest first, while blocks (with watermark) and budget allow
     [core/preemption.py];
  3. waiting: admit in policy order while budget, max_num_seqs and free blocks minus watermark
     allow; new admissions wait while anything is swapped (under priority: anything not worse)
     [core/waiting_admission.py].
Steps 2 and 3 are skipped after a preemption in step 1: memory is tight, and swapping a group back
in the step it left would only churn. With LoRA (--max-loras), steps 2 and 3 admit only what keeps
the running adapters within the limit (core/lora_admission.py); a waiting request held back for
an adapter slot keeps its place, and younger ones of running adapters may pass it (up to
`LORA_LOOKAHEAD` held back per step, so a step's cost stays bounded).

An embedding request (`group.pooling_params`, /v1/embeddings) is the same rule without a decode:
it is scheduled like any prompt (budget, chunks, prefix hits, preemption), and the update of the
step that completes its prompt finishes it with the runner's pooled vector, freeing its seat.

Speculative decoding is the same rule: a decoding sequence with draft tokens (proposed by the
runner after its last step, `seq.spec_token_ids`) gets 1 + k new tokens, listed in
`scheduled_spec_decode_tokens`. Drafts take only budget left over by the decodes still to come,
never pass `max_tokens` or `max_model_len`, and are dropped rather than preempt anyone when their
lookahead slots are not free; `update_from_output` advances the sequence by the accepted ones.

The scheduler is composed of parts, each with its own state, that it calls and that never call
back: the `BlockManager` (blocks, prefix cache, swap), `Preemption` (core/preemption.py: swap or
recompute, and the `swapped` queue), `WaitingAdmission` (core/waiting_admission.py: the head of
`waiting`, admitted or rejected), the `RemoteKVTracker` (core/remote_kv.py: requests parked for a
peer's KV or held for a peer to pull), the `StepUpdate` (core/step_update.py: a step's results
applied to the sequences it scheduled), the `RunnerView` (core/runner_view.py: what the runner
already holds, so that a step sends diffs) and `LoRAAdmission`. The scheduler itself owns
`waiting`, `running` and the live requests, hands the queues to the parts that pop or prepend
them, and it alone frees requests.

One writer of progress: a sequence's `status` and `num_computed_tokens` change only through
`set_progress` (core/progress.py, which lists the events), called only from the scheduler and its
parts; tests/core/test_single_writer.py fails on any other assignment. Admission starts the
counter at the prefix-cache hits `BlockManager.allocate` returns; a landed remote KV moves it to
the prompt's last token; recompute resets it to zero; after the forward pass `update_from_output`
advances it by the tokens actually computed and accepted, appends the sampled tokens, applies the
token-id stop rules (core/stop_conditions.py), forks the children of n > 1 requests, frees what
finished and offers full blocks to the prefix cache. The runner is told only plain diffs; it never
sees these objects. The engine reads the scheduler's state through `stats()`
(core/scheduler_stats.py).

Cost: the hot path reads counters. It walks `running` (the sequences it schedules) and only the
head of `waiting` it admits, so a step costs the same with 1,000 or 10,000 requests waiting.
Pure Python, no tensors; time comes from the injected `clock`.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from tessera.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from tessera.core.block_manager import BlockManager
from tessera.core.core_output import EngineCoreOutput
from tessera.core.kv_cache_groups import group_windows
from tessera.core.kv_connector import PullConnectorScheduler
from tessera.core.lora_admission import LoRAAdmission
from tessera.core.preemption import Preemption
from tessera.core.progress import set_progress
from tessera.core.remote_kv import RemoteKVTracker
from tessera.core.request_queue import create_request_queue
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.runner_view import RunnerView
from tessera.core.scheduler_output import SchedulerOutput
from tessera.core.scheduler_stats import SchedulerStats, collect_detail, collect_stats
from tessera.core.step_update import StepUpdate, request_metrics
from tessera.core.token_budget import (
    Budget,
    Plan,
    any_drafts,
    num_decodes,
    plan_tokens,
    take_drafts,
)
from tessera.core.waiting_admission import LORA_LOOKAHEAD, WaitingAdmission
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["LORA_LOOKAHEAD", "Scheduler"]  # LORA_LOOKAHEAD: importable from here as before

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        eos_token_ids: tuple[int, ...] = (),
        kv_connector: PullConnectorScheduler | None = None,
        max_loras: int | None = None,
        num_draft_gpu_blocks: int = 0,
    ) -> None:
        """`num_draft_gpu_blocks`: the draft model's own KV pool (speculative decoding with a
        window, core/block_layout.py); 0: none."""
        self.config = scheduler_config
        # --max-loras with --enable-lora; None: no adapter limit (LoRA off)
        self.lora = None if max_loras is None else LoRAAdmission(max_loras)
        self.cache_config = cache_config
        self.clock = clock
        self.eos_token_ids = tuple(eos_token_ids)
        self.block_manager = BlockManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            watermark=cache_config.watermark,
            enable_prefix_caching=cache_config.enable_prefix_caching,
            sliding_window=cache_config.sliding_window,
            group_windows=group_windows(cache_config.layer_windows),
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            num_draft_gpu_blocks=num_draft_gpu_blocks,
        )
        self._priority = scheduler_config.scheduling_policy is SchedulingPolicy.PRIORITY
        self.waiting = create_request_queue(scheduler_config.scheduling_policy)
        self.running: list[SequenceGroup] = []  # sorted by policy key: the tail is the next victim
        self._groups: dict[str, SequenceGroup] = {}  # unfinished requests by request id
        self._live: dict[str, tuple[SequenceGroup, Sequence]] = {}  # unfinished streams by req_id
        self._runner = RunnerView()
        self._ignored: list[SequenceGroup] = []  # rejected this step, reported by the update
        # disaggregated prefill/decode; without a connector it never parks or holds anything
        self.remote_kv = RemoteKVTracker(kv_connector, self.block_manager)
        # swap and recompute; owns the `swapped` queue
        self.preemption = Preemption(scheduler_config, self.block_manager, self._runner,
                                     self.waiting, self.remote_kv, self.lora,
                                     self._key if self._priority else None)
        self._update = StepUpdate(self.block_manager, scheduler_config.max_model_len,
                                  self.eos_token_ids)
        self._admission = WaitingAdmission(scheduler_config, self.block_manager, self.waiting,
                                           self.preemption, self.remote_kv, self.lora)

    def _key(self, group: SequenceGroup) -> tuple[int, float]:
        return (group.priority, group.arrival_time) if self._priority else (0, group.arrival_time)

    @property
    def swapped(self) -> deque[SequenceGroup]:
        """Groups swapped out to the CPU pool, in the order they resume (core/preemption.py)."""
        return self.preemption.swapped

    @property
    def num_preemptions_total(self) -> int:
        return self.preemption.num_preemptions_total

    # requests in and out

    def add_seq_group(self, group: SequenceGroup) -> None:
        if group.request_id in self._groups:
            raise ValueError(f"request id {group.request_id!r} is already scheduled")
        self._groups[group.request_id] = group
        for seq in group.seqs:
            self._live[seq.req_id] = (group, seq)
        self.waiting.add(group)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> list[SequenceGroup]:
        """Abort requests wherever they are: blocks are freed at once, sequences become
        FINISHED_ABORTED. Unknown or finished ids are ignored. Returns the aborted groups."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = []
        for req_id in ids:
            group = self._groups.get(req_id)
            if group is None:
                continue
            if group in self.waiting:
                self.waiting.remove(group)
            elif group in self.swapped:
                self.swapped.remove(group)
            elif self.remote_kv.abort(group):
                pass  # was waiting for its remote KV
            else:
                self.running.remove(group)
            for seq in group.seqs:
                if not seq.is_finished():
                    set_progress(seq, seq.num_computed_tokens, SequenceStatus.FINISHED_ABORTED)
            self._drop(group)
            aborted.append(group)
        return aborted

    def finish_seqs(self, stops: Iterable[tuple[str, int, str]]) -> None:
        """Finish sequences that matched a stop string: (request id, sequence index, the string).
        The engine's output processor finds these; the scheduler frees them."""
        done = False
        for request_id, index, stop_str in stops:
            group = self._groups.get(request_id)
            if group is None:
                continue
            seq = group.seqs[index]
            if not seq.is_finished():
                set_progress(seq, seq.num_computed_tokens, SequenceStatus.FINISHED_STOPPED)
            seq.stop_reason = stop_str
            self._free_seq(seq)
            done = done or group.is_finished()
        if done:
            self._sweep_finished()

    @property
    def waiting_for_remote_kvs(self) -> dict[str, SequenceGroup]:
        """Requests parked until a peer's KV lands, by the stream's req_id (read-only)."""
        return self.remote_kv.waiting

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.remote_kv.waiting)

    def get_num_unfinished_seq_groups(self) -> int:
        return (len(self.waiting) + len(self.running) + len(self.swapped)
                + len(self.remote_kv.waiting))

    def has_pending_kv_transfers(self) -> bool:
        """Blocks held for a peer or KV on its way: the engine keeps stepping to hear back."""
        return self.remote_kv.has_pending()

    def request_id_of(self, req_id: str) -> str | None:
        """The request a stream (req_id) belongs to, while it is unfinished."""
        entry = self._live.get(req_id)
        return None if entry is None else entry[0].request_id

    # the step

    def schedule(self) -> SchedulerOutput:
        """Decide one step (see the module docstring)."""
        self.remote_kv.expire()
        out = SchedulerOutput(finished_req_ids=self._runner.take_finished())
        # a request waiting for its remote KV holds a seat
        budget = Budget(self.config.max_num_batched_tokens, len(self.remote_kv.waiting))
        scheduled: list[tuple[SequenceGroup, Plan]] = []
        if self._priority and self.waiting and self.running:
            self.preemption.preempt_for_priority(self.running, out)
        preempted = self._schedule_running(out, budget, scheduled)
        if self.lora is not None:
            self.lora.begin(self.running)
        if self.swapped and not preempted and out.num_preemptions == 0:
            for group in self.preemption.resume_swapped(out, budget, scheduled,
                                                        len(self.running)):
                bisect.insort(self.running, group, key=self._key)
        if self.waiting and not preempted:
            self._schedule_waiting(out, budget, scheduled)
        if self.lora is not None:
            self.lora.end()
        if scheduled:
            self._describe(out, scheduled)
        out.num_running_reqs = len(self.running)
        out.kv_connector_metadata = self.remote_kv.connector_meta()
        return out

    def _describe(self, out: SchedulerOutput, scheduled: list[tuple[SequenceGroup, Plan]]) -> None:
        """Turn the plan into the runner's message (plain data keyed by req_id)."""
        table = self.block_manager.get_block_table
        describe = self._runner.describe
        num_scheduled = out.num_scheduled_tokens
        now = None
        total = 0
        for group, plan in scheduled:
            if group.first_scheduled_time is None:
                now = self.clock() if now is None else now
                group.first_scheduled_time = now
            if group.is_fork_pending:
                out.num_samples[plan[0][0].req_id] = group.sampling_params.n
            for seq, n in plan:
                describe(group, seq, table(seq), out)
                num_scheduled[seq.req_id] = n
                total += n
                if seq.spec_token_ids:
                    out.scheduled_spec_decode_tokens[seq.req_id] = list(seq.spec_token_ids)
        out.total_num_scheduled_tokens = total

    def _schedule_running(
        self, out: SchedulerOutput, budget: Budget, scheduled: list[tuple[SequenceGroup, Plan]]
    ) -> bool:
        """Step 1. Takes seats for every running group; returns whether anyone was preempted."""
        bm = self.block_manager
        queue = deque(self.running)
        kept: list[SequenceGroup] = []
        preempted = False
        pending_decodes = 0
        chunked = self.config.enable_chunked_prefill
        if chunked:  # reserve budget so decodes come before chunks
            pending_decodes = sum(num_decodes(g) for g in queue)
        while queue:
            group = queue.popleft()
            seqs = group.seqs
            if len(seqs) != 1 or seqs[0].status is not _RUNNING:
                seqs = [s for s in seqs if s.status is _RUNNING]
                assert seqs, "a finished group is swept from running by the update"
            left = budget.tokens
            seq = seqs[0]
            plan: Plan
            if len(seqs) == 1 and seq.is_decoding() and left > 0:
                plan = [(seq, 1)]  # the common case: one sequence decoding
                if pending_decodes:
                    pending_decodes -= 1
            else:
                if pending_decodes:
                    pending_decodes -= num_decodes(group)
                plan = plan_tokens(seqs, left, chunked, pending_decodes) if left > 0 else []
            if plan and (seq.spec_token_ids or (len(seqs) > 1 and any_drafts(seqs))):
                # drafts take only budget that later groups' decodes do not need
                reserve = pending_decodes if chunked else len(queue)
                # ... and only blocks beyond one per sequence of this group and per later group
                spare = bm.gpu.num_free // bm.num_groups - len(seqs) - len(queue)
                plan = self._take_drafts(group, seqs, plan,
                                         left - sum(n for _, n in plan) - reserve, spare)
            if plan:
                while (copies := bm.try_append_slots(group)) is None:
                    if any_drafts(seqs):  # drafts never cost a preemption: drop them first
                        plan = _drop_drafts(seqs, plan)
                        continue
                    preempted = True
                    if queue:
                        victim = queue.pop()
                        if pending_decodes:
                            pending_decodes -= num_decodes(victim)
                        self._preempt(victim, out, alone=False)
                    else:
                        self._preempt(group, out, alone=not kept)
                        break
                if copies is None:
                    continue
                if copies:
                    out.blocks_to_copy += copies
                scheduled.append((group, plan))
                budget.tokens = left - (plan[0][1] if len(plan) == 1 else sum(n for _, n in plan))
            kept.append(group)
            budget.num_seqs += group.sampling_params.n if group.is_fork_pending else len(seqs)
        self.running = kept
        return preempted

    def _take_drafts(
        self, group: SequenceGroup, seqs: list[Sequence], plan: Plan, room: int,
        spare_blocks: int,
    ) -> Plan:
        """The plan with its decodes' draft tokens (`take_drafts`, core/token_budget.py), each
        running sequence's `spec_token_ids` trimmed to what it verifies this step."""
        bm = self.block_manager
        plan, num_verified = take_drafts(plan, room, spare_blocks, self.config.max_model_len,
                                         group.sampling_params.max_tokens, bm.block_size,
                                         bm.get_num_logical_blocks)
        for seq in seqs:
            k = num_verified.get(seq.seq_id, 0)
            if len(seq.spec_token_ids) > k:
                seq.spec_token_ids = seq.spec_token_ids[:k]
        return plan

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: Budget, scheduled: list[tuple[SequenceGroup, Plan]]
    ) -> None:
        """Step 3 (core/waiting_admission.py): admit from the head of `waiting`."""
        admitted, rejected = self._admission.admit(out, budget, scheduled)
        for group, reason in rejected:
            self._ignore(group, reason, out)
        for group in admitted:
            bisect.insort(self.running, group, key=self._key)

    # preemption and rejection

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, alone: bool) -> None:
        """Take a running group off the device: swap or recompute (core/preemption.py)."""
        self.preemption.preempt(group, out, alone)

    def _ignore(self, group: SequenceGroup, reason: str, out: SchedulerOutput) -> None:
        logger.warning("request %s ignored: %s", group.request_id, reason)
        for seq in group.seqs:
            if not seq.is_finished():
                set_progress(seq, seq.num_computed_tokens, SequenceStatus.FINISHED_IGNORED)
        group.error = reason
        self._drop(group)
        out.ignored_request_ids.append(group.request_id)
        self._ignored.append(group)


    # the step's results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results (core/step_update.py), free what finished, and take back the
        requests whose remote KV landed. Returns, per request that changed, what its sequences
        gained."""
        now = self.clock()
        step = self._update.apply(scheduler_output, runner_output, self._live, now)
        for group, child in step.forked:
            self._live[child.req_id] = (group, child)
        for group, seq in step.finished:
            if self.remote_kv.hold_for_peer(group, seq):  # its blocks wait for the peer's pull
                self._runner.finished(seq)
                self._live.pop(seq.req_id, None)
            else:
                self._free_seq(seq)
        for group in self.remote_kv.update(runner_output):
            bisect.insort(self.running, group, key=self._key)
        touched = step.outputs
        for group in self._ignored:
            touched[group.request_id] = (group, EngineCoreOutput(group.request_id,
                                                                 error=group.error))
        self._ignored = []
        if step.finished:
            self._sweep_finished()
        groups = self._groups
        for group, out in touched.values():
            if group.request_id not in groups:  # dropped: finished (or rejected)
                out.finished = True
                out.kv_transfer_params = self.remote_kv.take_params(group.request_id)
                if group.finished_time is None:
                    group.finished_time = now
                out.metrics = request_metrics(group)
        return [out for _, out in touched.values()]

    def _free_seq(self, seq: Sequence) -> None:
        if not self.remote_kv.is_held(seq):  # a finished prefill's blocks wait for its peer
            self.block_manager.free(seq)
        self._runner.finished(seq)
        self._live.pop(seq.req_id, None)

    def _drop(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._free_seq(seq)
        self._groups.pop(group.request_id, None)

    def _sweep_finished(self) -> None:
        """Drop finished groups from `running` (their sequences are already freed)."""
        kept = []
        for group in self.running:
            if group.is_finished():
                self._drop(group)
            else:
                kept.append(group)
        self.running = kept

    def resend_whole(
        self, scheduler_output: SchedulerOutput, req_ids: list[str]
    ) -> SchedulerOutput:
        """For a step that raised (engine/step_recovery.py): the part of its `scheduler_output`
        that concerns `req_ids`, each request sent whole (the runner's copy may hold half-applied
        diffs; a whole one replaces it). No cache operations and no finished ids: the runner
        applied those before the forward pass that failed. Writes no progress."""
        table = self.block_manager.get_block_table
        live = [self._live[req_id] for req_id in req_ids]
        return self._runner.resend_whole(scheduler_output,
                                         [(group, seq, table(seq)) for group, seq in live])

    # what the engine may read

    def stats(self, detail: bool = False, max_requests: int = 256) -> SchedulerStats:
        """The queues, the KV pools and the counters (core/scheduler_stats.py): counters only,
        cheap enough for every step. `detail`: also the block maps, up to `max_requests` request
        rows and the adapters in use; walks the queues, so once per sample or scrape."""
        return collect_stats(
            self.waiting, self.running, self.swapped, self.block_manager, self._update,
            self.remote_kv, self.num_preemptions_total,
            collect_detail(self.waiting, self.running, self.swapped, self.block_manager,
                           self._priority, self.lora is not None, self.config.max_model_len,
                           max_requests) if detail else None,
        )

    def check_remote_kv_integrity(self) -> None:
        """For tests: every parked or held request holds blocks and is in one place only."""
        self.remote_kv.check_integrity(self.running, self._live)


def _drop_drafts(seqs: list[Sequence], plan: Plan) -> Plan:
    """The plan without its draft tokens (the lookahead slots could not be had)."""
    plan = [(s, n - len(s.spec_token_ids)) for s, n in plan]
    for seq in seqs:
        seq.spec_token_ids = []
    return plan
