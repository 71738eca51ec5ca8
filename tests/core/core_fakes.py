"""Tiny builders and a fake model runner for the scheduler tests (no model, no tensors)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tessera.config import CacheConfig, PreemptionMode, SchedulerConfig, SchedulingPolicy
from tessera.core.scheduler import Scheduler
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class FakeParams:
    """Stands in for SamplingParams: the scheduler only reads `n`."""

    n: int = 1
    max_tokens: int = 8


_seq_ids = itertools.count(1)


def make_group(
    req_id: str,
    prompt_len: int,
    *,
    n: int = 1,
    max_tokens: int = 8,
    arrival: float = 0.0,
    priority: int = 0,
    prompt: list[int] | None = None,
) -> SequenceGroup:
    tokens = list(prompt) if prompt is not None else [hash(req_id) % 1000 + i for i in range(prompt_len)]
    seq = Sequence(seq_id=next(_seq_ids), prompt_token_ids=tokens)
    return SequenceGroup(
        request_id=req_id,
        seqs=[seq],
        sampling_params=FakeParams(n=n, max_tokens=max_tokens),  # type: ignore[arg-type]
        arrival_time=arrival,
        priority=priority,
    )


def make_scheduler(
    *,
    block_size: int = 4,
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    chunked: bool = False,
    mode: PreemptionMode | None = None,
    priority: bool = False,
    prefix: bool = False,
    watermark: float = 0.0,
) -> Scheduler:
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        scheduling_policy=SchedulingPolicy.PRIORITY if priority else SchedulingPolicy.FCFS,
    )
    cache_cfg = CacheConfig(
        block_size=block_size, enable_prefix_caching=prefix, watermark=watermark
    )
    clock = itertools.count()
    return Scheduler(sched_cfg, cache_cfg, num_gpu_blocks, num_cpu_blocks, clock=lambda: float(next(clock)))


class FakeRunner:
    """Plays the engine around `schedule()`: update, sample a fake token where the step completes
    a sequence, fork the n-1 children after the first sample, finish at max_tokens, free."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.finished: list[SequenceGroup] = []

    def step(self) -> SchedulerOutput:
        sched = self.scheduler
        out = sched.schedule()
        sampled = [(sg.group, ss.seq) for sg in out.scheduled_groups for ss in sg.seqs if ss.do_sample]
        sched.update_after_step(out)
        for group, seq in sampled:
            seq.append_token(7 + seq.get_len() % 13)
            n = getattr(group.sampling_params, "n", 1)
            if len(group.seqs) == 1 and n > 1 and seq.get_output_len() == 1:
                for _ in range(n - 1):
                    child = seq.fork(next(_seq_ids))
                    sched.fork_seq(group, seq, child)
        for group, _ in sampled:
            for s in group.seqs:
                if s.status is SequenceStatus.RUNNING and s.get_output_len() >= group.sampling_params.max_tokens:
                    s.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        self.finished += sched.free_finished_seq_groups()
        return out

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.scheduler.has_unfinished_seqs():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps


def scheduled_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {sg.group.request_id: sg.num_new_tokens for sg in out.scheduled_groups}
