"""The live view's sample (tessera/engine/dashboard/snapshot.py), built over the real scheduler and
a fake runner: its fields, block counts equal to the block manager's, the steps' batches, and
rolling rates."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tessera.config import PreemptionMode
from tessera.engine.dashboard.rates import RollingRates
from tessera.engine.dashboard.snapshot import DashboardRecorder
from tests.core.core_fakes import FakeRunner, make_group, make_scheduler


def _step(recorder: DashboardRecorder, runner: FakeRunner, t: float):
    out = runner.step()
    recorder.record_step(out, t, t + 0.01)
    return out


def _counts(blocks: str) -> dict[str, int]:
    return {c: blocks.count(c) for c in "01234"}


def test_fields_and_block_counts_equal_the_block_managers():
    sched = make_scheduler(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=64,
                           prefix=True)
    runner = FakeRunner(sched)
    recorder = DashboardRecorder(sched, "tiny")
    shared = list(range(100, 116))  # four full blocks two requests share
    sched.add_seq_group(make_group("a", 0, prompt=shared + [1, 2], max_tokens=6, arrival=0.0))
    for t in range(3):
        _step(recorder, runner, float(t))
    sched.add_seq_group(make_group("b", 0, prompt=shared + [3], max_tokens=6, arrival=3.0))
    sched.add_seq_group(make_group("c", 40, max_tokens=4, arrival=3.5))
    _step(recorder, runner, 3.0)
    # the adapter a request runs under, by the LoRARequest's name (None without LoRA)
    sched.running[-1].lora_request = SimpleNamespace(lora_name="sql-adapter", lora_int_id=1)
    snap = recorder.snapshot(now=5.0)
    json.dumps(snap)  # plain JSON, nothing live
    assert set(snap) >= {"version", "seq", "time", "config", "queues", "kv", "steps", "counters",
                         "requests"}
    bm = sched.block_manager
    kv = snap["kv"]
    counts = _counts(kv["blocks"])
    assert len(kv["blocks"]) == kv["num_blocks"] == bm.num_gpu_blocks == 32
    assert kv["num_free"] == bm.get_num_free_gpu_blocks() == counts["0"] + counts["2"]
    assert kv["num_used"] == 32 - bm.get_num_free_gpu_blocks() == counts["1"] + counts["3"]
    hashed = sum(bm.gpu.is_hashed(b) for b in range(32))
    assert hashed >= 4 and kv["num_cached"] == hashed == counts["2"] + counts["3"]
    used = {b for s in sched.running for q in s.seqs for b in bm.get_block_table(q)}
    assert {i for i, c in enumerate(kv["blocks"]) if c in "13"} == used
    assert kv["cpu"]["num_used"] == 0 and set(kv["cpu"]["blocks"]) == {"0"}
    q = snap["queues"]
    assert (q["waiting"], q["running"], q["swapped"]) == (
        len(sched.waiting), len(sched.running), len(sched.swapped))
    assert snap["config"]["num_gpu_blocks"] == 32 and snap["config"]["model"] == "tiny"
    # four steps: a's prompt (18 tokens), two decodes, then b and c's prompts beside a's decode
    steps = snap["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert (steps[0]["prefill_tokens"], steps[0]["decode_tokens"]) == (18, 0)
    assert (steps[1]["prefill_tokens"], steps[1]["decode_tokens"]) == (0, 1)
    # b's prompt computes one token (the rest hit the cache): a prefill all the same
    assert steps[3]["decode_tokens"] == 1 and steps[3]["prefill_tokens"] == 1 + 40
    assert all(s["num_tokens"] == s["prefill_tokens"] + s["decode_tokens"] for s in steps)
    assert steps[3]["step_ms"] == pytest.approx(10.0)
    rows = {r["id"]: r for r in snap["requests"]["rows"]}
    assert set(rows) == {"a", "b", "c"}
    assert rows["a"]["state"] == "decode" and rows["a"]["output_tokens"] == 4
    assert rows["a"]["tokens_total"] == 18 + 6 and rows["c"]["prompt_tokens"] == 40
    assert [r["adapter"] for r in snap["requests"]["rows"]] == [None, None, "sql-adapter"]
    assert set(rows["a"]) == {"id", "adapter", "prompt_tokens", "output_tokens", "tokens_done",
                              "tokens_total", "num_seqs", "state"}  # counts only, no tokens
    assert snap["counters"]["prefix_cache_hits"] == bm.num_prefix_cache_hits > 0
    # the next sample has only the steps since this one
    _step(recorder, runner, 6.0)
    assert [s["step"] for s in recorder.snapshot(now=7.0)["steps"]] == [5]


def test_swapping_blocks_and_the_swap_pool():
    sched = make_scheduler(block_size=4, num_gpu_blocks=6, num_cpu_blocks=8,
                           max_num_batched_tokens=64, mode=PreemptionMode.SWAP)
    runner = FakeRunner(sched)
    recorder = DashboardRecorder(sched)
    sched.add_seq_group(make_group("old", 8, max_tokens=12, arrival=0.0))
    sched.add_seq_group(make_group("new", 8, max_tokens=12, arrival=1.0))
    swapped_out = {}
    for t in range(12):
        out = _step(recorder, runner, float(t))
        if out.blocks_to_swap_out:
            swapped_out = dict(out.blocks_to_swap_out)
            break
    assert swapped_out, "the pool of 6 blocks never preempted"
    snap = recorder.snapshot(now=20.0)
    kv = snap["kv"]
    gpu = kv["blocks"]
    assert {i for i, c in enumerate(gpu) if c == "4"} == set(swapped_out)
    assert kv["num_swapping"] == len(swapped_out)
    cpu = kv["cpu"]["blocks"]
    assert {i for i, c in enumerate(cpu) if c == "4"} == set(swapped_out.values())
    assert kv["cpu"]["num_used"] == 8 - sched.block_manager.get_num_free_cpu_blocks() > 0
    assert snap["queues"]["swapped"] == 1 and snap["queues"]["oldest_swapped_s"] == 19.0
    assert [r["state"] for r in snap["requests"]["rows"]] == ["decode", "swapped"]
    assert snap["counters"]["swap_preemptions"] == 1 == snap["counters"]["preemptions"]
    # once sampled, the swap is over: the next sample shows no block being swapped
    assert "4" not in recorder.snapshot(now=21.0)["kv"]["blocks"]


def test_oldest_wait_is_the_fcfs_head():
    sched = make_scheduler(max_num_seqs=1)
    recorder = DashboardRecorder(sched)
    assert recorder.snapshot(now=1.0)["queues"]["oldest_waiting_s"] is None
    sched.add_seq_group(make_group("x", 4, arrival=2.0))
    sched.add_seq_group(make_group("y", 4, arrival=3.0))
    assert recorder.snapshot(now=10.0)["queues"]["oldest_waiting_s"] == 8.0


def test_rolling_rates_over_the_window():
    rates = RollingRates(window_s=10.0)
    base = {"generation_tokens": 0, "prompt_tokens": 0, "preemptions": 0, "swap_preemptions": 0,
            "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    assert rates.rates(0.0, base)["output_tok_s"] is None  # one sample: no span yet
    for k in range(1, 100):
        rates.observe_finished(float(k), ttft=k / 1000, tpot=None if k == 95 else 0.002)
    rates.rates(92.0, {**base, "generation_tokens": 4600})
    r = rates.rates(100.0, {**base, "generation_tokens": 5000, "preemptions": 3,
                            "swap_preemptions": 1, "prefix_cache_queries": 400,
                            "prefix_cache_hits": 100})
    # the window starts at 90; the sample at 0 is from before a gap, so the rate runs from 92
    assert r["output_tok_s"] == pytest.approx(50.0) and r["span_s"] == 8.0
    assert (r["preemptions"], r["preemptions_swap"], r["preemptions_recompute"]) == (3, 1, 2)
    assert r["prefix_hit_rate"] == 0.25
    assert r["num_finished"] == 10  # 90..99
    assert r["ttft_p50_ms"] == pytest.approx(94.0) and r["ttft_p99_ms"] == pytest.approx(99.0)
    assert r["tpot_p99_ms"] == pytest.approx(2.0) and r["tpot_p50_ms"] == pytest.approx(2.0)
    r = rates.rates(105.0, {**base, "generation_tokens": 5500, "preemptions": 3,
                            "swap_preemptions": 1})
    # the window starts at 95: differenced against the last sample at or before it (92)
    assert r["output_tok_s"] == pytest.approx(900 / 13)
