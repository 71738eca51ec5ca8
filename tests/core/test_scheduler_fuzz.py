"""A hypothesis state machine drives the scheduler with random arrivals, lengths, n, priorities,
aborts and tiny pools, in every mode. A fake runner keeps a fake KV cache (block -> token ids) and
applies the swap and copy mappings, so every step also checks that each scheduled sequence reads
its own tokens back through its block table, and that no shared block is ever written."""

from __future__ import annotations

from core_fakes import FakeRunner, make_group, make_scheduler
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from tessera.config import PreemptionMode
from tessera.sequence import SequenceStatus

MAX_MODEL_LEN = 24
COMMON_PREFIX = list(range(500, 500 + MAX_MODEL_LEN))


class CheckingRunner(FakeRunner):
    def __init__(self, scheduler, max_model_len: int) -> None:
        super().__init__(scheduler)
        self.max_model_len = max_model_len
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}

    def step(self):
        sched = self.scheduler
        bm = sched.block_manager
        out = sched.schedule()
        bs = bm.block_size
        # cache ops first, in the order the cache engine applies them
        for src, dst in out.blocks_to_swap_out.items():
            self.cpu[dst] = list(self.gpu.get(src, [None] * bs))
        for src, dst in out.blocks_to_swap_in.items():
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        for sg in out.scheduled_groups:
            for ss in sg.seqs:
                seq, start, n = ss.seq, ss.num_computed_tokens, ss.num_new_tokens
                tokens = seq.get_token_ids()
                table = ss.block_table
                assert n >= 1 and start + n <= len(tokens)
                assert len(table) * bs >= start + n, "block table too short"
                for p in range(start):  # the context reads back as this sequence's tokens
                    assert self.gpu[table[p // bs]][p % bs] == tokens[p], (seq.seq_id, p)
                for p in range(start, start + n):
                    block = table[p // bs]
                    assert bm.gpu.ref_counts[block] == 1, f"writing shared block {block}"
                    self.gpu.setdefault(block, [None] * bs)[p % bs] = tokens[p]
        sampled = [(sg.group, ss.seq) for sg in out.scheduled_groups for ss in sg.seqs if ss.do_sample]
        sched.update_after_step(out)
        for group, seq in sampled:
            seq.append_token(1000 + (seq.seq_id * 31 + seq.get_len()) % 997)
            n = group.sampling_params.n
            if len(group.seqs) == 1 and n > 1 and seq.get_output_len() == 1:
                for i in range(n - 1):
                    child = seq.fork(seq.seq_id * 100 + i + 1)
                    child.output_token_ids[-1] += i + 1  # children sample their own tokens
                    sched.fork_seq(group, seq, child)
        for group, _ in sampled:
            for s in group.seqs:
                if s.status is SequenceStatus.RUNNING and (
                    s.get_output_len() >= group.sampling_params.max_tokens
                    or s.get_len() >= self.max_model_len
                ):
                    s.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        self.finished += sched.free_finished_seq_groups()
        return out


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_gpu_blocks=st.integers(3, 40),
        num_cpu_blocks=st.sampled_from([0, 3, 8, 64]),
        chunked=st.booleans(),
        budget=st.integers(4, 40),
        max_num_seqs=st.integers(3, 8),
        mode=st.sampled_from([None, PreemptionMode.SWAP, PreemptionMode.RECOMPUTE]),
        priority=st.booleans(),
        prefix=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1]),
    )
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, chunked, budget, max_num_seqs,
              mode, priority, prefix, watermark):
        if not chunked:
            budget = max(budget, MAX_MODEL_LEN)
        self.budget, self.max_num_seqs = budget, max_num_seqs
        self.sched = make_scheduler(
            block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
            chunked=chunked, mode=mode, priority=priority, prefix=prefix, watermark=watermark,
        )
        self.runner = CheckingRunner(self.sched, MAX_MODEL_LEN)
        self.groups = []
        self.feasible: dict[str, bool] = {}
        self.aborted: set[str] = set()
        self.ignored: set[str] = set()

    def _is_feasible(self, prompt_len, max_tokens, n) -> bool:
        bm = self.sched.block_manager
        final_len = min(prompt_len + max_tokens, MAX_MODEL_LEN)
        blocks = n * -(-final_len // bm.block_size)
        return (
            prompt_len <= MAX_MODEL_LEN
            and blocks <= bm.num_gpu_blocks - bm.watermark_blocks
            and n <= min(self.max_num_seqs, self.budget)
        )

    @rule(
        prompt_len=st.integers(1, MAX_MODEL_LEN + 4),
        shared=st.integers(0, MAX_MODEL_LEN),
        max_tokens=st.integers(1, 10),
        n=st.sampled_from([1, 1, 1, 2, 3]),
        prio=st.integers(0, 3),
    )
    def add_request(self, prompt_len, shared, max_tokens, n, prio):
        req_id = f"r{len(self.groups)}"
        shared = min(shared, prompt_len)
        prompt = COMMON_PREFIX[:shared] + [len(self.groups) * 64 + i for i in range(prompt_len - shared)]
        group = make_group(req_id, 0, prompt=prompt, n=n, max_tokens=max_tokens,
                           arrival=float(len(self.groups)), priority=prio)
        self.groups.append(group)
        self.feasible[req_id] = self._is_feasible(prompt_len, max_tokens, n)
        self.sched.add_seq_group(group)

    @precondition(lambda self: any(not g.is_finished() for g in self.groups))
    @rule(data=st.data())
    def abort(self, data):
        live = [g for g in self.groups if not g.is_finished()]
        group = data.draw(st.sampled_from(live))
        assert self.sched.abort_seq_group(group.request_id) == [group]
        self.aborted.add(group.request_id)
        self.check()

    @rule(times=st.integers(1, 6))
    def step(self, times):
        for _ in range(times):
            self.do_step()

    def do_step(self):
        out = self.runner.step()
        assert out.num_batched_tokens <= self.budget
        assert sum(len(sg.seqs) for sg in out.scheduled_groups) <= self.max_num_seqs
        if not self.sched.config.enable_chunked_prefill:
            for sg in out.scheduled_groups:
                for ss in sg.seqs:
                    assert ss.do_sample or ss.seq.get_output_len() > 0, "prompt split without chunking"
        for g in out.ignored_groups:
            assert g.error and not self.feasible[g.request_id], g.error
            self.ignored.add(g.request_id)
        self.check()

    def check(self):
        sched = self.sched
        sched.block_manager.check_integrity()
        where: dict[int, str] = {}
        for name in ("waiting", "running", "swapped"):
            for g in getattr(sched, name):
                assert id(g) not in where, f"{g.request_id} in {where[id(g)]} and {name}"
                where[id(g)] = name
                assert not g.is_finished()
                status = {"waiting": SequenceStatus.WAITING, "running": SequenceStatus.RUNNING,
                          "swapped": SequenceStatus.SWAPPED}[name]
                for s in g.get_unfinished_seqs():
                    assert s.status is status, (g.request_id, name, s.status)
                    assert sched.block_manager.has_blocks(s) == (name != "waiting")
        for g in self.groups:
            assert g.is_finished() or id(g) in where, f"{g.request_id} lost"
        assert sum(g.max_num_running_seqs() for g in sched.running) <= self.max_num_seqs

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        steps = 0
        while self.sched.has_unfinished_seqs():
            self.do_step()
            steps += 1
            assert steps < 2000, "requests never finished"
        for g in self.groups:
            assert g.is_finished()
            if g.request_id in self.aborted:
                continue
            if self.feasible[g.request_id]:
                assert all(s.status is SequenceStatus.FINISHED_LENGTH_CAPPED for s in g.seqs)
                assert len(g.seqs) == g.sampling_params.n
            else:
                assert g.request_id in self.ignored or all(
                    s.status is SequenceStatus.FINISHED_LENGTH_CAPPED for s in g.seqs
                )
        bm = self.sched.block_manager
        assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
        assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase
