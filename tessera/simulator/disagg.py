"""Disaggregated prefill/decode on the virtual clock: a prefill instance and a decode instance,
each the real scheduler with the real connector's scheduler half (tessera/core/kv_connector.py),
joined by a KV link priced by the cost model (`kv_transfer_time`, parallel.py).

    client ─(request_latency_s)─▶ producer: prefill, one token (max_tokens=1, do_remote_decode);
                                  its blocks held for the peer
           ─(request_latency_s)─▶ consumer: admitted with the producer's kv_transfer_params,
                                  parks in WAITING_FOR_REMOTE_KVS; the pull starts with the step
                                  that carries it in `kv_connector_metadata` and lands
                                  kv_transfer_time(its blocks) later, beside the step loop; then
                                  it decodes from prompt - 1, as on the server

The client's TTFT is the consumer's first token: both hops, the producer's queue and prefill, the
consumer's admission, the pull and one decode step. Each instance steps on its own (the one whose
next step starts first goes first; a step is priced when it starts, as in simulator.py). A
producer learns that a pull has finished at its first step that starts after it (on the server:
the step during which it finished), so held blocks may be freed up to one producer step late.
The synthetic runners play the connector's worker half: `finished_recving` for pulls that have
landed by the step's end, `finished_sending` for the producer's blocks a pull has read.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import time

from tessera.config import EngineConfig
from tessera.core.context_sharing import BlockTables
from tessera.core.kv_cache_groups import cache_group_windows
from tessera.core.kv_connector import PullConnectorScheduler
from tessera.core.runner_output import KVTransferStats
from tessera.core.scheduler import Scheduler
from tessera.simulator.batch import SyntheticRunner
from tessera.simulator.cost_model import CostModel
from tessera.simulator.simulator import (
    RequestRecord,
    SimOutcome,
    SimRequest,
    Timeline,
    VirtualClock,
    sim_group,
)


class _Instance:
    """One engine of the pair: its scheduler on its own clock, a synthetic runner, and when it is
    next free."""

    def __init__(self, config: EngineConfig, role: str, cost: CostModel, num_gpu_blocks: int,
                 num_cpu_blocks: int) -> None:
        assert config.kv_transfer is not None
        kv = dataclasses.replace(config.kv_transfer, kv_role=role)
        self.clock = VirtualClock()
        num_groups = len(cache_group_windows(config.cache.sliding_window,
                                             config.cache.layer_windows))
        connector = PullConnectorScheduler(kv, config.cache.block_size, clock=self.clock,
                                           engine_id=role, num_groups=num_groups)
        self.num_groups = num_groups  # pool blocks per token block of every layer
        self.scheduler = Scheduler(config.scheduler, config.cache, num_gpu_blocks,
                                   num_cpu_blocks, clock=self.clock, kv_connector=connector)
        self.runner = SyntheticRunner(cost.geometry.pool_block_bytes(config.cache),
                                      block_tables=BlockTables.for_cache(config.cache))
        self.free_at = 0.0
        self.num_steps = 0
        self.landing: list[tuple[float, str]] = []  # consumer: (when a pull lands, req_id)
        self.read_out: list[tuple[float, str]] = []  # producer: (when a pull read it, req_id)

    def has_work(self) -> bool:
        s = self.scheduler.stats()
        return bool(s.num_waiting or s.num_running or s.num_swapped)

    def next_event(self) -> float:
        """When this instance next has something to do (inf: nothing)."""
        if self.has_work():
            return self.free_at
        pending = [q[0][0] for q in (self.landing, self.read_out) if q]
        return max(self.free_at, min(pending)) if pending else float("inf")


class DisaggSimulator:
    """A P/D pair with the same engine flags on each side (`config.kv_transfer` names the
    connector; the roles are the pair's own)."""

    def __init__(self, config: EngineConfig, cost_model: CostModel, num_gpu_blocks: int,
                 num_cpu_blocks: int) -> None:
        if config.kv_transfer is None:
            raise ValueError("a disaggregated simulation needs --kv-transfer-config")
        self.cost_model = cost_model
        self.block_size = config.cache.block_size
        self.prefill = _Instance(config, "kv_producer", cost_model, num_gpu_blocks, num_cpu_blocks)
        self.decode = _Instance(config, "kv_consumer", cost_model, num_gpu_blocks, num_cpu_blocks)
        self.stats = KVTransferStats()

    def run(self, requests: list[SimRequest], record_timeline: bool = True) -> SimOutcome:
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            return self._run(requests, record_timeline)
        finally:
            gc.enable()
            gc.unfreeze()

    def _run(self, requests: list[SimRequest], record_timeline: bool) -> SimOutcome:
        start_wall = time.perf_counter()
        latency = self.cost_model.request_latency_s
        records = [RequestRecord(len(r.prompt_token_ids), sent=r.arrival_time) for r in requests]
        # (when the instance sees it, request index, kv_transfer_params or None)
        to_prefill = sorted((r.arrival_time + latency, k) for k, r in enumerate(requests))
        to_decode: list[tuple[float, int, dict]] = []
        p, d = self.prefill, self.decode
        tl = Timeline()
        nxt = 0
        t = 0.0
        while True:
            t_arrive_p = to_prefill[nxt][0] if nxt < len(to_prefill) else float("inf")
            t_arrive_d = to_decode[0][0] if to_decode else float("inf")
            t_p, t_d = p.next_event(), d.next_event()
            t = min(t_arrive_p, t_arrive_d, t_p, t_d)
            if t == float("inf"):
                break
            if t == t_arrive_p and t_arrive_p <= t_p:
                _, k = to_prefill[nxt]
                nxt += 1
                self._add(p, k, requests[k], t, max_tokens=1,
                          params={"do_remote_decode": True})
            elif t == t_arrive_d and t_arrive_d <= t_d:
                _, k, params = heapq.heappop(to_decode)
                self._add(d, k, requests[k], t, requests[k].max_tokens, params)
            elif t == t_p:
                for out in self._step(p, t):
                    if out.finished and out.kv_transfer_params:
                        heapq.heappush(to_decode, (p.free_at + latency, int(out.request_id),
                                                   out.kv_transfer_params))
                    elif out.finished:  # rejected or failed on the prefill side
                        records[int(out.request_id)].error = out.error or "prefill failed"
                        records[int(out.request_id)].finished = p.free_at
            else:
                for out in self._step(d, t):
                    records[int(out.request_id)].record(out, d.free_at)
                if record_timeline:
                    tl.sample(d.free_at, d.scheduler, self._last_batch)
        counters: dict[str, float] = {}
        for name, inst in (("prefill", p), ("decode", d)):
            s = inst.scheduler.stats()
            counters[f"{name}_num_preemptions"] = s.num_preemptions_total
            counters[f"{name}_prompt_tokens_computed"] = s.num_prompt_tokens_total
            counters[f"{name}_num_steps"] = inst.num_steps
        counters["num_preemptions"] = counters["prefill_num_preemptions"] + counters[
            "decode_num_preemptions"]
        counters["kv_transfer_requests"] = self.stats.num_requests
        counters["kv_transfer_bytes"] = self.stats.num_bytes
        secs = self.stats.transfer_seconds
        counters["mean_kv_transfer_ms"] = 1e3 * sum(secs) / len(secs) if secs else 0.0
        first = min((r.sent for r in records), default=0.0)
        end = max(p.free_at, d.free_at)
        return SimOutcome(records, tl, max(end - first, 1e-9), time.perf_counter() - start_wall,
                          p.num_steps + d.num_steps, counters)

    def _add(self, inst: _Instance, k: int, req: SimRequest, arrival: float, max_tokens: int,
             params: dict | None) -> None:
        inst.scheduler.add_seq_group(sim_group(str(k), req, arrival, max_tokens, params))
        inst.free_at = max(inst.free_at, arrival)  # an idle instance starts when work arrives

    def _step(self, inst: _Instance, start: float):
        """One step of `inst` from `start`: schedule, price, report the connector's events that
        happened by its end, update. Returns the scheduler's outputs."""
        inst.clock.now = start
        out = inst.scheduler.schedule()
        batch, result = inst.runner.execute(out)
        self._last_batch = batch
        meta = out.kv_connector_metadata
        if meta is not None:
            for req_id, pull in meta.reqs_to_recv.items():
                # a pool block holds one KV cache group's layers: tokens of every layer moved
                num_tokens = len(pull.local_block_ids) * self.block_size // inst.num_groups
                # an empty pull only tells the producer to let go
                seconds = self.cost_model.kv_transfer_time(num_tokens) if num_tokens else 0.0
                heapq.heappush(inst.landing, (start + seconds, req_id))
                heapq.heappush(self.prefill.read_out, (start + seconds, pull.remote_request_id))
                if num_tokens:
                    self.stats.num_requests += 1
                    self.stats.num_bytes += num_tokens * self.cost_model.geometry.block_bytes(1)
                    self.stats.transfer_seconds.append(seconds)
        end = start + self.cost_model.step_time(batch)
        if inst is self.decode:
            result.finished_recving = _due(inst.landing, end)
        else:
            result.finished_sending = _due(inst.read_out, end)
        inst.clock.now = end
        inst.free_at = end
        inst.num_steps += 1
        return inst.scheduler.update_from_output(out, result)


def _due(queue: list[tuple[float, str]], end: float) -> list[str]:
    """Pop the req_ids whose event time is at or before `end`."""
    due = []
    while queue and queue[0][0] <= end:
        due.append(heapq.heappop(queue)[1])
    return due
