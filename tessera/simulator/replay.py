"""`tessera simulate --replay FILE`: a real run's trace through the real scheduler on a virtual
clock whose steps take the logged times, held to the real schedule step by step.

    the step log (tessera serve --step-log)     the replay
    arrival at t, its prompt ids      ─▶  Scheduler.add_seq_group when the virtual clock reaches t
    step k: its requests and tokens    ─▶  out = scheduler.schedule()  (compared with step k)
            its wall time              ─▶  clock += the logged time of step k (LoggedStepTimes)
            the tokens it produced     ─▶  ReplayRunner answers them, so prefix hashes are the real
                                           ones and each stream ends at its logged length
    abort at t                         ─▶  Scheduler.abort_seq_group at t

If the simulator is what it claims (the scheduler's own code, no re-implementation), the
schedule comes out identical and every request's TTFT and end-to-end latency match the logged
ones. The clock takes two more logged delays besides the steps: the engine's wake-up after
idling (`LoggedStepTimes.wake_time`) and the loop between a step's end and the next one's start
(tokens are out at a step's end; the next step starts after the gap). What is left is the
arrival jitter: a request the real engine took just before a step may, in floating point or
after a divergence, land just after it. The report says how far each request is
off (median and p99 of the relative error of TTFT, TPOT and E2E) and the first step whose
scheduled requests, token counts or preemptions differ. After that step the logged times no
longer belong to the simulated steps: the clock then goes on taking them in order, and, past
the log's last step, prices steps with a fit to the logged ones.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

from tessera.core.context_sharing import BlockTables
from tessera.core.scheduler import Scheduler
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceGroup, child_req_id, new_seq_id
from tessera.simulator.batch import BatchShape, SyntheticRunner
from tessera.simulator.cost_model import FEATURES, features
from tessera.simulator.fit import fit_step_times
from tessera.simulator.simulator import VirtualClock
from tessera.simulator.trace import Step, Trace

# a request's TTFT and E2E count as reproduced within this fraction or this many seconds,
# whichever is larger
REL_TOLERANCE, ABS_TOLERANCE_S = 0.05, 0.020


class LoggedStepTimes:
    """The cost model of a replay: the k-th step takes the logged step k's time. Past the last
    logged step (a diverged replay can run more), a non-negative fit over `FEATURES` to the
    logged steps prices the rest.

    It also gives the engine's wake-up: a step that follows an idle engine began some time after
    the request that woke it was added (the engine thread wakes, and takes every request queued
    meanwhile). `wake_time` is that delay of the next step as logged: from the first event after
    the previous step's end to its start (0 past the log or after a busy step)."""

    name = "replay"

    def __init__(self, trace: Trace) -> None:
        self.seconds = [s.seconds for s in trace.steps]
        self.trace = trace
        self._next = 0
        self._coefs = None
        self.own_time = 0.0
        events = sorted([a.time for a in trace.arrivals] + [t for t, _ in trace.aborts])
        self.wakes = []
        previous_end = float("-inf")
        for k, step in enumerate(trace.steps):
            woke_by = next((t for t in events if t > previous_end), None)
            idle_before = k == 0 or not trace.steps[k - 1].busy
            self.wakes.append(max(0.0, step.start - woke_by)
                              if idle_before and woke_by is not None else 0.0)
            previous_end = step.end

    def wake_time(self) -> float:
        return self.wakes[self._next] if self._next < len(self.wakes) else 0.0

    def step_time(self, batch: BatchShape) -> float:
        """The step's time: from its start to the next step's (or, before idling, its end).
        `own_time` is the part up to its own end, when its tokens were out."""
        if self._next < len(self.seconds):
            step = self.trace.steps[self._next]
            self._next += 1
            self.own_time = step.end - step.start
            return self.seconds[self._next - 1]
        if self._coefs is None:
            from tessera.simulator.step_fit import logged_batch

            rows = [features(logged_batch(s)) for s in self.trace.steps]
            times = [max(s.seconds, 1e-6) for s in self.trace.steps]
            self._coefs = (fit_step_times(rows, times)[0] if len(rows) >= len(FEATURES)
                           else [statistics.median(times or [0.0])] + [0.0] * (len(FEATURES) - 1))
        self.own_time = float(sum(c * x for c, x in zip(self._coefs, features(batch),
                                                        strict=True)))
        return self.own_time


class ReplayRunner(SyntheticRunner):
    """The synthetic runner, answering each stream's logged tokens in order (synthetic ones once
    a stream has used up its log)."""

    def __init__(self, block_bytes: int, tokens: dict[str, list[int]],
                 block_tables: BlockTables | None = None) -> None:
        super().__init__(block_bytes, block_tables=block_tables)
        self.tokens = tokens
        self.cursor: dict[str, int] = {}

    def _next_token(self, req_id: str) -> int:
        k = self.cursor.get(req_id, 0)
        self.cursor[req_id] = k + 1
        logged = self.tokens.get(req_id, ())
        return logged[k] if k < len(logged) else 1

    def execute(self, out: SchedulerOutput):
        shape, result = super().execute(out)
        for i, req_id in enumerate(result.req_ids):
            k = len(result.sampled_token_ids[i])
            if k == 1:
                result.sampled_token_ids[i] = [self._next_token(req_id)]
            else:  # the step that completes an n > 1 prompt: one first token per child
                result.sampled_token_ids[i] = [self._next_token(child_req_id(req_id, j))
                                               for j in range(k)]
        return shape, result


@dataclass
class ReplayOutcome:
    steps: list[tuple[list, list[str]]]  # per simulated step: schedule() as Step gives it
    first_token: dict[str, float] = field(default_factory=dict)  # request_id -> time
    finished: dict[str, float] = field(default_factory=dict)
    num_tokens: dict[str, int] = field(default_factory=dict)  # stream 0's output length
    num_preemptions: int = 0
    wall_time_s: float = 0.0


def replay(trace: Trace) -> ReplayOutcome:
    """Run the trace through a fresh `Scheduler` built from the log's configs and pool sizes."""
    if any(a.n < 1 for a in trace.arrivals):
        raise ValueError(f"--replay {trace.path}: a request with n < 1")
    h = trace.header
    clock = VirtualClock()
    sched = Scheduler(trace.scheduler_config(), trace.cache_config(), h["num_gpu_blocks"],
                      h["num_cpu_blocks"], clock=clock,
                      num_draft_gpu_blocks=h.get("num_draft_gpu_blocks", 0))
    runner = ReplayRunner(trace.block_bytes, trace.output_tokens(),
                          BlockTables.for_cache(trace.cache_config(),
                                                h.get("num_draft_gpu_blocks", 0)))
    cost = LoggedStepTimes(trace)
    final = trace.final_lengths()
    streams: dict[str, tuple[str, int]] = {}  # req_id -> (request_id, index)
    events = sorted([(a.time, 0, a) for a in trace.arrivals]
                    + [(t, 1, ids) for t, ids in trace.aborts], key=lambda e: (e[0], e[1]))
    clock.now = events[0][0] if events else 0.0
    result = ReplayOutcome(steps=[])
    have: dict[str, int] = {}  # req_id -> output tokens so far
    done: set[str] = set()
    nxt = idle = 0
    woke = True  # the engine starts idle: the first event wakes it
    start_wall = time.perf_counter()
    gc.disable()  # as Simulator.run: the loop makes no cycles worth a full collection
    try:
        while True:
            while nxt < len(events) and events[nxt][0] <= clock.now:
                _, kind, item = events[nxt]
                nxt += 1
                if kind == 1:
                    sched.abort_seq_group(item)
                    continue
                for j in range(item.n):
                    streams[child_req_id(item.request_id, j)] = (item.request_id, j)
                sched.add_seq_group(SequenceGroup(
                    request_id=item.request_id,
                    seqs=[Sequence(new_seq_id(), list(item.prompt_token_ids))],
                    sampling_params=SamplingParams(
                        n=item.n, max_tokens=item.max_tokens, ignore_eos=True,
                        temperature=0.0 if item.n == 1 else 1.0,
                        prompt_logprobs=0 if item.prompt_logprobs else None),
                    arrival_time=item.arrival_time, priority=item.priority))
            if not sched.has_unfinished_seqs():
                if nxt >= len(events):
                    break
                clock.now = max(clock.now, events[nxt][0])
                woke = True
                continue
            if woke:  # the engine's wake-up, as logged; then the requests queued meanwhile
                woke = False
                clock.now += cost.wake_time()
                continue
            out = sched.schedule()
            if not out.total_num_scheduled_tokens:  # not logged: no clock, no comparison
                sched.update_from_output(out, runner.execute(out)[1])
                idle += 1  # nothing could run: only an arrival or an abort can change that
                if nxt < len(events):
                    clock.now = max(clock.now, events[nxt][0])
                    woke = True
                elif idle > 3:
                    raise RuntimeError(f"--replay {trace.path}: the scheduler makes no "
                                       "progress and no event is left")
                continue
            idle = 0
            batch, runner_out = runner.execute(out)
            start = clock.now
            clock.now += cost.step_time(batch)
            done_at = start + cost.own_time  # its tokens; the rest is the loop until the next
            core_outputs = sched.update_from_output(out, runner_out)
            result.steps.append((sorted((r, n, c) for r, n, c in _reqs(out)),
                                 sorted(out.preempted_request_ids)))
            result.num_preemptions += out.num_preemptions
            stops = []
            for core in core_outputs:
                for delta in core.seqs:
                    req_id = child_req_id(core.request_id, delta.index)
                    if delta.new_token_ids:
                        have[req_id] = have.get(req_id, 0) + len(delta.new_token_ids)
                        if delta.index == 0:
                            result.first_token.setdefault(core.request_id, done_at)
                            result.num_tokens[core.request_id] = have[req_id]
                    if delta.finish_reason is not None:
                        done.add(req_id)
                    elif req_id in final and have.get(req_id, 0) >= final[req_id]:
                        # it ended here in the real run (EOS, a stop token or string)
                        stops.append((core.request_id, delta.index, ""))
                        done.add(req_id)
                if core.finished:
                    result.finished[core.request_id] = done_at
            if stops:
                sched.finish_seqs(stops)
                for request_id, _, _ in stops:
                    group = [r for r, (q, _) in streams.items() if q == request_id]
                    if all(r in done for r in group):
                        result.finished.setdefault(request_id, done_at)
    finally:
        gc.enable()
    result.wall_time_s = time.perf_counter() - start_wall
    return result


def _reqs(out: SchedulerOutput):
    computed = out.num_computed_tokens_by_req()
    return [(r, n, computed[r]) for r, n in out.num_scheduled_tokens.items()]


def first_divergence(logged: list[Step], simulated: list[tuple[list, list[str]]]) -> dict | None:
    """The first step whose scheduled (req_id, new, computed) or preemptions differ, with both
    sides; None when the schedules are identical (the same steps, the same length)."""
    for k in range(max(len(logged), len(simulated))):
        real = logged[k].schedule() if k < len(logged) else None
        sim = simulated[k] if k < len(simulated) else None
        if real is None or sim is None or (list(real[0]), list(real[1])) != (list(sim[0]),
                                                                              list(sim[1])):
            def side(s):
                return None if s is None else {"reqs": [list(r) for r in s[0]],
                                               "preempted": list(s[1])}
            return {"step": k, "real": side(real), "simulated": side(sim)}
    return None


def real_request_times(trace: Trace) -> tuple[dict, dict, dict]:
    """From the log: request_id -> first token time, finish time and stream 0's output
    length (tokens are timed at the end of the step that produced them)."""
    first, finished, num_tokens = {}, {}, {}
    streams = {child_req_id(a.request_id, j): a for a in trace.arrivals for j in range(a.n)}
    ends: dict[str, set[str]] = {}
    for step in trace.steps:
        for req_id, ids in step.tokens.items():
            a = streams.get(req_id)
            if a is not None and req_id == a.request_id and ids:
                first.setdefault(a.request_id, step.end)
                num_tokens[a.request_id] = num_tokens.get(a.request_id, 0) + len(ids)
        for req_id in step.finished:
            a = streams.get(req_id)
            if a is not None:
                ends.setdefault(a.request_id, set()).add(req_id)
                if len(ends[a.request_id]) == a.n:
                    finished[a.request_id] = step.end
    return first, finished, num_tokens


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def compare(trace: Trace, outcome: ReplayOutcome) -> dict:
    """The replay against the log: per-request relative errors (median, p99) of TTFT, TPOT and
    E2E, how many requests miss the tolerance, preemptions on both sides and the first
    divergent step."""
    first, finished, num_tokens = real_request_times(trace)
    arrival = {a.request_id: a.arrival_time for a in trace.arrivals}
    errors: dict[str, list[float]] = {"ttft": [], "tpot": [], "e2el": []}
    misses: dict[str, list[str]] = {"ttft": [], "e2el": []}
    worst: dict[str, float] = {"ttft": 0.0, "e2el": 0.0}
    requests = []
    for rid, end in finished.items():
        if rid not in first or rid not in outcome.finished or rid not in outcome.first_token:
            continue
        real = {"ttft": first[rid] - arrival[rid], "e2el": end - arrival[rid]}
        sim = {"ttft": outcome.first_token[rid] - arrival[rid],
               "e2el": outcome.finished[rid] - arrival[rid]}
        if num_tokens.get(rid, 0) > 1 and outcome.num_tokens.get(rid, 0) > 1:
            real["tpot"] = (real["e2el"] - real["ttft"]) / (num_tokens[rid] - 1)
            sim["tpot"] = (sim["e2el"] - sim["ttft"]) / (outcome.num_tokens[rid] - 1)
        for key, value in real.items():
            if value > 0:
                errors[key].append(abs(sim[key] - value) / value)
        for key in misses:
            off = abs(sim[key] - real[key])
            worst[key] = max(worst[key], off)
            if off > max(REL_TOLERANCE * real[key], ABS_TOLERANCE_S):
                misses[key].append(rid)
        requests.append({"request_id": rid, "real": real, "simulated": sim})
    real_preemptions = sum(len(s.preempted) for s in trace.steps)
    return {
        "log": trace.path, "num_requests": len(requests), "num_logged_steps": len(trace.steps),
        "num_simulated_steps": len(outcome.steps),
        "relative_error": {k: {"median": _quantile(v, 0.5), "p99": _quantile(v, 0.99)}
                           for k, v in errors.items()},
        "worst_abs_error_ms": {k: 1e3 * v for k, v in worst.items()},
        "tolerance": {"relative": REL_TOLERANCE, "absolute_s": ABS_TOLERANCE_S},
        "misses": misses,
        "num_preemptions": {"real": real_preemptions, "simulated": outcome.num_preemptions},
        "first_divergence": first_divergence(trace.steps, outcome.steps),
        "unfinished_in_log": sorted(set(arrival) - set(finished)),
        "wall_time_s": outcome.wall_time_s, "requests": requests,
    }


def format_report(report: dict) -> str:
    """The table `tessera simulate --replay` prints."""
    lines = [f"replay of {report['log']}: {report['num_requests']} finished requests, "
             f"{report['num_logged_steps']} logged steps, {report['num_simulated_steps']} "
             f"simulated (in {report['wall_time_s']:.2f} s)",
             f"{'metric':<8} {'median err':>11} {'p99 err':>9} {'worst':>10} {'misses':>7}"]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E")):
        e = report["relative_error"][key]
        worst = report["worst_abs_error_ms"].get(key)
        miss = report["misses"].get(key)
        lines.append(f"{label:<8} {100 * e['median']:10.2f}% {100 * e['p99']:8.2f}% "
                     f"{'' if worst is None else f'{worst:.1f} ms':>10} "
                     f"{'' if miss is None else len(miss):>7}")
    p = report["num_preemptions"]
    lines.append(f"preemptions: real {p['real']}, simulated {p['simulated']}")
    d = report["first_divergence"]
    lines.append("schedules: identical, step by step" if d is None else
                 f"schedules diverge at step {d['step']}: real {d['real']}, simulated "
                 f"{d['simulated']}")
    t = report["tolerance"]
    lines.append(f"misses: requests whose TTFT or E2E is off by more than "
                 f"{100 * t['relative']:.0f}% or {1e3 * t['absolute_s']:.0f} ms, whichever is "
                 "larger")
    return "\n".join(lines)


# the flags `tessera simulate --replay` takes; the engine's configuration, the requests and
# their times all come from the log
REPLAY_FLAGS = ("replay", "result_file", "quiet")


def replay_main(args) -> int:
    """`tessera simulate --replay FILE [--result-file JSON] [--quiet]`."""
    import json

    from tessera.simulator.trace import read_trace

    parser = args.parser
    for action in parser._actions:
        if (action.dest in REPLAY_FLAGS or not action.option_strings
                or action.dest == "help"):
            continue
        if getattr(args, action.dest, action.default) != action.default:
            parser.error(f"--replay takes the engine flags and the requests from the log: "
                         f"{action.option_strings[-1]} cannot be combined with it")
    try:
        trace = read_trace(args.replay)
        report = compare(trace, replay(trace))
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if not args.quiet:
        print(format_report(report))
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0
