"""What the model runner already holds of each request, so that each step sends only diffs.

The runner keeps a persistent copy of every request it has been sent (tokens, block table,
generator). For a request it has, a step carries only what changed since it last saw it: the
tokens appended, the blocks appended. Two events break the append-only picture:

- preemption (swap or recompute): the request comes back with a new table (and, for recompute,
  num_computed_tokens 0), so it is sent whole again as a new request. The runner keeps its
  generator, so a seeded request draws the same numbers whatever preempted it;
- copy-on-write: a forked stream's next token lands in a block it shares, and the block manager
  swaps that block for a private copy. It is always the last block the runner was sent (tokens are
  only ever written after `num_computed_tokens`), so checking that one id detects it; the whole
  table is then sent again.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class _Sent:
    num_tokens: int
    num_blocks: int
    last_block: int


def stream_seed(seed: int, index: int) -> int:
    """The seed of a request's `index`-th stream: seed + index, wrapped into the unsigned 64-bit
    range every generator accepts (a request's own seed may be any 64-bit value)."""
    return (seed + index) % 2**64


class RunnerView:
    def __init__(self) -> None:
        # req_id -> what was sent; None: the runner holds the request but must be sent it whole
        self._sent: dict[str, _Sent | None] = {}
        self._finished: list[str] = []

    def describe(
        self, group: SequenceGroup, seq: Sequence, table: list[int], out: SchedulerOutput
    ) -> None:
        """Add `seq`'s entry for this step to `out`: whole if the runner lacks it, else a diff."""
        req_id = seq.req_id
        sent = self._sent.get(req_id)
        num_prompt = len(seq.prompt_token_ids)
        num_tokens = num_prompt + len(seq.output_token_ids)
        last = table[-1] if table else -1
        if sent is None:
            seed = group.sampling_params.seed
            out.scheduled_new_reqs.append(NewRequestData(
                req_id=req_id,
                prompt_token_ids=tuple(seq.prompt_token_ids),
                output_token_ids=tuple(seq.output_token_ids),
                sampling_params=group.sampling_params.clone(),
                block_ids=tuple(table),
                num_computed_tokens=seq.num_computed_tokens,
                seed=None if seed is None else stream_seed(seed, seq.index),
                pooling_params=group.pooling_params,
                lora_request=group.lora_request,
            ))
            self._sent[req_id] = _Sent(num_tokens, len(table), last)
            return
        n = sent.num_blocks
        appended = len(table) >= n and (n == 0 or table[n - 1] == sent.last_block)
        start = sent.num_tokens
        new_tokens = (
            seq.output_token_ids[start - num_prompt :] if start >= num_prompt
            else seq.get_token_ids_range(start, num_tokens)
        )
        out.scheduled_cached_reqs.append(CachedRequestData(
            req_id, new_tokens, table[n:] if appended else list(table), not appended,
            seq.num_computed_tokens,
        ))
        # in place: one object per request, not per step
        sent.num_tokens, sent.num_blocks, sent.last_block = num_tokens, len(table), last

    def resend_whole(
        self, scheduler_output: SchedulerOutput,
        requests: list[tuple[SequenceGroup, Sequence, list[int]]],
    ) -> SchedulerOutput:
        """The part of `scheduler_output` that concerns `requests` (group, sequence, its block
        table), each sent whole (`Scheduler.resend_whole`: the runner's copy may hold
        half-applied diffs of a step that raised; a whole one replaces it)."""
        sub = SchedulerOutput()
        for group, seq, table in requests:
            req_id = seq.req_id
            self.preempted(seq)  # marks it to be described whole
            self.describe(group, seq, table, sub)
            n = scheduler_output.num_scheduled_tokens[req_id]
            sub.num_scheduled_tokens[req_id] = n
            sub.total_num_scheduled_tokens += n
            if req_id in scheduler_output.num_samples:
                sub.num_samples[req_id] = scheduler_output.num_samples[req_id]
            if req_id in scheduler_output.scheduled_spec_decode_tokens:
                sub.scheduled_spec_decode_tokens[req_id] = (
                    scheduler_output.scheduled_spec_decode_tokens[req_id])
        return sub

    def preempted(self, seq: Sequence) -> None:
        """Its blocks (and, for recompute, its progress) are gone: send it whole next time."""
        if seq.req_id in self._sent:
            self._sent[seq.req_id] = None

    def finished(self, seq: Sequence) -> None:
        """The runner can drop it (finished or aborted); it is told with the next step."""
        if self._sent.pop(seq.req_id, _MISSING) is not _MISSING:
            self._finished.append(seq.req_id)

    def take_finished(self) -> list[str]:
        finished, self._finished = self._finished, []
        return finished


_MISSING = object()
