"""The simulator loop: the real scheduler, a virtual clock, bench serve's timing semantics."""

from __future__ import annotations

import pytest

from tessera.config import EngineArgs
from tessera.core import scheduler as core_scheduler
from tessera.simulator.report import request_results, simulation_json
from tessera.simulator.simulator import SimRequest, Simulator, VirtualClock
from tests.simulator.sim_fakes import FixedCost


def _sim(cost=None, num_gpu_blocks=256, num_cpu_blocks=64, max_concurrency=None, **engine):
    engine.setdefault("max_model_len", 512)
    engine.setdefault("block_size", 4)
    config = EngineArgs(**engine).create_engine_config(512)
    return Simulator(config, cost or FixedCost(), num_gpu_blocks, num_cpu_blocks,
                     max_concurrency=max_concurrency)


def _req(prompt_len: int, max_tokens: int, arrival: float = 0.0, base: int = 1) -> SimRequest:
    return SimRequest([base + i for i in range(prompt_len)], max_tokens, arrival)


def test_virtual_clock_is_the_schedulers_clock():
    clock = VirtualClock()
    clock.now = 12.5
    assert clock() == 12.5
    sim = _sim()
    assert sim.scheduler.clock is sim.clock


def test_one_request_timing_follows_the_cost_model():
    outcome = _sim(FixedCost(per_step=0.01)).run([_req(10, 5)])
    (r,) = request_results(outcome)
    assert r.success and r.output_tokens == 5  # exactly the dataset's length: no early stop
    assert r.ttft == pytest.approx(0.01)  # one step: the prefill samples the first token
    assert r.itl == pytest.approx([0.01] * 4)
    assert r.e2el == pytest.approx(0.05)
    assert outcome.num_steps == 5 and outcome.duration_s == pytest.approx(0.05)


def test_step_time_grows_with_tokens_and_time_jumps_to_arrivals():
    cost = FixedCost(per_step=0.01, per_token=0.001)
    outcome = _sim(cost).run([_req(100, 2, 0.0), _req(20, 2, 10.0, base=500)])
    first, second = request_results(outcome)
    assert first.ttft == pytest.approx(0.01 + 0.1)  # 100 prompt tokens
    assert second.ttft == pytest.approx(0.01 + 0.02)  # sent at 10 s, alone
    assert outcome.records[1].sent == 10.0
    assert outcome.duration_s == pytest.approx(10.0 + 0.03 + 0.011)


def test_max_concurrency_sends_when_a_request_finishes():
    outcome = _sim(max_concurrency=1).run([_req(8, 3), _req(8, 3, base=100)])
    a, b = outcome.records
    assert b.sent == pytest.approx(a.finished)  # waited for the slot, timed from its send
    assert request_results(outcome)[1].ttft == pytest.approx(0.01)


def test_the_real_scheduler_runs(monkeypatch):
    calls = []
    real = core_scheduler.Scheduler.schedule

    def counting(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(core_scheduler.Scheduler, "schedule", counting)
    sim = _sim()
    assert type(sim.scheduler) is core_scheduler.Scheduler
    outcome = sim.run([_req(16, 4, 0.0), _req(16, 4, 0.001, base=99)])
    assert len(calls) == outcome.num_steps > 0


def test_engine_limits_bound_every_step():
    cost = FixedCost()
    sim = _sim(cost, max_num_seqs=3, enable_chunked_prefill=True, max_num_batched_tokens=32)
    outcome = sim.run([_req(50, 6, 0.0, base=100 * k) for k in range(8)])
    assert all(r.success for r in request_results(outcome))
    assert max(outcome.timeline.batch_seqs) == 3
    assert max(b.num_tokens for b in cost.batches) <= 32
    assert any(0 < b.num_prefill_tokens < 50 for b in cost.batches)  # chunked


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_small_cache_preempts_by_the_chosen_mode(mode):
    # 6 requests of up to 40 tokens (10 blocks each) in 24 blocks: decodes run out of blocks
    sim = _sim(num_gpu_blocks=24, num_cpu_blocks=64, preemption_mode=mode)
    outcome = sim.run([_req(16, 24, 0.0, base=100 * k) for k in range(6)])
    results = request_results(outcome)
    assert all(r.success and r.output_tokens == 24 for r in results)
    assert outcome.counters["num_preemptions"] > 0
    recomputed = outcome.counters["prompt_tokens_computed"] > 6 * 16
    assert recomputed == (mode == "recompute")
    assert (max(outcome.timeline.num_swapped) > 0) == (mode == "swap")


def test_swap_bytes_reach_the_cost_model():
    cost = FixedCost(per_swap_byte=1e-3)
    sim = _sim(cost, num_gpu_blocks=24, num_cpu_blocks=64, preemption_mode="swap")
    sim.run([_req(16, 24, 0.0, base=100 * k) for k in range(6)])
    block_bytes = cost.geometry.block_bytes(4)
    swapped = [b.swap_bytes for b in cost.batches if b.swap_bytes]
    assert swapped and all(s % block_bytes == 0 for s in swapped)


def test_prefix_caching_hits_shared_prompts():
    shared = list(range(1, 65))
    reqs = [SimRequest(shared + [1000 + k, 2000 + k], 4, 0.5 * k) for k in range(4)]
    on = _sim(FixedCost(per_token=0.001), enable_prefix_caching=True).run(reqs)
    off = _sim(FixedCost(per_token=0.001), enable_prefix_caching=False).run(reqs)
    assert on.counters["prefix_cache_hits"] >= 3 * 64
    assert off.counters["prefix_cache_hits"] == 0
    ttft_on = [r.ttft for r in request_results(on)]
    ttft_off = [r.ttft for r in request_results(off)]
    assert ttft_on[0] == pytest.approx(ttft_off[0]) and ttft_on[3] < ttft_off[3]


def test_decodes_over_a_cached_prefix_reach_the_cost_model_as_shared_context():
    """Four requests on one 64-token prefix (16 blocks of 4), decoding together: with prefix
    caching each step beside the first reader re-reads the prefix blocks; without it every
    request has its own copy and nothing is shared."""
    shared = list(range(1, 65))
    reqs = [SimRequest(shared + [1000 + k, 2000 + k], 16, 0.02 * k) for k in range(4)]
    on, off = FixedCost(), FixedCost()
    _sim(on, enable_prefix_caching=True).run(reqs)
    _sim(off, enable_prefix_caching=False).run(reqs)
    assert {b.num_shared_context_tokens for b in off.batches} == {0}
    four = [b for b in on.batches if b.num_decode_tokens == 4]
    assert four and {b.num_shared_context_tokens for b in four} == {3 * 64}


def test_a_request_that_never_fits_fails_as_on_the_server():
    outcome = _sim(num_gpu_blocks=8).run([_req(64, 4), _req(8, 2, base=300)])
    big, small = request_results(outcome)
    assert not big.success and big.error
    assert small.success


def test_result_json_has_bench_serve_metrics_and_timeline():
    outcome = _sim().run([_req(12, 6, 0.0), _req(12, 6, 0.011, base=50)])
    data = simulation_json(outcome, {"label": "t"}, slos={"ttft": 15.0})
    m = data["metrics"]
    for key in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_tpot_ms",
                "p99_itl_ms", "p99_e2el_ms", "request_goodput", "num_preemptions"):
        assert key in m
    assert m["completed"] == 2 and m["total_output_tokens"] == 12
    assert 0 < m["request_goodput"] < m["request_throughput"]  # the second waits a step
    assert len(data["requests"]) == 2
    assert len(data["timeline"]["time"]) == outcome.num_steps


def test_the_probe_runs_first_and_warms_the_prefix_cache():
    """bench serve's test request (the first sample, 4 tokens) runs alone before the trace: on
    a shared prefix the first timed request then hits the cache, as on the server."""
    cost = FixedCost(per_step=0.01, per_token=0.001)
    shared = list(range(1, 33))
    reqs = [_req(0, 3), _req(0, 3, arrival=0.5)]
    reqs = [SimRequest(shared + [100 + k], 3, r.arrival_time) for k, r in enumerate(reqs)]
    cold = request_results(_sim(cost, enable_prefix_caching=True).run(reqs))
    sim = _sim(FixedCost(per_step=0.01, per_token=0.001), enable_prefix_caching=True)
    probe = SimRequest(reqs[0].prompt_token_ids, 3, 0.0)
    outcome = sim.run(reqs, probe=probe)
    warm = request_results(outcome)
    assert outcome.records[0].sent == pytest.approx(0.01 + 0.033 + 2 * 0.011)  # after the probe
    assert cold[0].ttft == pytest.approx(0.01 + 0.033)  # all 33 prompt tokens
    assert warm[0].ttft < cold[0].ttft  # the probe's blocks were cached
    assert len(warm) == 2  # the probe is not reported
