"""The scheduler under --max-loras: never more distinct adapters in a step (nor running) than
the limit; a request held back for an adapter slot keeps its place and is not starved by younger
requests of running adapters; prefix-cache keys include the adapter."""

from __future__ import annotations

import dataclasses

from core_fakes import FakeRunner, make_group, make_scheduler

from tessera.core.prefix_cache import lora_root_hash
from tessera.lora.request import LoRARequest


def lora_group(req_id: str, lora: int, prompt_len: int = 6, max_tokens: int = 4,
               arrival: float = 0.0, prompt: list[int] | None = None):
    group = make_group(req_id, prompt_len, max_tokens=max_tokens, arrival=arrival, prompt=prompt)
    if lora:
        group = dataclasses.replace(group, lora_request=LoRARequest(f"a{lora}", lora, "/x"))
    return group


def step_adapters(sched, out) -> set[int]:
    ids = set()
    for req_id in out.num_scheduled_tokens:
        group, _ = sched._live.get(req_id, (None, None))
        if group is not None and group.lora_int_id:
            ids.add(group.lora_int_id)
    return ids


def test_at_most_max_loras_adapters_per_step_and_running():
    sched = make_scheduler(max_loras=2, max_num_seqs=16, num_gpu_blocks=128)
    runner = FakeRunner(sched)
    for i in range(12):
        sched.add_seq_group(lora_group(f"r{i}", lora=i % 4, arrival=i))  # adapters 0..3
    seen: set[int] = set()
    steps = 0
    while sched.has_unfinished_seqs():
        out = sched.schedule()
        adapters = step_adapters(sched, out)
        assert len(adapters) <= 2, adapters
        running = {g.lora_int_id for g in sched.running if g.lora_int_id}
        assert len(running) <= 2, running
        seen |= adapters
        for core in sched.update_from_output(out, runner.execute(out)):
            if core.finished:
                runner.finished.append(core.request_id)
        steps += 1
        assert steps < 500
    assert seen == {1, 2, 3}
    assert sorted(runner.finished) == sorted(f"r{i}" for i in range(12))


def test_held_request_keeps_its_place_and_is_not_starved():
    """max_loras 1: adapter 1 runs; an adapter-2 request waits; a stream of younger adapter-1
    requests must not pass it forever: once it waits, adapter 1 drains and 2 runs next."""
    sched = make_scheduler(max_loras=1, max_num_seqs=16, num_gpu_blocks=256)
    runner = FakeRunner(sched)
    sched.add_seq_group(lora_group("first", lora=1, max_tokens=6, arrival=0))
    sched.add_seq_group(lora_group("other", lora=2, max_tokens=2, arrival=1))
    admitted_at: dict[str, int] = {}
    for step in range(200):
        if step < 100:  # a new adapter-1 request every step
            sched.add_seq_group(lora_group(f"more{step}", lora=1, max_tokens=6, arrival=2 + step))
        out = sched.schedule()
        for req_id in out.num_scheduled_tokens:
            admitted_at.setdefault(req_id, step)
        assert len(step_adapters(sched, out)) <= 1
        sched.update_from_output(out, runner.execute(out))
        if not sched.has_unfinished_seqs():
            break
    assert "other" in admitted_at
    # admitted as soon as "first" (and nothing younger of adapter 1) had drained
    assert admitted_at["other"] <= 10, admitted_at["other"]
    younger = [s for r, s in admitted_at.items() if r.startswith("more")]
    assert all(s > admitted_at["other"] for s in younger[3:]), "younger ones kept passing"
    # the held request kept its place: it runs before the adapter-1 requests that waited too
    assert admitted_at["other"] < max(younger)


def test_base_model_requests_are_never_held():
    sched = make_scheduler(max_loras=1, max_num_seqs=16, num_gpu_blocks=128)
    sched.add_seq_group(lora_group("a", lora=1, arrival=0))
    sched.add_seq_group(lora_group("b", lora=2, arrival=1))
    sched.add_seq_group(lora_group("base", lora=0, arrival=2))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "base"}
    assert [g.request_id for g in sched.waiting] == ["b"]


def test_prefix_cache_keys_include_the_adapter():
    """The same prompt under two adapters is two entries; under one adapter, a hit."""
    assert lora_root_hash(0) is None and lora_root_hash(1) != lora_root_hash(2)
    prompt = list(range(100, 117))  # 4 full blocks of 4 and one token
    for second, expect_hit in ((1, True), (2, False), (0, False)):
        sched = make_scheduler(prefix=True, block_size=4, num_gpu_blocks=64, max_loras=2)
        runner = FakeRunner(sched)
        sched.add_seq_group(lora_group("x", lora=1, prompt=prompt, max_tokens=1))
        runner.run()
        sched.add_seq_group(lora_group("y", lora=second, prompt=prompt, max_tokens=1))
        out = sched.schedule()
        assert (out.num_prefix_cache_hit_tokens > 0) is expect_hit, second
        sched.update_from_output(out, runner.execute(out))
