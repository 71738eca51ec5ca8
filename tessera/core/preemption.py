"""Preemption, for the scheduler: taking a running request off the device when blocks run out,
and bringing it back. SWAP moves its blocks to the CPU pool, and it waits in `swapped` until the
swap-in pass (step 2 of a step) resumes it, oldest first; RECOMPUTE frees its blocks and puts it
back at the head of `waiting`, ahead of newer arrivals, to prefill its prompt and output again.
Swap falls back to recompute, never to an abort, when swap space is full, and when the request
is alone on the device (swapping it would only bring it back to the same full pool).

Owns the `swapped` queue and the preemption counter; the scheduler owns `waiting` and `running`
and hands them in. Writes a preempted or resumed sequence's progress through `set_progress`
(core/progress.py), as the scheduler's other parts do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tessera.config import PreemptionMode, SchedulerConfig
from tessera.core.admission import reject_reason
from tessera.core.block_manager import AllocStatus, BlockManager
from tessera.core.lora_admission import LoRAAdmission
from tessera.core.progress import set_progress
from tessera.core.remote_kv import RemoteKVTracker
from tessera.core.request_queue import RequestQueue
from tessera.core.runner_view import RunnerView
from tessera.core.scheduler_output import SchedulerOutput
from tessera.core.token_budget import Budget, Plan, plan_tokens
from tessera.sequence import SequenceGroup, SequenceStatus

_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
_SWAPPED = SequenceStatus.SWAPPED


class Preemption:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, runner: RunnerView,
        waiting: RequestQueue[SequenceGroup], remote_kv: RemoteKVTracker,
        lora: LoRAAdmission | None, key: Callable[[SequenceGroup], tuple[int, float]] | None,
    ) -> None:
        """`waiting`: the scheduler's queue, where a recomputed request goes back to the head.
        `key`: the priority policy's order (swapped groups resume in it), None under FCFS."""
        self.config = config
        self.block_manager = block_manager
        self._runner = runner
        self._waiting = waiting
        self._remote_kv = remote_kv
        self._lora = lora
        self._key = key
        self.swapped: deque[SequenceGroup] = deque()  # oldest (best) first
        self.num_preemptions_total = 0

    def preempt_for_priority(self, running: list[SequenceGroup], out: SchedulerOutput) -> None:
        """Step 0 (priority policy): preempt the worst running groups, popped off the tail of
        the scheduler's `running`, while the best waiting one is strictly better and cannot fit
        otherwise."""
        bm = self.block_manager
        waiting = self._waiting
        num_seqs = sum(g.max_num_running_seqs() for g in running)
        reserved = sum(bm.num_append_blocks(g) for g in running)  # for this step's decodes
        while waiting and running:
            head, tail = waiting.peek(), running[-1]
            if head.priority >= tail.priority or reject_reason(head, self.config) is not None:
                return
            status = bm.can_allocate(head, reserved, whole=self._remote_kv.pulls_whole(head))
            if status is AllocStatus.NEVER:
                return
            if status is AllocStatus.OK and (
                num_seqs + head.max_num_running_seqs() <= self.config.max_num_seqs
            ):
                return
            running.pop()
            num_seqs -= tail.max_num_running_seqs()
            reserved -= bm.num_append_blocks(tail)
            self.preempt(tail, out, alone=False)

    def preempt(self, group: SequenceGroup, out: SchedulerOutput, alone: bool) -> None:
        """Take a running group off the device. `alone`: no other group holds device blocks, so
        swapping would only bring it back to the same full pool; recompute it instead."""
        mode = self.config.preemption_mode or PreemptionMode.SWAP
        if mode is PreemptionMode.SWAP and (alone or not self.block_manager.can_swap_out(group)):
            mode = PreemptionMode.RECOMPUTE  # never abort for lack of swap space
        if mode is PreemptionMode.SWAP:
            for seq in group.seqs:  # drafts are proposed afresh after the group resumes
                seq.spec_token_ids = []
            self.block_manager.swap_out(group, out.blocks_to_swap_out)
            for seq in group.seqs:
                if seq.status is _RUNNING:
                    set_progress(seq, seq.num_computed_tokens, _SWAPPED)
                    self._runner.preempted(seq)
            self.swapped.append(group)
            out.num_swapped_out += 1
        else:
            self.recompute(group)
        out.preempted_request_ids.append(group.request_id)
        self.num_preemptions_total += 1

    def recompute(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            if not seq.is_finished():
                self.block_manager.free(seq)
                self._runner.preempted(seq)
                # its KV is gone: the whole sequence (prompt + output so far) is prefilled again
                set_progress(seq, 0, _WAITING)
                seq.spec_token_ids = []
        self._waiting.prepend(group)  # keeps its place ahead of newer arrivals

    def blocks_admission(self, head: SequenceGroup) -> bool:
        """New admissions wait while anything is swapped (under priority: anything not worse
        than the waiting head)."""
        if not self.swapped:
            return False
        if self._key is None:
            return True
        return min(g.priority for g in self.swapped) <= head.priority

    def resume_swapped(
        self, out: SchedulerOutput, budget: Budget, scheduled: list[tuple[SequenceGroup, Plan]],
        num_running: int,
    ) -> list[SequenceGroup]:
        """Step 2: swap groups back in, oldest first, while blocks (with watermark), budget and
        seats allow; each is planned into `scheduled`. Returns them, in order, for the scheduler
        to put back into `running` (`num_running`: the groups running before this pass)."""
        bm = self.block_manager
        lora = self._lora
        if self._key is not None and len(self.swapped) > 1:
            self.swapped = deque(sorted(self.swapped, key=self._key))
        resumed: list[SequenceGroup] = []
        while self.swapped and budget.tokens > 0:
            group = self.swapped[0]
            n = group.max_num_running_seqs()
            if budget.num_seqs + n > self.config.max_num_seqs:
                break
            if lora is not None and not lora.may_run(group):
                lora.held(group)
                break  # swapped groups resume in order
            alone = not num_running and not resumed
            if not bm.can_swap_in(group, use_watermark=not alone):
                if alone:  # cannot come back even to an empty device: start it over instead
                    self.swapped.popleft()
                    self.recompute(group)
                    continue
                break
            seqs = [s for s in group.seqs if s.status is _SWAPPED]
            plan = plan_tokens(seqs, budget.tokens, self.config.enable_chunked_prefill)
            if not plan:
                break
            self.swapped.popleft()
            bm.swap_in(group, out.blocks_to_swap_in)
            out.num_swapped_in += 1
            if lora is not None:
                lora.admitted(group)
            for seq in seqs:
                set_progress(seq, seq.num_computed_tokens, _RUNNING)
            copies = bm.try_append_slots(group)
            assert copies is not None, "can_swap_in reserved a block per sequence"
            out.blocks_to_copy += copies
            scheduled.append((group, plan))
            budget.tokens -= sum(n for _, n in plan)
            resumed.append(group)
            budget.num_seqs += n
        return resumed
