"""Scheduler cost per step, with the simulator's synthetic runner (no model): µs for `schedule()` +
`update_from_output()` (which appends the sampled tokens, applies the stop rules and frees what
finished), and for the whole fake step (also the fake runner turning the message into its output);
and the cost of aborting every request of a long waiting queue.

Targets: <= 500 µs per step at 256 running and 2,000 waiting; flat in the waiting queue
(1,000 vs 10,000 waiting within 20%).

    .venv/bin/python benchmarks/scheduler.py [--steps 200] [--repeats 5]

Before the core-boundary redesign (schedule + update_after_step; the engine appended and freed)
aborting all of 2k/4k/8k waiting requests took 0.08/0.28/1.22 s (each abort scanned the queue).

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
from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceGroup, new_seq_id
from tessera.simulator.batch import SyntheticRunner


def _group(ids, rng: random.Random, max_tokens: int, arrival: float) -> SequenceGroup:
    sid = next(ids)
    prompt = [rng.randrange(32000) for _ in range(rng.randint(64, 192))]
    return SequenceGroup(
        request_id=f"r{sid}",
        seqs=[Sequence(seq_id=new_seq_id(), prompt_token_ids=prompt)],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
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
    synthetic = SyntheticRunner(block_bytes=0)

    def runner(out):
        return synthetic.execute(out)[1]

    while len(sched.running) < num_running:  # fill the batch first
        out = sched.schedule()
        sched.update_from_output(out, runner(out))
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
        t1 = timer()
        runner_out = runner(out)
        t2 = timer()
        core_outputs = sched.update_from_output(out, runner_out)
        t3 = timer()
        t_sched += (t1 - t0) + (t3 - t2)
        t_total += t3 - t0
        finished = sum(1 for c in core_outputs if c.finished)
        for _ in range(finished):  # keep the waiting queue at its length
            sched.add_seq_group(_group(ids, rng, new_max_tokens(), float(next(ids))))
    assert len(sched.waiting) >= num_waiting - num_running
    gc.unfreeze()
    return t_sched / steps * 1e6, t_total / steps * 1e6


def abort_all(num_waiting: int, timer=time.perf_counter) -> float:
    """Seconds to abort every request of a waiting queue of `num_waiting` (one call each)."""
    rng = random.Random(0)
    ids = itertools.count()
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=2048),
        CacheConfig(block_size=16), num_gpu_blocks=1024, num_cpu_blocks=0,
    )
    groups = [_group(ids, rng, 16, float(i)) for i in range(num_waiting)]
    for g in groups:
        sched.add_seq_group(g)
    t0 = timer()
    for g in groups:
        sched.abort_seq_group(g.request_id)
    elapsed = timer() - t0
    assert not sched.waiting
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    parser.add_argument("--no-freeze", action="store_true", help="leave the set-up objects to gc")
    args = parser.parse_args()
    timer = time.perf_counter if args.wall else time.process_time
    print(
        f"{'workload':<8} {'waiting':>8} {'sched+update µs':>16} {'whole step µs':>14}   (best of "
        f"{args.repeats})"
    )
    results = {}
    for churn in (False, True):
        for num_waiting in (1_000, 2_000, 10_000):
            runs = [
                run(num_waiting, churn, args.steps, timer=timer, freeze=not args.no_freeze)
                for _ in range(args.repeats)
            ]
            best = min(runs)
            results[(churn, num_waiting)] = best
            name = "churn" if churn else "decode"
            spread = statistics.median(r[0] for r in runs)
            print(
                f"{name:<8} {num_waiting:>8} {best[0]:>16.0f} {best[1]:>14.0f}   (median "
                f"{spread:.0f})"
            )
    for churn in (False, True):
        a, b = results[(churn, 1_000)][0], results[(churn, 10_000)][0]
        name = "churn" if churn else "decode"
        print(f"{name}: 10,000 vs 1,000 waiting: {100 * (b / a - 1):+.1f}%")
    times = {
        n: min(abort_all(n, timer) for _ in range(args.repeats)) for n in (2_000, 4_000, 8_000)
    }
    print("abort every waiting request: " + ", ".join(f"{n}: {t:.4f} s" for n, t in times.items())
          + f"  (8k / 2k = {times[8_000] / times[2_000]:.1f}x; linear is 4x)")


if __name__ == "__main__":
    main()
