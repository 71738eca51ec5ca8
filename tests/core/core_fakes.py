"""Tiny builders and a fake model runner for the scheduler tests (no model, no tensors)."""

from __future__ import annotations

import itertools
import re
import zlib
from dataclasses import dataclass

from tessera.config import CacheConfig, PreemptionMode, SchedulerConfig, SchedulingPolicy
from tessera.core.block_manager import NULL_BLOCK
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler import Scheduler
from tessera.core.scheduler_output import SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceGroup, new_seq_id


def stable_id(text: str) -> int:
    """The same number in every process (unlike hash(str))."""
    return zlib.crc32(text.encode())


def make_group(
    req_id: str,
    prompt_len: int,
    *,
    n: int = 1,
    max_tokens: int = 8,
    arrival: float = 0.0,
    priority: int = 0,
    prompt: list[int] | None = None,
) -> SequenceGroup:
    base = stable_id(req_id) % 1000
    tokens = list(prompt) if prompt is not None else [base + i for i in range(prompt_len)]
    seq = Sequence(seq_id=new_seq_id(), prompt_token_ids=tokens)
    return SequenceGroup(
        request_id=req_id,
        seqs=[seq],
        sampling_params=SamplingParams(n=n, max_tokens=max_tokens),
        arrival_time=arrival,
        priority=priority,
    )


def make_scheduler(
    *,
    block_size: int = 4,
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    chunked: bool = False,
    mode: PreemptionMode | None = None,
    priority: bool = False,
    prefix: bool = False,
    watermark: float = 0.0,
    eos_token_ids: tuple[int, ...] = (),
    kv_connector=None,
    max_loras: int | None = None,
    sliding_window: int | None = None,
) -> Scheduler:
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
        scheduling_policy=SchedulingPolicy.PRIORITY if priority else SchedulingPolicy.FCFS,
    )
    cache_cfg = CacheConfig(
        block_size=block_size, enable_prefix_caching=prefix, watermark=watermark,
        sliding_window=sliding_window,
    )
    clock = itertools.count()
    return Scheduler(sched_cfg, cache_cfg, num_gpu_blocks, num_cpu_blocks,
                     clock=lambda: float(next(clock)), eos_token_ids=eos_token_ids,
                     kv_connector=kv_connector, max_loras=max_loras)


@dataclass
class FakeRequest:
    """The fake runner's own copy of a request, built only from the messages."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class FakeRunner:
    """Plays the model runner: keeps a persistent batch from the scheduler's messages and
    "samples" a deterministic token wherever a step completes a sequence (n of them when a
    prompt of an n > 1 request completes); `update_from_output` does the rest."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.requests: dict[str, FakeRequest] = {}
        self.finished: list[str] = []  # request ids, in the order they finished

    def apply(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = FakeRequest(
                list(new.prompt_token_ids), list(new.output_token_ids), list(new.block_ids),
                new.num_computed_tokens,
            )
        for diff in out.scheduled_cached_reqs:
            req = self.requests[diff.req_id]
            req.output_token_ids += diff.new_token_ids
            req.block_ids = (
                diff.new_block_ids if diff.replace_block_ids else req.block_ids + diff.new_block_ids
            )
            req.num_computed_tokens = diff.num_computed_tokens

    def sample(self, req_id: str, req: FakeRequest, k: int) -> int:
        return 1000 + (stable_id(req_id) * 31 + len(req.token_ids) + k) % 997

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.apply(out)
        return self.execute_sampling(out)

    def num_accepted(self, req_id: str, drafts: list[int]) -> int:
        """How many of a request's draft tokens "verification" accepts (speculative decoding)."""
        return len(drafts)

    def propose(self, req_id: str, tokens: list[int]) -> list[int]:
        """Draft tokens to follow `tokens` (none: no speculation)."""
        return []

    def execute_sampling(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        spec = out.scheduled_spec_decode_tokens
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            drafts = spec.get(req_id, [])
            if req.num_computed_tokens + n == len(req.token_ids) + len(drafts):
                num = out.num_samples.get(req_id, 1)
                if drafts:  # accepted drafts, then the "target's" own next token
                    a = self.num_accepted(req_id, drafts)
                    tokens = drafts[:a] + [self.sample(req_id, req, a)]
                else:
                    tokens = [self.sample(req_id, req, k) for k in range(num)]
                result.req_ids.append(req_id)
                result.sampled_token_ids.append(tokens)
                result.spec_token_ids.append(
                    self.propose(req_id, req.token_ids + tokens) if num == 1 else [])
        return result

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        for core in self.scheduler.update_from_output(out, self.execute(out)):
            if core.finished:
                self.finished.append(core.request_id)
        return out

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.scheduler.has_unfinished_seqs():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps


def group_id(req_id: str) -> str:
    """The request a runner-facing id belongs to ("2_pair" is the second child of "pair")."""
    m = re.fullmatch(r"\d+_(.+)", req_id)
    return m.group(1) if m else req_id


def scheduled_tokens(out: SchedulerOutput) -> dict[str, int]:
    """Tokens per request (its sequences summed), in scheduling order."""
    result: dict[str, int] = {}
    for req_id, n in out.num_scheduled_tokens.items():
        result[group_id(req_id)] = result.get(group_id(req_id), 0) + n
    return result


def samples_this_step(out: SchedulerOutput, runner: FakeRunner) -> set[str]:
    """req_ids whose step completes their KV (they sample), from the runner's own copies."""
    return {
        req_id for req_id, n in out.num_scheduled_tokens.items()
        if runner.requests[req_id].num_computed_tokens + n == len(runner.requests[req_id].token_ids)
    }


class FakeKVRunner(FakeRunner):
    """The fake runner plus a fake KV cache: each scheduled token writes (token, position, group)
    into every group's slot, and each query reads back every key its group's window shows.
    `draft_group`: a group that plays the draft model's (core/block_manager.py): it recomputes
    a request's KV from position 0 whenever the request is sent whole, then reads the whole
    context."""

    def __init__(self, scheduler: Scheduler, windows: tuple[int | None, ...],
                 draft_group: int | None = None) -> None:
        super().__init__(scheduler)
        self.windows = windows
        self.draft_group = draft_group
        self.bs = scheduler.block_manager.block_size
        self.gpu: dict[int, dict[int, tuple]] = {}
        self.cpu: dict[int, dict[int, tuple]] = {}
        self.draft_computed: dict[str, int] = {}

    def execute(self, out):
        self.apply(out)
        for new in out.scheduled_new_reqs:
            self.draft_computed[new.req_id] = 0
        for src, dst in out.blocks_to_swap_out.items():
            self.cpu[dst] = dict(self.gpu.get(src, {}))
        for src, dst in out.blocks_to_swap_in.items():
            self.gpu[dst] = dict(self.cpu.get(src, {}))
        copied = {src: dict(self.gpu.get(src, {})) for src, _ in out.blocks_to_copy}
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = dict(copied[src])
        ng, bs = len(self.windows), self.bs
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            tokens, table, start = req.token_ids, req.block_ids, req.num_computed_tokens
            for g, window in enumerate(self.windows):
                first = self.draft_computed[req_id] if g == self.draft_group else start
                for p in range(first, start + n):
                    block = table[p // bs * ng + g]
                    assert block != NULL_BLOCK, f"{req_id} writes position {p} into a hole"
                    self.gpu.setdefault(block, {})[p % bs] = (tokens[p], p, g)
                for q in range(start, start + n):
                    lo = 0 if window is None else max(0, q - window + 1)
                    for k in range(lo, q + 1):
                        block = table[k // bs * ng + g]
                        got = self.gpu.get(block, {}).get(k % bs)
                        assert got == (tokens[k], k, g), f"{req_id} group {g} key {k}: {got}"
            self.draft_computed[req_id] = start + n
        return self.execute_sampling(out)
