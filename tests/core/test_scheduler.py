"""Hand-written traces, one per scheduling rule."""

from core_fakes import FakeRunner, make_group, make_scheduler, samples_this_step, scheduled_tokens

from tessera.config import PreemptionMode
from tessera.sequence import SequenceStatus

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
SWAPPED = SequenceStatus.SWAPPED


def ids(queue):
    return [g.request_id for g in queue]


def test_fcfs_admits_in_arrival_order_whole_prompts():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64)
    for i, n in enumerate([30, 30, 30]):
        sched.add_seq_group(make_group(f"r{i}", n, arrival=i))
    out = sched.schedule()
    assert scheduled_tokens(out) == {"r0": 30, "r1": 30}  # r2 does not fit the 4 tokens left
    assert ids(sched.running) == ["r0", "r1"] and ids(sched.waiting) == ["r2"]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r0", "r1"]
    assert list(out.scheduled_new_reqs[0].prompt_token_ids) == sched.running[0].prompt_token_ids
    assert out.total_num_scheduled_tokens == 60
    assert sched.running[0].first_scheduled_time is not None


def test_new_request_messages_carry_data_not_the_schedulers_objects():
    """What the runner is sent cannot change the scheduler's request, nor the reverse."""
    import dataclasses

    import pytest

    sched = make_scheduler()
    sched.add_seq_group(make_group("a", 5, max_tokens=3))
    new = sched.schedule().scheduled_new_reqs[0]
    group = sched.running[0]
    assert isinstance(new.prompt_token_ids, tuple) and isinstance(new.block_ids, tuple)
    assert isinstance(new.output_token_ids, tuple)
    assert new.sampling_params == group.sampling_params
    assert new.sampling_params is not group.sampling_params
    new.sampling_params.stop_token_ids.append(7)
    assert 7 not in group.sampling_params.stop_token_ids
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.block_ids = ()  # type: ignore[misc]


def test_decode_after_prefill_and_finish_frees_blocks():
    sched = make_scheduler()
    sched.add_seq_group(make_group("a", 5, max_tokens=3))
    runner = FakeRunner(sched)
    out = runner.step()
    assert scheduled_tokens(out) == {"a": 5}
    out = runner.step()
    assert scheduled_tokens(out) == {"a": 1}
    runner.run()
    assert runner.finished == ["a"]
    assert sched.block_manager.get_num_free_gpu_blocks() == 64
    sched.block_manager.check_integrity()


def _three_running(
    mode=None, num_cpu_blocks=64, priority=False, priorities=(0, 0, 0), order=("r0", "r1", "r2")
):
    # 6 blocks of 4: three 8-token prompts fill them; the next decode needs a 7th block
    sched = make_scheduler(
        num_gpu_blocks=6, num_cpu_blocks=num_cpu_blocks, mode=mode, priority=priority
    )
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_seq_group(
            make_group(f"r{i}", 8, arrival=i, priority=priorities[i], max_tokens=10)
        )
    runner.step()
    assert ids(sched.running) == list(order)
    return sched, runner


def test_preempts_newest_first_and_recompute_goes_to_front_of_waiting():
    sched, runner = _three_running(mode=PreemptionMode.RECOMPUTE)
    sched.add_seq_group(make_group("late", 4, arrival=10))
    out = runner.step()
    # r0 needs a block: the newest (r2) is preempted, which frees enough for r0 and r1
    assert out.preempted_request_ids == ["r2"]
    assert out.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert scheduled_tokens(out) == {"r0": 1, "r1": 1}
    assert ids(sched.waiting) == ["r2", "late"]  # ahead of newer arrivals
    seq = sched.waiting.peek().seqs[0]
    assert seq.status is WAITING and seq.num_computed_tokens == 0 and seq.get_len() == 9
    sched.block_manager.check_integrity()
    runner.run()
    assert sorted(runner.finished) == ["late", "r0", "r1", "r2"]


def test_group_being_scheduled_preempts_itself_last():
    sched = make_scheduler(num_gpu_blocks=2, num_cpu_blocks=0)
    runner = FakeRunner(sched)
    a = make_group("a", 8, max_tokens=5)
    sched.add_seq_group(a)
    runner.step()
    out = runner.step()  # needs a 3rd block, no one else to preempt: itself, then it can never fit
    assert out.preempted_request_ids == ["a"]
    out = runner.step()
    assert out.ignored_request_ids == ["a"] and runner.finished == ["a"]
    assert "3 KV blocks" in a.error and not sched.has_unfinished_seqs()


def _forked_group_running(num_cpu_blocks, mode=None):
    # n=2 request: prompt 6 tokens (2 blocks); after the fork both seqs share them
    sched = make_scheduler(num_gpu_blocks=5, num_cpu_blocks=num_cpu_blocks, mode=mode)
    runner = FakeRunner(sched)
    sched.add_seq_group(make_group("old", 7, arrival=0, max_tokens=30))
    sched.add_seq_group(make_group("pair", 6, n=2, arrival=1, max_tokens=30))
    runner.step()
    assert len(sched.running[1].seqs) == 2
    return sched, runner


def test_copy_on_write_after_fork():
    sched, runner = _forked_group_running(num_cpu_blocks=8)
    out = runner.step()  # both children write position 6, in the shared partial block
    assert len(out.blocks_to_copy) == 1
    src, dst = out.blocks_to_copy[0]
    pair = sched.running[1]
    tables = [sched.block_manager.get_block_table(s) for s in pair.seqs]
    assert tables[0][0] == tables[1][0]  # the full prompt block stays shared
    assert {tables[0][1], tables[1][1]} == {src, dst}
    sched.block_manager.check_integrity()


def test_swap_out_swapped_then_swap_in():
    sched, runner = _forked_group_running(num_cpu_blocks=8)
    runner.step()  # CoW takes the last free block: 5 of 5 used
    for _ in range(3):
        out = runner.step()
        if out.num_swapped_out:
            break
    assert out.preempted_request_ids == ["pair"] and out.num_swapped_out == 1
    assert ids(sched.swapped) == ["pair"]
    assert all(s.status is SWAPPED for s in sched.swapped[0].seqs)
    assert len(out.blocks_to_swap_out) == 3  # shared block mapped once
    cpu_blocks = set(out.blocks_to_swap_out.values())
    assert sched.block_manager.get_num_free_cpu_blocks() == 8 - 3
    sched.block_manager.check_integrity()
    sched.abort_seq_group("old")  # frees room
    out = runner.step()
    assert out.num_swapped_in == 1 and set(out.blocks_to_swap_in) == cpu_blocks
    assert sched.block_manager.get_num_free_cpu_blocks() == 8
    assert ids(sched.running) == ["pair"] and scheduled_tokens(out) == {"pair": 2}
    # swapped-in streams come back to the runner whole, on their new device blocks
    assert sorted(r.req_id for r in out.scheduled_new_reqs) == ["1_pair", "pair"]
    assert all(
        set(r.block_ids) <= set(out.blocks_to_swap_in.values()) | {b for _, b in out.blocks_to_copy}
        for r in out.scheduled_new_reqs
    )
    sched.block_manager.check_integrity()


def test_swap_falls_back_to_recompute_when_cpu_pool_is_full():
    sched, runner = _forked_group_running(num_cpu_blocks=0, mode=PreemptionMode.SWAP)
    for _ in range(4):
        out = runner.step()
        if out.num_preemptions:
            break
    assert out.preempted_request_ids == ["pair"] and out.num_swapped_out == 0
    assert ids(sched.waiting) == ["pair"] and not sched.swapped
    assert all(
        s.status is WAITING and s.num_computed_tokens == 0 for s in sched.waiting.peek().seqs
    )
    sched.block_manager.check_integrity()


def test_rejects_too_long_and_never_fitting_prompts_at_once():
    sched = make_scheduler(num_gpu_blocks=4, max_model_len=32, max_num_batched_tokens=32)
    long, huge = make_group("long", 40), make_group("huge", 20)  # huge: 5 blocks > 4
    for g in (long, huge, make_group("ok", 4)):
        sched.add_seq_group(g)
    out = sched.schedule()
    assert out.ignored_request_ids == ["long", "huge"]
    assert long.error == "prompt has 40 tokens, more than max_model_len 32"
    assert "5 KV blocks" in huge.error and "4 device blocks" in huge.error
    assert all(s.status is SequenceStatus.FINISHED_IGNORED for g in (long, huge) for s in g.seqs)
    assert scheduled_tokens(out) == {"ok": 4} and not sched.waiting
    core = {c.request_id: c for c in sched.update_from_output(out, FakeRunner(sched).execute(out))}
    assert core["long"].finished and core["long"].error == long.error and not core["long"].seqs


def test_watermark_holds_back_admission():
    sched = make_scheduler(num_gpu_blocks=10, watermark=0.2)  # keep 2 blocks free
    sched.add_seq_group(make_group("a", 20, arrival=0))  # 5 blocks
    sched.add_seq_group(make_group("b", 16, arrival=1))  # 4 blocks: 5 - 4 < 2
    out = sched.schedule()
    assert scheduled_tokens(out) == {"a": 20} and ids(sched.waiting) == ["b"]


def test_chunked_prefill_fills_budget_after_decodes():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=64, chunked=True)
    runner = FakeRunner(sched)
    sched.add_seq_group(make_group("d", 3, arrival=0))
    runner.step()
    sched.add_seq_group(make_group("long", 20, arrival=1))
    out = runner.step()
    assert scheduled_tokens(out) == {"d": 1, "long": 7}
    out = runner.step()
    assert scheduled_tokens(out) == {"d": 1, "long": 7}
    assert samples_this_step(out, runner) == {"d"}
    out = runner.step()
    assert scheduled_tokens(out) == {"d": 1, "long": 6}
    assert samples_this_step(out, runner) == {"d", "long"}
    assert sched.running[1].seqs[0].get_output_len() == 1  # sampled


def test_chunked_running_prefill_leaves_room_for_later_decodes():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=64, chunked=True)
    runner = FakeRunner(sched)
    sched.add_seq_group(make_group("d", 2, arrival=1))
    runner.step()
    sched.add_seq_group(make_group("long", 30, arrival=0))  # older: runs ahead of d
    out = runner.step()
    assert scheduled_tokens(out) == {"d": 1, "long": 7}
    assert ids(sched.running) == ["long", "d"]
    out = runner.step()  # long's chunk comes first in order but leaves d its decode
    assert scheduled_tokens(out) == {"long": 7, "d": 1}


def test_prefix_hits_skip_computation():
    sched = make_scheduler(prefix=True)
    runner = FakeRunner(sched)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    sched.add_seq_group(make_group("a", 0, prompt=prompt, arrival=0))
    runner.step()
    sched.add_seq_group(make_group("b", 0, prompt=prompt[:12] + [7, 8], arrival=1))
    out = runner.step()
    assert scheduled_tokens(out)["b"] == 2 and out.num_prefix_cache_hit_tokens == 12
    assert sched.block_manager.num_prefix_cache_hits == 12


def test_priority_preempts_running_tail():
    # running sorted by (priority, arrival): the tail is the worst
    sched, runner = _three_running(
        mode=PreemptionMode.RECOMPUTE, priority=True, priorities=(0, 5, 3), order=("r0", "r2", "r1")
    )
    sched.add_seq_group(make_group("vip", 8, priority=1, arrival=20))
    sched.add_seq_group(make_group("low", 4, priority=9, arrival=21))
    out = runner.step()
    # vip needs 2 blocks and the three decodes 3 more: r1, then r2 make room; r0 (better) stays
    assert out.preempted_request_ids == ["r1", "r2"]
    assert scheduled_tokens(out) == {"r0": 1, "vip": 8}
    assert ids(sched.waiting) == ["r2", "r1", "low"]
    sched.block_manager.check_integrity()
    runner.run()


def test_priority_does_not_preempt_for_equal_priority():
    sched, runner = _three_running(priority=True, priorities=(2, 2, 2))
    assert not sched.swapped
    sched.add_seq_group(make_group("same", 8, priority=2, arrival=20))
    out = sched.schedule()
    assert "same" not in scheduled_tokens(out)


def test_abort_frees_blocks_everywhere():
    sched, runner = _three_running()
    sched.add_seq_group(make_group("w", 4, arrival=9))
    aborted = sched.abort_seq_group(["r1", "w", "nope"])
    assert ids(aborted) == ["r1", "w"]
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for g in aborted for s in g.seqs)
    assert ids(sched.running) == ["r0", "r2"] and not sched.waiting
    assert sched.block_manager.get_num_free_gpu_blocks() == 2
    sched.block_manager.check_integrity()


def test_update_advances_only_what_was_computed():
    sched = make_scheduler(max_num_batched_tokens=8, chunked=True)
    group = make_group("a", 12)
    sched.add_seq_group(group)
    seq = group.seqs[0]
    runner = FakeRunner(sched)
    out = sched.schedule()
    assert seq.num_computed_tokens == 0  # schedule() does not advance progress
    core = sched.update_from_output(out, runner.execute(out))
    assert seq.num_computed_tokens == 8 and seq.get_output_len() == 0
    assert [c.seqs for c in core] == []  # a chunk without a sample changes no sequence
    out = sched.schedule()
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 8
    [core] = sched.update_from_output(out, runner.execute(out))
    assert seq.num_computed_tokens == 12 and seq.get_output_len() == 1
    assert core.seqs[0].new_token_ids == seq.output_token_ids and not core.finished


def test_max_num_seqs_counts_the_children_to_come():
    sched = make_scheduler(max_num_seqs=4)
    sched.add_seq_group(make_group("pair", 4, n=3, arrival=0))
    sched.add_seq_group(make_group("b", 4, arrival=1))
    sched.add_seq_group(make_group("c", 4, arrival=2))
    out = sched.schedule()
    assert scheduled_tokens(out) == {"pair": 4, "b": 4}  # 3 + 1 seats; c waits


def test_rejects_n_larger_than_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    wide = make_group("wide", 4, n=3)
    sched.add_seq_group(wide)
    out = sched.schedule()
    assert out.ignored_request_ids == ["wide"] and "max_num_seqs 2" in wide.error


def test_abort_swapped_group_frees_cpu_blocks():
    sched, runner = _forked_group_running(num_cpu_blocks=8)
    for _ in range(4):
        runner.step()
        if sched.swapped:
            break
    assert ids(sched.swapped) == ["pair"]
    sched.abort_seq_group("pair")
    assert not sched.swapped and sched.block_manager.get_num_free_cpu_blocks() == 8
    sched.block_manager.check_integrity()


def test_child_seeds_stay_in_the_generator_range():
    from tessera.core.runner_view import stream_seed

    assert stream_seed(7, 2) == 9
    assert stream_seed(2**64 - 1, 1) == 0 and stream_seed(-1, 0) == 2**64 - 1
