"""Drive a `ModelRunner` without a scheduler: fixed sequences on fixed block ranges, each step
sent to the runner as the same messages a scheduler would send. For benchmarks that time the
runner alone and for tests that compare it with a reference model."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.utils import cdiv
from tessera.worker.model_runner import ModelRunner


@dataclass
class StaticSeq:
    req_id: str
    prompt: list[int]
    block_table: list[int]
    num_new_tokens: int  # tokens the next step computes
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_sent_outputs: int | None = None  # None: not yet sent to the runner


class StaticBatch:
    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.next_block = 0
        self._ids = itertools.count()

    def new_seq(self, prompt: list[int], max_len: int) -> StaticSeq:
        """A sequence with blocks for `max_len` tokens, its whole prompt to compute next."""
        # one block per token block in each KV cache group (their tables interleaved)
        n = cdiv(max_len, self.block_size) * self.runner.num_kv_cache_groups
        table = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return StaticSeq(f"static-{next(self._ids)}", list(prompt), table, len(prompt))

    def message(self, seqs: list[StaticSeq]) -> SchedulerOutput:
        """The step's `SchedulerOutput`, applied to the runner's persistent batch."""
        out = SchedulerOutput()
        for s in seqs:
            if s.num_sent_outputs is None:
                out.scheduled_new_reqs.append(NewRequestData(
                    s.req_id, s.prompt, list(s.output_token_ids), SamplingParams(temperature=0),
                    s.block_table, s.num_computed_tokens))
            else:
                out.scheduled_cached_reqs.append(CachedRequestData(
                    s.req_id, s.output_token_ids[s.num_sent_outputs :], [], False,
                    s.num_computed_tokens))
            s.num_sent_outputs = len(s.output_token_ids)
            out.num_scheduled_tokens[s.req_id] = s.num_new_tokens
        self.runner.requests.update(out)
        return out

    @torch.inference_mode()
    def logits(self, seqs: list[StaticSeq], all_positions: bool = False) -> torch.Tensor:
        """Logits at the sampled positions (decodes first, then prompts), or at every position."""
        runner = self.runner
        inp = runner.prepare_input(self.message(seqs))
        h = runner.model.forward(inp.input_ids, inp.positions, runner.cache_engine.kv_caches,
                                 inp.attn_metadata)
        return runner.model.compute_logits(
            h if all_positions else h.index_select(0, inp.logits_indices)
        )

    @staticmethod
    def advance(seqs: list[StaticSeq], next_ids: list[int]) -> None:
        """Append one token to each sequence; the next step decodes it."""
        for s, t in zip(seqs, next_ids, strict=True):
            s.num_computed_tokens += s.num_new_tokens
            s.output_token_ids.append(t)
            s.num_new_tokens = 1
