"""`Scheduler.stats()`: the one way the engine reads the scheduler. Its numbers agree with the
queues, the block pools and the counters as a workload moves through preemption, prefix hits and
finishing; `detail=True` adds the block maps and the request rows the dashboard shows. And no
module above the core reaches past it into the scheduler's queues, block manager or counters."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from core_fakes import FakeRunner, make_group, make_scheduler

from tessera.config import PreemptionMode
from tessera.core.scheduler_stats import SchedulerStats
from tessera.lora.request import LoRARequest

ROOT = Path(__file__).resolve().parents[2] / "tessera"


def _check_against_internals(sched, s: SchedulerStats) -> None:
    bm = sched.block_manager
    assert (s.num_waiting, s.num_running, s.num_swapped) == (
        len(sched.waiting), len(sched.running), len(sched.swapped))
    assert (s.num_gpu_blocks, s.num_free_gpu_blocks) == (bm.num_gpu_blocks, bm.gpu.num_free)
    assert (s.num_cpu_blocks, s.num_free_cpu_blocks) == (bm.num_cpu_blocks, bm.cpu.num_free)
    assert s.gpu_usage == pytest.approx(bm.gpu_usage())
    assert s.cpu_usage == pytest.approx(bm.cpu_usage())
    assert s.num_prefix_cache_queries_total == bm.num_prefix_cache_queries
    assert s.num_prefix_cache_hits_total == bm.num_prefix_cache_hits


def test_stats_follow_a_workload_through_swap_and_prefix_hits():
    # 5 blocks of 4: r0's prompt is cached, r1 and r2 hit its first block; decodes outgrow the
    # pool, so one of them is swapped out
    sched = make_scheduler(num_gpu_blocks=5, num_cpu_blocks=8, mode=PreemptionMode.SWAP,
                           prefix=True)
    runner = FakeRunner(sched)
    prompt = list(range(8))
    sched.add_seq_group(make_group("r0", 8, arrival=0, max_tokens=6, prompt=prompt))
    s = sched.stats()
    assert (s.num_waiting, s.num_running, s.num_preemptions_total) == (1, 0, 0)
    assert s.detail is None and not s.kv_transfer
    runner.step()
    for i in (1, 2):
        sched.add_seq_group(make_group(f"r{i}", 8, arrival=i, max_tokens=6, prompt=prompt))
    runner.step()
    s = sched.stats()
    _check_against_internals(sched, s)
    assert s.num_running == 3 and s.num_prompt_tokens_total == 8 + 2 * 4
    assert s.num_prefix_cache_hits_total == 2 * 4  # r1 and r2 found r0's first block
    seen_swapped = False
    while sched.has_unfinished_seqs():
        runner.step()
        s = sched.stats()
        _check_against_internals(sched, s)
        seen_swapped |= s.num_swapped > 0
    assert s.num_preemptions_total == sched.num_preemptions_total > 0 and seen_swapped
    assert s.num_generation_tokens_total == 3 * 6
    assert s.gpu_usage == 0.0 and (s.num_waiting, s.num_running, s.num_swapped) == (0, 0, 0)


def test_stats_are_a_frozen_snapshot():
    sched = make_scheduler()
    sched.add_seq_group(make_group("a", 8))
    s = sched.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_waiting = 0  # type: ignore[misc]
    FakeRunner(sched).step()
    assert s.num_waiting == 1 and sched.stats().num_waiting == 0


def test_detail_lists_requests_and_block_maps():
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=32)
    runner = FakeRunner(sched)
    sched.add_seq_group(make_group("a", 8, max_tokens=4, arrival=0.0))
    sched.add_seq_group(make_group("b", 6, max_tokens=100, arrival=1.0))
    runner.step()
    sched.add_seq_group(make_group("c", 4, arrival=2.0))
    sched.add_seq_group(make_group("d", 4, arrival=3.0))
    s = sched.stats(detail=True, max_requests=1)
    d = s.detail
    assert d is not None
    assert len(d.gpu_block_states) == 16 and len(d.cpu_block_states) == 64
    assert sum(b != 0 for b in d.gpu_block_states) == 16 - s.num_free_gpu_blocks == 4
    assert d.oldest_waiting_arrival == 2.0 and d.oldest_swapped_arrival is None
    assert [r.request_id for r in d.requests] == ["a"]  # capped at max_requests
    row = d.requests[0]
    assert (row.state, row.num_prompt_tokens, row.num_computed_tokens, row.max_num_tokens,
            row.num_output_tokens, row.num_seqs, row.lora_name) == ("decode", 8, 8, 12, 1, 1, None)
    rows = sched.stats(detail=True).detail.requests
    assert [(r.request_id, r.max_num_tokens) for r in rows] == [("a", 12), ("b", 32)]
    assert d.running_lora_adapters == d.waiting_lora_adapters == ()


# What code above the core may use of a Scheduler: its verbs, its configs and stats().
PUBLIC = {
    "schedule", "update_from_output", "add_seq_group", "abort_seq_group", "finish_seqs",
    "has_unfinished_seqs", "has_pending_kv_transfers", "get_num_unfinished_seq_groups",
    "request_id_of", "resend_whole", "stats", "config", "cache_config",
}


def reads_past_stats(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of each `scheduler.X` / `sched.X` / `<obj>.scheduler.X` with X outside
    PUBLIC (`<...>.config.scheduler` is the SchedulerConfig, not the scheduler)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or node.attr in PUBLIC:
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id in ("scheduler", "sched")) or (
                isinstance(base, ast.Attribute) and base.attr == "scheduler"
                and _name(base.value) != "config"):
            found.append((node.lineno, node.attr))
    return found


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


def test_no_module_above_the_core_reads_scheduler_internals():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("core/"):
            continue
        bad += [f"tessera/{rel}:{line} .{attr}" for line, attr in reads_past_stats(
            path.read_text())]
    assert not bad, "read the scheduler through Scheduler.stats():\n" + "\n".join(bad)


def test_the_scan_sees_a_reach_into_the_scheduler():
    source = ("def f(self, sched):\n"
              "    self.scheduler.block_manager.gpu_usage()\n"
              "    len(sched.running)\n"
              "    self.scheduler.stats().num_running\n"
              "    engine.config.scheduler.max_num_seqs\n")
    assert sorted(reads_past_stats(source)) == [(2, "block_manager"), (3, "running")]


def test_detail_names_the_adapters_running_and_waiting():
    sched = make_scheduler(max_loras=1, num_gpu_blocks=64)
    for i, (name, lora_id) in enumerate([("b", 2), ("a", 1), (None, 0), ("b", 2)]):
        group = make_group(f"r{i}", 6, arrival=i)
        if name is not None:
            group = dataclasses.replace(group, lora_request=LoRARequest(name, lora_id, "/x"))
        sched.add_seq_group(group)
    # one adapter at a time: "b" runs; "a" waits, and so does the second "b" (drained for "a")
    FakeRunner(sched).step()
    d = sched.stats(detail=True).detail
    assert d.running_lora_adapters == ("b",) and d.waiting_lora_adapters == ("a", "b")
    assert {r.request_id: r.lora_name for r in d.requests} == {"r0": "b", "r2": None}
