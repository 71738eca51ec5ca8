"""A hypothesis state machine drives the scheduler with random arrivals, lengths, n, priorities,
aborts and tiny pools, in every mode. A fake runner keeps a fake KV cache (block -> token ids) and
applies the swap and copy mappings, so every step also checks that each scheduled sequence reads
its own tokens back through its block table, and that no shared block is ever written.

With speculation on, the runner proposes random draft tokens after each sample and "verification"
accepts a random prefix of them: the KV written for rejected drafts must never be read back (the
check below reads every context position), and max_tokens must hold.

Disaggregation runs in every example (a kv_both connector): some requests pull their prompt's KV
from a "peer" (the runner lands the pull into their blocks, or fails it, when the machine says),
some keep their blocks for a peer after they finish, until "sent" or timed out.

Embedding requests (prefill-only, pooled) arrive too: the runner pools instead of sampling, and
checks that a MEAN or CLS request's chunks cover its prompt from position 0 without a gap
(never from a prefix-cache hit), through preemption of either kind."""

from __future__ import annotations

import random

from core_fakes import FakeRunner, group_id, make_group, make_scheduler, samples_this_step
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from tessera.config import KVTransferConfig, PreemptionMode
from tessera.core.kv_connector import PullConnectorScheduler
from tessera.lora.request import LoRARequest
from tessera.pooling_params import PoolingParams
from tessera.sequence import SequenceStatus
from tessera.utils import cdiv

MAX_MODEL_LEN = 24
COMMON_PREFIX = list(range(500, 500 + MAX_MODEL_LEN))


class CheckingRunner(FakeRunner):
    """Reads and writes a fake KV cache through the block tables it rebuilt from the messages
    alone, and checks them (and its token copies) against the scheduler's own state."""

    def __init__(self, scheduler, num_spec: int = 0, seed: int = 0) -> None:
        super().__init__(scheduler)
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.num_spec = num_spec
        self.rng = random.Random(seed)
        self.pulls: dict[str, list[int]] = {}  # req_id -> local blocks its peer's KV goes to
        self.landed: list[tuple[str, list[int], bool]] = []
        self.serving: set[str] = set()
        self.reports: dict[str, list[str]] = {"sent": [], "recv": [], "failed": []}
        self.pooling: dict[str, str] = {}  # embedding requests: req_id -> pooling type
        self.covered: dict[str, int] = {}  # ... and the prompt positions their chunks covered
        self.pooled: set[str] = set()  # those that got their vector

    def apply(self, out):
        super().apply(out)
        for new in out.scheduled_new_reqs:
            if new.pooling_params is not None:
                self.pooling[new.req_id] = new.pooling_params.pooling_type

    def pool(self, out, result):
        """Embedding requests pool instead of sampling: the vector comes with the prompt's last
        chunk, and positions must be seen in order from 0 unless the type is LAST."""
        for req_id, n in out.num_scheduled_tokens.items():
            if req_id not in self.pooling:
                continue
            start = self.requests[req_id].num_computed_tokens
            if start == 0:
                self.covered[req_id] = 0
            if self.pooling[req_id] != "LAST":
                assert start <= self.covered.get(req_id, 0), f"{req_id}: pooled with a gap"
            self.covered[req_id] = max(self.covered.get(req_id, 0), start + n)
        rows = [i for i, r in enumerate(result.req_ids) if r in self.pooling]
        for i in reversed(rows):
            req_id = result.req_ids.pop(i)
            result.sampled_token_ids.pop(i)
            if result.spec_token_ids:
                result.spec_token_ids.pop(i)
            result.pooler_output[req_id] = [1.0]
            self.pooled.add(req_id)
        return result

    def land(self, req_id: str, ok: bool) -> None:
        """The pull of `req_id` ends; its data is written (as the real worker does) in the next
        step, after that step's cancellations."""
        self.landed.append((req_id, self.pulls.pop(req_id), ok))

    def write_landed(self) -> None:
        for req_id, blocks, ok in self.landed:
            self.write_pull(req_id, blocks, ok)
        self.landed = []

    def write_pull(self, req_id: str, blocks: list[int], ok: bool) -> None:
        if ok and blocks:
            bm = self.scheduler.block_manager
            bs = bm.block_size
            _, seq = self.scheduler._live[req_id]
            prompt = seq.prompt_token_ids
            first = seq.num_computed_tokens // bs  # its own prefix hits are not overwritten
            for i, block in enumerate(blocks):
                assert bm.gpu.ref_counts[block] == 1, f"pulling into shared block {block}"
                self.gpu[block] = [prompt[p] if p < len(prompt) else None
                                   for p in range((first + i) * bs, (first + i + 1) * bs)]
        self.reports["recv" if ok else "failed"].append(req_id)
    def propose(self, req_id, tokens):
        if not self.num_spec:
            return []
        # drafts numbered apart from sampled tokens, so a stale one would read back wrong
        return [2000 + self.rng.randrange(100) for _ in range(self.rng.randint(0, self.num_spec))]

    def num_accepted(self, req_id, drafts):
        return self.rng.randint(0, len(drafts))

    def execute(self, out):
        sched = self.scheduler
        bm = sched.block_manager
        bs = bm.block_size
        # cache ops first, in the order the cache engine applies them
        for src, dst in out.blocks_to_swap_out.items():
            self.cpu[dst] = list(self.gpu.get(src, [None] * bs))
        for src, dst in out.blocks_to_swap_in.items():
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        meta = out.kv_connector_metadata
        if meta is not None:
            for req_id in meta.reqs_to_cancel:
                self.pulls.pop(req_id, None)
                self.serving.discard(req_id)
                self.landed = [x for x in self.landed if x[0] != req_id]
            self.serving.update(meta.reqs_to_send)
            for req_id, pull in meta.reqs_to_recv.items():
                self.pulls[req_id] = pull.local_block_ids
        self.write_landed()
        self.apply(out)
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            _, seq = sched._live[req_id]
            tokens, table, start = req.token_ids, req.block_ids, req.num_computed_tokens
            assert tokens == seq.get_token_ids(), f"{req_id}: runner's tokens drifted"
            assert table == bm.get_block_table(seq), f"{req_id}: runner's block table drifted"
            assert start == seq.num_computed_tokens
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            if drafts:  # a decode verifying its drafts
                assert start + 1 == len(tokens) and n == 1 + len(drafts), (req_id, n, drafts)
                assert len(tokens) + len(drafts) < MAX_MODEL_LEN
                max_tokens = sched._groups[group_id(req_id)].sampling_params.max_tokens
                assert len(seq.output_token_ids) + len(drafts) < max_tokens
                tokens = tokens + drafts
            assert n >= 1 and start + n <= len(tokens)
            assert len(table) * bs >= start + n, "block table too short"
            for p in range(start):  # the context reads back as this sequence's tokens
                assert self.gpu[table[p // bs]][p % bs] == tokens[p], (req_id, p)
            for p in range(start, start + n):
                block = table[p // bs]
                assert bm.gpu.ref_counts[block] == 1, f"writing shared block {block}"
                self.gpu.setdefault(block, [None] * bs)[p % bs] = tokens[p]
        result = self.pool(out, super().execute_sampling(out))
        result.finished_sending, result.finished_recving, result.failed_recving = (
            self.reports["sent"], self.reports["recv"], self.reports["failed"])
        self.reports = {"sent": [], "recv": [], "failed": []}
        return result


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
        num_spec=st.sampled_from([0, 0, 1, 3, 6]),
        seed=st.integers(0, 2**16),
        max_loras=st.sampled_from([None, None, 1, 2]),
    )
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, chunked, budget, max_num_seqs,
              mode, priority, prefix, watermark, num_spec, seed, max_loras):
        if not chunked:
            budget = max(budget, MAX_MODEL_LEN)
        self.budget, self.max_num_seqs = budget, max_num_seqs
        self.now = 0.0
        kv = PullConnectorScheduler(
            KVTransferConfig(kv_role="kv_both", kv_connector_extra_config={"hold_timeout": 3}),
            block_size, clock=lambda: self.now, engine_id="peer")
        self.sched = make_scheduler(
            block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
            chunked=chunked, mode=mode, priority=priority, prefix=prefix, watermark=watermark,
            kv_connector=kv, max_loras=max_loras,
        )
        self.max_loras = max_loras
        self.runner = CheckingRunner(self.sched, num_spec, seed)
        self.groups = []
        self.by_id = {}
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
        kv=st.sampled_from([None, None, "pull", "serve"]),
        lora=st.sampled_from([0, 0, 1, 2, 3]),
    )
    def add_request(self, prompt_len, shared, max_tokens, n, prio, kv, lora):
        req_id = f"r{len(self.groups)}"
        shared = min(shared, prompt_len)
        prompt = COMMON_PREFIX[:shared] + [
            len(self.groups) * 64 + i for i in range(prompt_len - shared)
        ]
        group = make_group(req_id, 0, prompt=prompt, n=n, max_tokens=max_tokens,
                           arrival=float(len(self.groups)), priority=prio)
        if self.max_loras is not None and lora:  # a LoRA adapter (--max-loras): no remote KV
            group.lora_request = LoRARequest(f"a{lora}", lora, "/unused")
            for seq in group.seqs:
                seq.lora_int_id = lora
            kv = None
        if kv == "pull" and n == 1:  # its prompt's KV comes from a peer
            group.sampling_params.kv_transfer_params = {
                "do_remote_prefill": True,
                "remote_host": "peer",
                "remote_port": 1,
                "remote_block_ids": list(
                    range(cdiv(prompt_len, self.sched.block_manager.block_size))
                ),
                "remote_engine_id": "peer",
                "remote_request_id": req_id,
            }
        elif kv == "serve" and n == 1:  # its blocks wait for a peer once it finishes
            group.sampling_params.kv_transfer_params = {"do_remote_decode": True}
        self.groups.append(group)
        self.by_id[req_id] = group
        self.feasible[req_id] = self._is_feasible(prompt_len, max_tokens, n)
        self.sched.add_seq_group(group)

    @rule(prompt_len=st.integers(1, MAX_MODEL_LEN + 4), shared=st.integers(0, MAX_MODEL_LEN),
          pooling_type=st.sampled_from(["LAST", "MEAN", "CLS"]))
    def add_embedding(self, prompt_len, shared, pooling_type):
        req_id = f"r{len(self.groups)}"
        shared = min(shared, prompt_len)
        prompt = COMMON_PREFIX[:shared] + [len(self.groups) * 64 + i
                                           for i in range(prompt_len - shared)]
        group = make_group(req_id, 0, prompt=prompt, max_tokens=1,
                           arrival=float(len(self.groups)))
        group.pooling_params = PoolingParams(normalize=True, pooling_type=pooling_type)
        self.groups.append(group)
        self.by_id[req_id] = group
        self.feasible[req_id] = self._is_feasible(prompt_len, 0, 1)
        self.sched.add_seq_group(group)

    @precondition(lambda self: any(not g.is_finished() for g in self.groups))
    @rule(data=st.data())
    def abort(self, data):
        live = [g for g in self.groups if not g.is_finished()]
        group = data.draw(st.sampled_from(live))
        assert self.sched.abort_seq_group(group.request_id) == [group]
        self.aborted.add(group.request_id)
        self.check()

    @precondition(lambda self: bool(self.runner.pulls))
    @rule(data=st.data(), ok=st.booleans())
    def land_pull(self, data, ok):
        req_id = data.draw(st.sampled_from(sorted(self.runner.pulls)))
        self.runner.land(req_id, ok)

    @precondition(lambda self: bool(self.runner.serving))
    @rule(data=st.data())
    def peer_pulls(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.runner.serving)))
        self.runner.serving.discard(req_id)
        self.runner.reports["sent"].append(req_id)

    @rule(seconds=st.sampled_from([1.0, 4.0]))
    def time_passes(self, seconds):
        self.now += seconds

    @rule(times=st.integers(1, 6))
    def step(self, times):
        for _ in range(times):
            self.do_step()

    def do_step(self):
        out = self.runner.step()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= self.budget
        assert len(out.num_scheduled_tokens) <= self.max_num_seqs
        if not self.sched.config.enable_chunked_prefill:
            sampled = samples_this_step(out, self.runner)
            for req_id in out.num_scheduled_tokens:
                req = self.runner.requests[req_id]
                assert req_id in sampled or req.output_token_ids, "prompt split without chunking"
        for req_id in out.ignored_request_ids:
            group = self.by_id[req_id]
            assert group.error and not self.feasible[req_id], group.error
            self.ignored.add(req_id)
        self.check()

    def check(self):
        sched = self.sched
        sched.block_manager.check_integrity()
        where: dict[int, str] = {}
        sched.check_remote_kv_integrity()
        for name in ("waiting", "running", "swapped", "waiting_for_remote_kvs"):
            groups = getattr(sched, name)
            for g in (groups.values() if isinstance(groups, dict) else groups):
                assert id(g) not in where, f"{g.request_id} in {where[id(g)]} and {name}"
                where[id(g)] = name
                assert not g.is_finished()
                status = {"waiting": SequenceStatus.WAITING, "running": SequenceStatus.RUNNING,
                          "swapped": SequenceStatus.SWAPPED,
                          "waiting_for_remote_kvs": SequenceStatus.WAITING_FOR_REMOTE_KVS}[name]
                for s in g.get_unfinished_seqs():
                    assert s.status is status, (g.request_id, name, s.status)
                    assert sched.block_manager.has_blocks(s) == (name != "waiting")
        for g in self.groups:
            assert g.is_finished() or id(g) in where, f"{g.request_id} lost"
        if self.max_loras is not None:  # --max-loras distinct adapters at most run at once
            assert len({g.lora_int_id for g in sched.running if g.lora_int_id}) <= self.max_loras
        assert sum(g.max_num_running_seqs() for g in sched.running) + len(
            sched.waiting_for_remote_kvs) <= self.max_num_seqs

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        steps = 0
        while self.sched.has_unfinished_seqs() or self.sched.has_pending_kv_transfers():
            for req_id in sorted(self.runner.pulls):  # every pull lands, every peer comes
                self.runner.land(req_id, True)
            self.runner.reports["sent"] += sorted(self.runner.serving)
            self.runner.serving.clear()
            self.do_step()
            steps += 1
            assert steps < 2000, "requests never finished"
        for g in self.groups:
            assert g.is_finished()
            if g.request_id in self.aborted:
                continue
            assert all(s.get_output_len() <= g.sampling_params.max_tokens for s in g.seqs)
            if g.pooling_params is not None and self.feasible[g.request_id]:
                assert g.seqs[0].status is SequenceStatus.FINISHED_STOPPED
                assert g.seqs[0].output_token_ids == [] and g.request_id in self.runner.pooled
            elif self.feasible[g.request_id]:
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
