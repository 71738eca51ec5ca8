"""The scheduler: three queues (`waiting`, `running`, `swapped`) and one rule. Every sequence has
`num_computed_tokens` and wants to reach `get_len()`; each step hands some sequences
`num_new_tokens` under the token budget. That covers prefill, chunked prefill, decode, prefix-cache
hits (which start the counter above zero) and recompute (which resets it).

A step, in order:
  0. (priority policy) a waiting request with strictly better priority than the running tail
     preempts the tail while it cannot otherwise fit;
  1. running, oldest (best) first: reserve slots for decodes and prefill chunks; when blocks run out
     preempt from the tail (newest / worst priority); the group being scheduled goes last;
  2. swapped: swap back in, oldest first, while blocks (with watermark) and budget allow;
  3. waiting: admit in policy order while budget, max_num_seqs and free blocks minus watermark
     allow; new admissions wait while anything is swapped (under priority: anything not worse).
Steps 2 and 3 are skipped after a preemption in step 1: memory is tight, and swapping a group back
in the step it left would only churn.

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

from tessera.config import CacheConfig, PreemptionMode, SchedulerConfig, SchedulingPolicy
from tessera.core.block_manager import AllocStatus, BlockManager
from tessera.core.scheduler_output import (
    ScheduledSequence,
    ScheduledSequenceGroup,
    SchedulerOutput,
)
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
_SWAPPED = SequenceStatus.SWAPPED


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.clock = clock
        self.block_manager = BlockManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            watermark=cache_config.watermark,
            enable_prefix_caching=cache_config.enable_prefix_caching,
        )
        self._priority = scheduler_config.scheduling_policy is SchedulingPolicy.PRIORITY
        # waiting: FCFS keeps a deque in arrival order (preempted groups re-enter at the front);
        # priority keeps a list sorted by (priority, arrival), insertion by bisection
        self.waiting: deque[SequenceGroup] | list[SequenceGroup] = [] if self._priority else deque()
        self.running: list[SequenceGroup] = []  # sorted by policy key: the tail is the next victim
        self.swapped: deque[SequenceGroup] = deque()
        self._groups: dict[str, SequenceGroup] = {}  # unfinished requests by id
        self.num_preemptions_total = 0

    def _key(self, group: SequenceGroup) -> tuple[int, float]:
        return (group.priority, group.arrival_time) if self._priority else (0, group.arrival_time)

    # requests in and out

    def add_seq_group(self, group: SequenceGroup) -> None:
        if group.request_id in self._groups:
            raise ValueError(f"request id {group.request_id!r} is already scheduled")
        self._groups[group.request_id] = group
        if self._priority:
            bisect.insort(self.waiting, group, key=self._key)
        else:
            self.waiting.append(group)  # type: ignore[union-attr]

    def _push_waiting_front(self, group: SequenceGroup) -> None:
        """A preempted group keeps its place ahead of newer arrivals."""
        if self._priority:
            bisect.insort_left(self.waiting, group, key=self._key)
        else:
            self.waiting.appendleft(group)  # type: ignore[union-attr]

    def _pop_waiting(self) -> SequenceGroup:
        return self.waiting.pop(0) if self._priority else self.waiting.popleft()  # type: ignore[union-attr]

    def abort_seq_group(self, request_id: str | Iterable[str]) -> list[SequenceGroup]:
        """Abort requests wherever they are: blocks are freed at once, sequences become
        FINISHED_ABORTED. Unknown or finished ids are ignored. Returns the aborted groups."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = []
        for req_id in ids:
            group = self._groups.pop(req_id, None)
            if group is None:
                continue
            for name in ("running", "swapped", "waiting"):
                queue = getattr(self, name)
                for i, g in enumerate(queue):
                    if g is group:
                        del queue[i]
                        break
                else:
                    continue
                break
            for seq in group.seqs:
                if not seq.is_finished():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                self.block_manager.free(seq)
            aborted.append(group)
        return aborted

    def fork_seq(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """Add `child` to a running group, sharing all of `parent`'s blocks."""
        group.seqs.append(child)
        self.block_manager.fork(parent, child)
        child.status = _RUNNING

    def free_finished_seq_groups(self) -> list[SequenceGroup]:
        """Free the blocks of finished sequences; drop and return the groups that are done."""
        finished, kept = [], []
        free = self.block_manager.free
        for group in self.running:
            done = True
            for seq in group.seqs:
                if seq.status is _RUNNING:
                    done = False
                elif seq.status.is_finished:
                    free(seq)
                else:
                    done = False
            if done:
                finished.append(group)
                self._groups.pop(group.request_id, None)
            else:
                kept.append(group)
        if finished:
            self.running = kept
        return finished

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # the step

    def schedule(self) -> SchedulerOutput:
        """Decide one step (see the module docstring). Apply the output's cache ops in the order
        swap-out, swap-in, copy, before the forward pass: a block freed by a swap-out may be the
        destination of a swap-in or a copy in the same step. Block tables in the output are the
        live lists: read them this step."""
        out = SchedulerOutput()
        budget = [self.config.max_num_batched_tokens]  # tokens left, mutated by the phases
        if self._priority and self.waiting and self.running:
            self._preempt_for_priority(out)
        num_running_seqs, preempted = self._schedule_running(out, budget)
        if self.swapped and not preempted and out.num_preemptions == 0:
            num_running_seqs = self._schedule_swapped(out, budget, num_running_seqs)
        if self.waiting and not preempted:
            self._schedule_waiting(out, budget, num_running_seqs)
        if out.scheduled_groups:
            now = None
            for sg in out.scheduled_groups:
                if sg.group.first_scheduled_time is None:
                    now = self.clock() if now is None else now
                    sg.group.first_scheduled_time = now
        return out

    def _plan(self, seqs: list[Sequence], budget: int, reserve: int = 0) -> list[tuple[Sequence, int]]:
        """Tokens for each sequence this step: a decode takes 1; a prefill takes all it needs, or
        with chunked prefill as much as the budget minus `reserve` (decodes still to come) gives."""
        plan = []
        chunked = self.config.enable_chunked_prefill
        for seq in seqs:
            need = seq.get_len() - seq.num_computed_tokens
            if need <= 0:
                continue
            if need == 1:
                take = 1 if budget >= 1 else 0
            elif chunked:
                take = min(need, budget - reserve)
            else:
                take = need if need <= budget else 0
            if take > 0:
                plan.append((seq, take))
                budget -= take
        return plan

    def _emit(self, out: SchedulerOutput, group: SequenceGroup, plan) -> int:
        """Add the group's planned sequences to the output; returns the tokens they take."""
        table = self.block_manager.get_block_table
        scheduled = []
        num_tokens = 0
        for seq, n in plan:
            scheduled.append(ScheduledSequence(seq, n, table(seq), seq.num_computed_tokens))
            num_tokens += n
        out.scheduled_groups.append(ScheduledSequenceGroup(group, scheduled))
        return num_tokens

    def _schedule_running(self, out: SchedulerOutput, budget: list[int]) -> tuple[int, bool]:
        """Step 1. Returns (sequence seats held by running groups, whether anyone was preempted)."""
        bm = self.block_manager
        table = bm.get_block_table
        queue = deque(self.running)
        kept: list[SequenceGroup] = []
        num_seats = 0
        preempted = False
        pending_decodes = 0
        if self.config.enable_chunked_prefill:  # reserve budget so decodes come before chunks
            pending_decodes = sum(_num_decodes(g) for g in queue)
        while queue:
            group = queue.popleft()
            seqs = group.seqs
            if len(seqs) != 1 or seqs[0].status is not _RUNNING:
                seqs = [s for s in seqs if s.status is _RUNNING]
                if not seqs:  # finished, waiting for free_finished_seq_groups()
                    kept.append(group)
                    continue
            left = budget[0]
            seq = seqs[0]
            if len(seqs) == 1 and seq.get_len() - seq.num_computed_tokens == 1 and left > 0:
                plan = None  # the common case: one sequence decoding
                if pending_decodes:
                    pending_decodes -= 1
            else:
                if pending_decodes:
                    pending_decodes -= _num_decodes(group)
                plan = self._plan(seqs, left, pending_decodes) if left > 0 else []
            if plan is None or plan:
                while (copies := bm.try_append_slots(group)) is None:
                    preempted = True
                    if queue:
                        victim = queue.pop()
                        if pending_decodes:
                            pending_decodes -= _num_decodes(victim)
                        self._preempt(victim, out, alone=False)
                    else:
                        self._preempt(group, out, alone=not kept)
                        break
                if copies is None:
                    continue
                if copies:
                    out.blocks_to_copy += copies
                if plan is None:
                    out.scheduled_groups.append(ScheduledSequenceGroup(
                        group, [ScheduledSequence(seq, 1, table(seq), seq.num_computed_tokens)]
                    ))
                    budget[0] = left - 1
                else:
                    budget[0] = left - self._emit(out, group, plan)
            kept.append(group)
            n = getattr(group.sampling_params, "n", 1)
            # = group.max_num_running_seqs(), cheaper: here every unfinished seq is running
            if len(group.seqs) < n and not group.seqs[0].output_token_ids:
                num_seats += n
            else:
                num_seats += len(seqs)
        self.running = kept
        return num_seats, preempted

    def _schedule_swapped(self, out: SchedulerOutput, budget: list[int], num_seqs: int) -> int:
        bm = self.block_manager
        if self._priority and len(self.swapped) > 1:
            self.swapped = deque(sorted(self.swapped, key=self._key))
        while self.swapped and budget[0] > 0:
            group = self.swapped[0]
            n = group.max_num_running_seqs()
            if num_seqs + n > self.config.max_num_seqs:
                break
            alone = not self.running
            if not bm.can_swap_in(group, use_watermark=not alone):
                if alone:  # cannot come back even to an empty device: start it over instead
                    self.swapped.popleft()
                    self._recompute(group)
                    continue
                break
            seqs = [s for s in group.seqs if s.status is _SWAPPED]
            plan = self._plan(seqs, budget[0])
            if not plan:
                break
            self.swapped.popleft()
            bm.swap_in(group, out.blocks_to_swap_in)
            out.num_swapped_in += 1
            for seq in seqs:
                seq.status = _RUNNING
            copies = bm.try_append_slots(group)
            assert copies is not None, "can_swap_in reserved a block per sequence"
            out.blocks_to_copy += copies
            budget[0] -= self._emit(out, group, plan)
            bisect.insort(self.running, group, key=self._key)
            num_seqs += n
        return num_seqs

    def _admission_blocked(self, head: SequenceGroup) -> bool:
        if not self.swapped:
            return False
        if not self._priority:
            return True
        return min(g.priority for g in self.swapped) <= head.priority

    def _schedule_waiting(self, out: SchedulerOutput, budget: list[int], num_seqs: int) -> None:
        bm = self.block_manager
        while self.waiting and budget[0] > 0:
            group = self.waiting[0]
            if self._admission_blocked(group):
                break
            reason = self._reject_reason(group)
            status = None
            if reason is None:
                status = bm.can_allocate(group)
                if status is AllocStatus.NEVER:
                    reason = self._never_reason(group)
            if reason is not None:
                self._pop_waiting()
                self._ignore(group, reason, out)
                continue
            n = group.max_num_running_seqs()
            if num_seqs + n > self.config.max_num_seqs or status is AllocStatus.LATER:
                break
            seqs = [s for s in group.seqs if s.status is _WAITING]
            if not self.config.enable_chunked_prefill:
                first = seqs[0]
                if first.get_len() - bm.get_num_cached_tokens(group, first) > budget[0]:
                    break  # scheduled whole or not at all
            self._pop_waiting()
            out.num_prefix_cache_hit_tokens += bm.allocate(group)
            for seq in seqs:
                seq.status = _RUNNING
            plan = self._plan(seqs, budget[0])
            budget[0] -= self._emit(out, group, plan)
            bisect.insort(self.running, group, key=self._key)
            num_seqs += n

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Preempt the worst running groups while the best waiting one is strictly better and
        cannot fit otherwise."""
        bm = self.block_manager
        num_seqs = sum(g.max_num_running_seqs() for g in self.running)
        reserved = sum(bm.num_append_blocks(g) for g in self.running)  # for this step's decodes
        while self.waiting and self.running:
            head, tail = self.waiting[0], self.running[-1]
            if head.priority >= tail.priority or self._reject_reason(head) is not None:
                return
            status = bm.can_allocate(head, reserved)
            if status is AllocStatus.NEVER:
                return
            if status is AllocStatus.OK and (
                num_seqs + head.max_num_running_seqs() <= self.config.max_num_seqs
            ):
                return
            self.running.pop()
            num_seqs -= tail.max_num_running_seqs()
            reserved -= bm.num_append_blocks(tail)
            self._preempt(tail, out, alone=False)

    # preemption and rejection

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, alone: bool) -> None:
        """Take a running group off the device. `alone`: no other group holds device blocks, so
        swapping would only bring it back to the same full pool; recompute it instead."""
        for seq in group.seqs:  # finished members keep nothing (normally freed already)
            if seq.is_finished():
                self.block_manager.free(seq)
        mode = self.config.preemption_mode
        if mode is None:
            mode = (
                PreemptionMode.RECOMPUTE
                if len(group.get_unfinished_seqs()) == 1
                else PreemptionMode.SWAP
            )
        if mode is PreemptionMode.SWAP and (alone or not self.block_manager.can_swap_out(group)):
            mode = PreemptionMode.RECOMPUTE  # never abort for lack of swap space
        if mode is PreemptionMode.SWAP:
            self.block_manager.swap_out(group, out.blocks_to_swap_out)
            for seq in group.seqs:
                if seq.status is _RUNNING:
                    seq.status = _SWAPPED
            self.swapped.append(group)
            out.num_swapped_out += 1
        else:
            self._recompute(group)
        out.preempted_groups.append(group)
        out.num_preemptions += 1
        self.num_preemptions_total += 1

    def _recompute(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            if not seq.is_finished():
                self.block_manager.free(seq)
                seq.reset_for_recompute()
        self._push_waiting_front(group)

    def _reject_reason(self, group: SequenceGroup) -> str | None:
        cfg = self.config
        for seq in group.seqs:
            if not seq.is_finished() and seq.get_len() > cfg.max_model_len:
                if seq.get_output_len():
                    return (
                        f"sequence has {seq.get_len()} tokens (prompt + output), more than "
                        f"max_model_len {cfg.max_model_len}"
                    )
                return f"prompt has {seq.get_len()} tokens, more than max_model_len {cfg.max_model_len}"
        n = group.max_num_running_seqs()
        if n > cfg.max_num_seqs:
            return f"request needs {n} sequences at once, more than max_num_seqs {cfg.max_num_seqs}"
        if n > cfg.max_num_batched_tokens:
            return (
                f"request needs {n} sequences at once, more than max_num_batched_tokens "
                f"{cfg.max_num_batched_tokens}"
            )
        return None

    def _never_reason(self, group: SequenceGroup) -> str:
        bm = self.block_manager
        num_tokens = sum(s.get_len() for s in group.seqs if s.status is _WAITING)
        return (
            f"request needs {bm.num_required_blocks(group)} KV blocks ({num_tokens} tokens, block "
            f"size {bm.block_size}), more than the {bm.num_gpu_blocks} device blocks less the "
            f"watermark of {bm.watermark_blocks}"
        )

    def _ignore(self, group: SequenceGroup, reason: str, out: SchedulerOutput) -> None:
        logger.warning("request %s ignored: %s", group.request_id, reason)
        for seq in group.seqs:
            if not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_IGNORED
            self.block_manager.free(seq)
        group.error = reason
        out.ignored_groups.append(group)
        self._groups.pop(group.request_id, None)

    # after the forward pass

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Advance every scheduled sequence by the tokens it just computed, and (prefix caching)
        offer the blocks that became full and computed. Call before appending sampled tokens."""
        cache = self.block_manager.cache_computed_blocks
        caching = self.block_manager.enable_prefix_caching
        for sg in output.scheduled_groups:
            for ss in sg.seqs:
                seq = ss.seq
                if seq.status is not _RUNNING:
                    continue  # aborted meanwhile
                seq.num_computed_tokens += ss.num_new_tokens
                if caching:
                    cache(seq)


def _num_decodes(group: SequenceGroup) -> int:
    return sum(
        1 for s in group.seqs if s.status is _RUNNING and s.get_len() - s.num_computed_tokens == 1
    )
