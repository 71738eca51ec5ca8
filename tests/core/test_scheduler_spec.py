"""Hand-written traces of speculative decoding in the scheduler: drafts are extra new tokens of a
decoding sequence, under the budget, with lookahead slots; the sequence advances by the accepted
ones; the slots of rejected drafts are written again; drafts never cost a preemption."""

from __future__ import annotations

import pytest
from core_fakes import FakeRunner, make_group, make_scheduler

from tessera.config import PreemptionMode
from tessera.core.scheduler_output import SchedulerOutput


class DraftingRunner(FakeRunner):
    """Proposes `drafts` after every sample; accepts `accept` of them."""

    def __init__(self, scheduler, drafts, accept):
        super().__init__(scheduler)
        self.drafts, self.accept = drafts, accept

    def propose(self, req_id, tokens):
        return list(self.drafts)

    def num_accepted(self, req_id, drafts):
        return min(self.accept, len(drafts))


def test_drafts_are_scheduled_counted_and_advance_by_accepted():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, max_model_len=64)
    sched.add_seq_group(make_group("r", 6, max_tokens=20))
    runner = DraftingRunner(sched, drafts=[7, 8, 9], accept=1)
    runner.step()  # prefill; the runner proposes 3 drafts after sampling
    seq = sched.running[0].seqs[0]
    assert seq.spec_token_ids == [7, 8, 9] and seq.get_len() == 7
    out = runner.step()
    assert out.num_scheduled_tokens == {"r": 4} and out.total_num_scheduled_tokens == 4
    assert out.scheduled_spec_decode_tokens == {"r": [7, 8, 9]}
    # lookahead: positions 6..9 need blocks 1 and 2 (block size 4)
    assert len(sched.block_manager.get_block_table(seq)) == 3
    # accepted 1 draft + the target's token: 2 tokens; KV valid for 6 (the old last) and 7
    assert seq.get_len() == 9 and seq.num_computed_tokens == 8
    assert seq.output_token_ids[1] == 7
    m = sched.stats()
    assert (
        m.num_spec_drafts_total,
        m.num_spec_draft_tokens_total,
        m.num_spec_accepted_tokens_total,
        m.num_spec_accepted_tokens_per_pos,
    ) == (1, 3, 1, (1, 0, 0))
    out = runner.step()  # position 8 onward: the rejected drafts' slots are written again
    assert out.num_scheduled_tokens == {"r": 4}
    assert len(sched.block_manager.get_block_table(seq)) == 3  # 8..11 fit block 2: no growth
    sched.block_manager.check_integrity()
    runner.run()
    assert sched.block_manager.get_num_free_gpu_blocks() == sched.block_manager.num_gpu_blocks


def test_drafts_never_pass_max_tokens_max_model_len_or_the_budget():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64)
    sched.add_seq_group(make_group("a", 6, max_tokens=3))
    sched.add_seq_group(make_group("b", 58, max_tokens=40))
    runner = DraftingRunner(sched, drafts=[1, 2, 3, 4, 5, 6], accept=6)
    runner.step()
    out = runner.step()
    # a: 1 output so far, max_tokens 3 -> at most 1 draft; b: 59 tokens, max_model_len 64 -> 4
    assert out.scheduled_spec_decode_tokens == {"a": [1], "b": [1, 2, 3, 4]}
    runner.run()
    groups = {g.request_id: g for g in runner.scheduler._groups.values()}
    assert not groups  # all finished
    budget = make_scheduler(max_num_batched_tokens=64, max_model_len=64, chunked=True)
    for i in range(3):
        budget.add_seq_group(make_group(f"r{i}", 4, max_tokens=30))
    runner = DraftingRunner(budget, drafts=list(range(40)), accept=0)
    runner.step()
    out = runner.step()
    assert out.total_num_scheduled_tokens <= 64
    # drafts leave one token of budget for each later decode
    assert (
        all(n >= 1 for n in out.num_scheduled_tokens.values())
        and len(out.num_scheduled_tokens) == 3
    )


def test_drafts_are_dropped_rather_than_preempt():
    sched = make_scheduler(block_size=4, num_gpu_blocks=4, num_cpu_blocks=8, max_model_len=16,
                           max_num_batched_tokens=16)
    sched.add_seq_group(make_group("a", 4, max_tokens=8, arrival=0))
    sched.add_seq_group(make_group("b", 4, max_tokens=8, arrival=1))
    runner = DraftingRunner(sched, drafts=[1, 2, 3, 4, 5, 6, 7], accept=0)
    runner.step()  # both prefilled: 2 blocks used, 2 free; each needs 1 more to decode
    out = runner.step()
    assert out.num_preemptions == 0
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    # drafts would need more blocks than the two both decodes need: they were cut to the slots
    # already there (positions 5..7 of block 1)
    sched.block_manager.check_integrity()
    assert sched.block_manager.get_num_free_gpu_blocks() == 0
    assert sum(out.num_scheduled_tokens.values()) - 2 == sum(
        len(d) for d in out.scheduled_spec_decode_tokens.values())


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_preemption_drops_drafts(mode):
    sched = make_scheduler(block_size=4, num_gpu_blocks=64, mode=mode)
    sched.add_seq_group(make_group("r", 6, max_tokens=20))
    sched.add_seq_group(make_group("s", 6, max_tokens=20))
    runner = DraftingRunner(sched, drafts=[7, 8], accept=0)
    runner.step()
    group = sched.running.pop()
    sched._preempt(group, SchedulerOutput(), alone=False)
    assert group.seqs[0].spec_token_ids == []
    runner.run()
    assert sched.block_manager.get_num_free_gpu_blocks() == sched.block_manager.num_gpu_blocks


def test_disable_by_batch_size_counts_the_running_queue():
    """vLLM compares `disable_by_batch_size` with the running queue: a step that schedules only
    some of the running requests still counts them all."""
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=64, chunked=True)
    runner = FakeRunner(sched)
    for i in range(3):
        sched.add_seq_group(make_group(f"r{i}", 20, arrival=i))
    for _ in range(3):
        out = runner.step()
        assert out.num_running_reqs == len(sched.running)
    assert out.speculation_batch_size == 2
    alone = SchedulerOutput(num_scheduled_tokens={"a": 1}, num_running_reqs=20)
    assert alone.speculation_batch_size == 20
    assert SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 1}).speculation_batch_size == 2
