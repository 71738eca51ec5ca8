"""Step 3 of a scheduler step: admitting waiting requests. In policy order, while the budget,
max_num_seqs and free blocks minus the watermark allow, the head of `waiting` gets its blocks
(prefix-cache hits first), starts at the tokens the cache holds, and is planned into the step
(or parked until a peer's KV lands, core/remote_kv.py). A request that can never run is
rejected at once with a reason (core/admission.py). Nothing is admitted while anything is
swapped (under priority: anything not worse), so preempted requests come back first.

With LoRA (--max-loras) only what keeps the running adapters within the limit is admitted
(core/lora_admission.py): a request held back for an adapter slot keeps its place, and younger
ones of running adapters may pass it, up to `LORA_LOOKAHEAD` held back per step so a step's
cost stays bounded. The pass walks only the head of `waiting` it admits or holds back.
"""

from __future__ import annotations

from tessera.config import SchedulerConfig
from tessera.core.admission import never_fits_reason, reject_reason
from tessera.core.block_manager import AllocStatus, BlockManager
from tessera.core.lora_admission import LoRAAdmission
from tessera.core.preemption import Preemption
from tessera.core.progress import set_progress
from tessera.core.remote_kv import RemoteKVTracker
from tessera.core.request_queue import RequestQueue
from tessera.core.scheduler_output import SchedulerOutput
from tessera.core.token_budget import Budget, Plan, plan_tokens
from tessera.sequence import SequenceGroup, SequenceStatus

_WAITING = SequenceStatus.WAITING
_RUNNING = SequenceStatus.RUNNING
LORA_LOOKAHEAD = 64  # most waiting requests held back for an adapter slot that one step passes


class WaitingAdmission:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager,
        waiting: RequestQueue[SequenceGroup], preemption: Preemption,
        remote_kv: RemoteKVTracker, lora: LoRAAdmission | None,
    ) -> None:
        """`waiting`: the scheduler's queue, whose head this pass pops; `preemption`: asked
        whether swapped requests go first."""
        self.config = config
        self.block_manager = block_manager
        self._waiting = waiting
        self._preemption = preemption
        self._remote_kv = remote_kv
        self._lora = lora

    def admit(
        self, out: SchedulerOutput, budget: Budget, scheduled: list[tuple[SequenceGroup, Plan]]
    ) -> tuple[list[SequenceGroup], list[tuple[SequenceGroup, str]]]:
        """Admit from the head of `waiting`, planning each admitted group into `scheduled`.
        Returns the groups to put into `running` (in order; parked ones are not among them)
        and the rejected ones, popped from `waiting`, with the reason: the scheduler finishes
        and drops those."""
        admitted: list[SequenceGroup] = []
        rejected: list[tuple[SequenceGroup, str]] = []
        if self._lora is None:
            self._admit(out, budget, scheduled, [], admitted, rejected)
            return admitted, rejected
        held: list[SequenceGroup] = []  # waiting for an adapter slot: they keep their place
        try:
            self._admit(out, budget, scheduled, held, admitted, rejected)
        finally:
            for group in reversed(held):
                self._waiting.prepend(group)
        return admitted, rejected

    def _admit(
        self, out: SchedulerOutput, budget: Budget, scheduled: list[tuple[SequenceGroup, Plan]],
        held: list[SequenceGroup], admitted: list[SequenceGroup],
        rejected: list[tuple[SequenceGroup, str]],
    ) -> None:
        bm = self.block_manager
        lora = self._lora
        waiting = self._waiting
        while waiting and budget.tokens > 0:
            group = waiting.peek()
            if self._preemption.blocks_admission(group):
                break
            reason = reject_reason(group, self.config)
            status = None
            remote = bool((group.sampling_params.kv_transfer_params or {}).get("do_remote_prefill"))
            whole = remote and self._remote_kv.pulls_whole(group)
            if reason is None:
                status = bm.can_allocate(group, whole=whole)
                if status is AllocStatus.NEVER:
                    reason = never_fits_reason(group, bm)
            if reason is not None:
                waiting.pop()
                rejected.append((group, reason))
                continue
            if lora is not None and not lora.may_run(group):
                if len(held) >= LORA_LOOKAHEAD:
                    break
                lora.held(group)
                held.append(waiting.pop())
                continue
            n = group.max_num_running_seqs()
            if budget.num_seqs + n > self.config.max_num_seqs or status is AllocStatus.LATER:
                break
            seqs = [s for s in group.seqs if s.status is _WAITING]
            if not self.config.enable_chunked_prefill and not remote:
                first = seqs[0]
                if first.get_len() - bm.get_num_cached_tokens(group, first) > budget.tokens:
                    break  # scheduled whole or not at all
            waiting.pop()
            if lora is not None:
                lora.admitted(group)
            hits = 0
            for seq, num_hit_tokens in zip(seqs, bm.allocate(group, whole=whole), strict=True):
                set_progress(seq, num_hit_tokens, _WAITING)  # the cache holds these already
                hits += num_hit_tokens
            out.num_prefix_cache_hit_tokens += hits
            if group.first_scheduled_time is None:
                group.num_cached_tokens = hits
            if self._remote_kv.park(group, seqs, can_pull=whole):  # until its peer's KV arrives
                budget.num_seqs += n
                continue
            for seq in seqs:
                set_progress(seq, seq.num_computed_tokens, _RUNNING)
            plan = plan_tokens(seqs, budget.tokens, self.config.enable_chunked_prefill)
            scheduled.append((group, plan))
            budget.tokens -= sum(n for _, n in plan)
            admitted.append(group)
            budget.num_seqs += n
