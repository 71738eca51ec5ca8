"""Scheduler cost per step, with a fake runner (no model): µs for `schedule()` +
`update_after_step()`, and for the whole fake engine step (also appending a token to each sampled
sequence and `free_finished_seq_groups()`).

Targets (issue 3): <= 500 µs per step at 256 running and 2,000 waiting; flat in the waiting queue
(1,000 vs 10,000 waiting within 20%).

    .venv/bin/python benchmarks/scheduler.py [--steps 200] [--repeats 5]

Times are CPU time of this process (`time.process_time`), best of the repeats: on a shared machine
wall time mostly measures the neighbours. `--wall` reports `perf_counter` instead.

Two workloads: `decode` (256 sequences decoding, none finishes while measured) and `churn`
(requests finish after 16-256 tokens and are replaced from the waiting queue, which is topped up so
its length stays put: admissions, prefills and frees happen every few steps).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import time

from tessera.config import CacheConfig, SchedulerConfig
from tessera.core.scheduler import Scheduler
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus


class _Params:
    def __init__(self, n: int, max_tokens: int) -> None:
        self.n = n
        self.max_tokens = max_tokens


def _group(ids, rng: random.Random, max_tokens: int, arrival: float) -> SequenceGroup:
    sid = next(ids)
    prompt = [rng.randrange(32000) for _ in range(rng.randint(64, 192))]
    return SequenceGroup(
        request_id=f"r{sid}",
        seqs=[Sequence(seq_id=sid, prompt_token_ids=prompt)],
        sampling_params=_Params(1, max_tokens),  # type: ignore[arg-type]
        arrival_time=arrival,
    )


def run(
    num_waiting: int,
    churn: bool,
    steps: int,
    num_running: int = 256,
    timer=time.process_time,
    freeze: bool = True,
) -> tuple[float, float]:
    """Returns (µs per schedule+update, µs per whole fake step), mean over `steps` steps."""
    rng = random.Random(0)
    ids = itertools.count()
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=num_running, max_model_len=2048),
        CacheConfig(block_size=16),
        num_gpu_blocks=num_running * 40,
        num_cpu_blocks=1024,
        clock=itertools.count().__next__,
    )

    def new_max_tokens() -> int:
        return rng.randint(16, 256) if churn else 10**6

    for i in range(num_running + num_waiting):
        sched.add_seq_group(_group(ids, rng, new_max_tokens(), float(i)))
    while len(sched.running) < num_running:  # fill the batch first
        _step(sched)
    # Settle the garbage collector. A full collection walks every live object, so its cost grows
    # with the queue (~5 tracked objects per request): without this, 10,000 waiting costs ~+30%
    # per step, all of it in gc, none in the scheduler. A server does the same after start-up
    # (vLLM calls gc.freeze() once the engine is built); `--no-freeze` shows the difference.
    gc.collect()
    if freeze:
        gc.freeze()
    t_sched = t_total = 0.0
    for _ in range(steps):
        t0 = timer()
        out = sched.schedule()
        sampled = [(sg.group, ss.seq) for sg in out.scheduled_groups for ss in sg.seqs if ss.do_sample]
        sched.update_after_step(out)
        t1 = timer()
        finished = _finish(sched, sampled)
        t2 = timer()
        t_sched += t1 - t0
        t_total += t2 - t0
        for _ in range(finished):  # keep the waiting queue at its length
            sched.add_seq_group(_group(ids, rng, new_max_tokens(), float(next(ids))))
    assert len(sched.waiting) >= num_waiting - num_running
    gc.unfreeze()
    return t_sched / steps * 1e6, t_total / steps * 1e6


def _finish(sched: Scheduler, sampled: list[tuple[SequenceGroup, Sequence]]) -> int:
    """The engine's part: append a token where one was sampled, finish at max_tokens, free."""
    for group, seq in sampled:
        seq.append_token(1)
        if seq.get_output_len() >= group.sampling_params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    return len(sched.free_finished_seq_groups())


def _step(sched: Scheduler) -> None:
    out = sched.schedule()
    sampled = [(sg.group, ss.seq) for sg in out.scheduled_groups for ss in sg.seqs if ss.do_sample]
    sched.update_after_step(out)
    _finish(sched, sampled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    parser.add_argument("--no-freeze", action="store_true", help="leave the set-up objects to gc")
    args = parser.parse_args()
    timer = time.perf_counter if args.wall else time.process_time
    print(f"{'workload':<8} {'waiting':>8} {'sched+update µs':>16} {'whole step µs':>14}   (best of {args.repeats})")
    results = {}
    for churn in (False, True):
        for num_waiting in (1_000, 2_000, 10_000):
            runs = [run(num_waiting, churn, args.steps, timer=timer, freeze=not args.no_freeze) for _ in range(args.repeats)]
            best = min(runs)
            results[(churn, num_waiting)] = best
            name = "churn" if churn else "decode"
            spread = statistics.median(r[0] for r in runs)
            print(f"{name:<8} {num_waiting:>8} {best[0]:>16.0f} {best[1]:>14.0f}   (median {spread:.0f})")
    for churn in (False, True):
        a, b = results[(churn, 1_000)][0], results[(churn, 10_000)][0]
        name = "churn" if churn else "decode"
        print(f"{name}: 10,000 vs 1,000 waiting: {100 * (b / a - 1):+.1f}%")


if __name__ == "__main__":
    main()
