"""The simulator: the real `tessera.core.Scheduler` on a virtual clock.

    arrivals (dataset + arrival process) ─▶ Scheduler.add_seq_group at their virtual time
    loop:  out = scheduler.schedule()                      the real scheduler, unchanged
           batch, runner_out = SyntheticRunner.execute(out) no model: a BatchShape and tokens
           clock += cost_model.step_time(batch)            the only place time passes
           scheduler.update_from_output(out, runner_out)   the real progress writer
           record token times, queue lengths, KV usage, batch size

Nothing here decides what runs: admission, budgets, chunking, preemption (swap or recompute),
prefix-cache hits and stop rules are the scheduler's own code, so the simulation cannot drift
from the engine. Time jumps to the next arrival when nothing is left to run. Requests are sent as
`tessera bench serve` sends them: at their arrival offsets, under an optional concurrency cap
(a capped request is sent when a running one finishes), with `max_tokens` = the dataset's output
length and `ignore_eos`.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass, field
from typing import Protocol

from tessera.config import EngineConfig
from tessera.core.admission import draft_pool_blocks
from tessera.core.context_sharing import BlockTables
from tessera.core.core_output import EngineCoreOutput
from tessera.core.scheduler import Scheduler
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceGroup, new_seq_id
from tessera.simulator.batch import AcceptanceModel, BatchShape, SyntheticRunner
from tessera.simulator.cost_model import CostModel


class StepObserver(Protocol):
    def on_step(self, out: SchedulerOutput, core_outputs: list[EngineCoreOutput], start: float,
                end: float) -> None:
        """After `update_from_output`: the step ran from `start` to `end` (virtual seconds)."""


class VirtualClock:
    """The scheduler's injected clock: time is whatever the simulator last set."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class SimRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float  # seconds from the start (before any concurrency cap delays it)


def sim_group(request_id: str, req: SimRequest, arrival: float, max_tokens: int | None = None,
              kv_transfer_params: dict | None = None) -> SequenceGroup:
    """A simulated request as the engine would hold it: greedy, EOS ignored (the tokens are
    synthetic), `max_tokens` (the request's own unless given)."""
    params = SamplingParams(max_tokens=req.max_tokens if max_tokens is None else max_tokens,
                            ignore_eos=True, temperature=0.0, kv_transfer_params=kv_transfer_params)
    return SequenceGroup(request_id=request_id,
                         seqs=[Sequence(new_seq_id(), list(req.prompt_token_ids))],
                         sampling_params=params, arrival_time=arrival)


@dataclass
class RequestRecord:
    """What the client of one request would have seen, in virtual seconds."""

    prompt_len: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    first_scheduled: float | None = None  # engine clock, as the server's queue-time histogram
    error: str | None = None

    def record(self, out: EngineCoreOutput, t: float) -> bool:
        """A step's output for this request, ended at `t`; True if the request finished."""
        for delta in out.seqs:
            if delta.new_token_ids:
                self.token_times.extend([t] * len(delta.new_token_ids))
        if out.error is not None:
            self.error = out.error
        if out.finished:
            self.finished = t
            if out.metrics is not None:
                self.first_scheduled = out.metrics.first_scheduled_time
        return out.finished


@dataclass
class Timeline:
    """One row per step (at the step's end)."""

    time: list[float] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    num_running: list[int] = field(default_factory=list)
    num_swapped: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    batch_seqs: list[int] = field(default_factory=list)
    batch_tokens: list[int] = field(default_factory=list)

    def sample(self, t: float, sched: Scheduler, batch: BatchShape) -> None:
        """One row: the queues after a step that ended at `t` (a request waiting for its
        remote KV counts as waiting), and that step's batch."""
        s = sched.stats()
        self.time.append(t)
        self.num_waiting.append(s.num_waiting + s.num_waiting_for_remote_kvs)
        self.num_running.append(s.num_running)
        self.num_swapped.append(s.num_swapped)
        self.kv_usage.append(s.gpu_usage)
        self.batch_seqs.append(batch.num_seqs)
        self.batch_tokens.append(batch.num_tokens)


@dataclass
class SimOutcome:
    records: list[RequestRecord]
    timeline: Timeline
    duration_s: float  # virtual: first send to last token
    wall_time_s: float  # how long simulating took
    num_steps: int
    counters: dict[str, float]


class Simulator:
    def __init__(self, config: EngineConfig, cost_model: CostModel, num_gpu_blocks: int,
                 num_cpu_blocks: int, max_concurrency: int | None = None,
                 acceptance: AcceptanceModel | None = None) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
        self.config = config
        self.cost_model = cost_model
        self.clock = VirtualClock()
        # a draft model with a window: its own pool, as the engine sizes it
        num_draft_blocks = draft_pool_blocks(config, num_gpu_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, num_gpu_blocks, num_cpu_blocks,
                                   clock=self.clock, num_draft_gpu_blocks=num_draft_blocks)
        self.runner = SyntheticRunner(cost_model.geometry.pool_block_bytes(config.cache),
                                      acceptance, config.speculative,
                                      BlockTables.for_cache(config.cache, num_draft_blocks))
        self.max_concurrency = max_concurrency

    def run(self, requests: list[SimRequest], record_timeline: bool = True,
            probe: SimRequest | None = None, observer: StepObserver | None = None) -> SimOutcome:
        """Simulate until every request is done. With `probe`, first run that one request alone
        to its end and start the arrivals after it, as bench serve sends its test request
        before the trace (on a prefix workload it warms the prefix cache). `observer` sees
        every step of the trace (not the probe's), e.g. the dashboard's frames.

        The cyclic garbage collector is paused meanwhile (and the requests frozen out of its
        way, as the engine does after start-up): its full collections walk every live request
        and halved the simulation's speed (3,000 ShareGPT requests: 13.9 -> 6.9 s of CPU); the
        loop makes no reference cycles worth collecting."""
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            if probe is not None:
                start = self._run_probe(probe)
                requests = [dataclasses.replace(r, arrival_time=r.arrival_time + start)
                            for r in requests]
            return self._run(requests, record_timeline, observer)
        finally:
            gc.enable()
            gc.unfreeze()

    def _run_probe(self, probe: SimRequest) -> float:
        """Run `probe` alone from time 0; the time it finished."""
        sched, clock = self.scheduler, self.clock
        sched.add_seq_group(
            sim_group("probe", probe, clock.now + self.cost_model.request_latency_s)
        )
        clock.now += self.cost_model.request_latency_s
        while sched.has_unfinished_seqs():
            out = sched.schedule()
            batch, runner_out = self.runner.execute(out)
            clock.now += self.cost_model.step_time(batch)
            sched.update_from_output(out, runner_out)
        return clock.now

    def _run(self, requests: list[SimRequest], record_timeline: bool,
             observer: StepObserver | None = None) -> SimOutcome:
        start_wall = time.perf_counter()
        order = sorted(range(len(requests)), key=lambda k: requests[k].arrival_time)
        records = [RequestRecord(len(r.prompt_token_ids)) for r in requests]
        by_id = {str(k): records[k] for k in range(len(requests))}
        sched, runner, clock, cost = self.scheduler, self.runner, self.clock, self.cost_model
        tl = Timeline()
        cap = self.max_concurrency
        in_flight = 0
        room_since = 0.0  # since when the concurrency cap has had room
        nxt = 0  # index into `order` of the next request to send
        t = 0.0
        num_steps = idle_steps = 0
        latency = cost.request_latency_s

        def sent_at(k: int) -> float:  # when the client sends request k
            arrival = requests[k].arrival_time
            return max(arrival, room_since) if cap is not None else arrival

        while True:
            while nxt < len(order) and sent_at(order[nxt]) + latency <= t:
                if cap is not None and in_flight >= cap:
                    break
                k = order[nxt]
                req = requests[k]
                sent = sent_at(k)
                records[k].sent = sent
                # the engine sees the request `latency` after its send (HTTP, tokenizer)
                sched.add_seq_group(sim_group(str(k), req, sent + latency))
                in_flight += 1
                nxt += 1
            if not sched.has_unfinished_seqs():
                if nxt >= len(order):
                    break
                t = clock.now = max(t, sent_at(order[nxt]) + latency)
                continue
            out = sched.schedule()
            batch, runner_out = runner.execute(out)
            dt = cost.step_time(batch)
            t = clock.now = t + dt
            core_outputs = sched.update_from_output(out, runner_out)
            num_steps += 1
            if observer is not None:
                observer.on_step(out, core_outputs, t - dt, t)
            for core in core_outputs:
                if by_id[core.request_id].record(core, t):
                    if cap is not None and in_flight == cap:
                        room_since = t
                    in_flight -= 1
            if record_timeline:
                tl.sample(t, sched, batch)
            if dt == 0.0 and not core_outputs:
                idle_steps += 1  # nothing ran and nothing changed: only an arrival can help
                if nxt < len(order):
                    t = clock.now = max(t, sent_at(order[nxt]) + latency)
                elif idle_steps > 3:
                    raise RuntimeError("the scheduler makes no progress and no request is left "
                                       "to arrive")
            else:
                idle_steps = 0
        s = sched.stats()
        counters = {
            "num_preemptions": s.num_preemptions_total,
            "prompt_tokens_computed": s.num_prompt_tokens_total,
            "generation_tokens": s.num_generation_tokens_total,
            "prefix_cache_queries": s.num_prefix_cache_queries_total,
            "prefix_cache_hits": s.num_prefix_cache_hits_total,
            "spec_decode_num_draft_tokens": s.num_spec_draft_tokens_total,
            "spec_decode_num_accepted_tokens": s.num_spec_accepted_tokens_total,
        }
        first = min((r.sent for r in records), default=0.0)
        return SimOutcome(records, tl, max(t - first, 1e-9), time.perf_counter() - start_wall,
                          num_steps, counters)
