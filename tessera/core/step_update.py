"""`StepUpdate`: what a step computed, applied to the sequences it scheduled. The scheduler owns
one and calls `apply` from `Scheduler.update_from_output`; it hands over the step's two messages
and its live streams, and gets back the outputs, the sequences that finished and the children
forked. Freeing, the queues and the remote-KV tracker stay the scheduler's.

Per scheduled stream it advances `num_computed_tokens` by the tokens actually computed (a rejected
draft token's KV does not count: a stream that verified k drafts and got a + 1 tokens back, the a
accepted drafts and the target's own next token, advances by 1 + a), stores the drafts the runner
proposed for its next step, appends the sampled tokens up to the first that stops the stream
(core/stop_conditions.py), forks the n-1 children of an n > 1 request when its prompt completes,
finishes an embedding request whose prompt completed (with the runner's pooled vector), and offers
newly full blocks to the prefix cache. Progress and status change through `set_progress`
(core/progress.py). It keeps the token counters the engine's metrics report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tessera.core.block_manager import BlockManager
from tessera.core.core_output import EngineCoreOutput, SeqDelta
from tessera.core.progress import set_progress
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.core.stop_conditions import check_token_stop
from tessera.outputs import RequestMetrics
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus, child_req_id, new_seq_id

_RUNNING = SequenceStatus.RUNNING

# request id -> (its group, its output this step), in the order requests were first touched
Touched = dict[str, tuple[SequenceGroup, EngineCoreOutput]]


@dataclass(slots=True)
class StepResult:
    """What `StepUpdate.apply` did that its caller must finish."""

    outputs: Touched = field(default_factory=dict)
    finished: list[tuple[SequenceGroup, Sequence]] = field(default_factory=list)  # to free
    forked: list[tuple[SequenceGroup, Sequence]] = field(default_factory=list)  # to register


class StepUpdate:
    def __init__(self, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self._bm = block_manager
        self._max_model_len = max_model_len
        self._eos_token_ids = eos_token_ids
        self.num_prompt_tokens_total = 0  # prompt tokens computed (chunks, recomputes; not hits)
        self.num_generation_tokens_total = 0
        # speculative decoding (vLLM's counters): verified requests, draft tokens, accepted ones
        self.num_spec_drafts_total = 0
        self.num_spec_draft_tokens_total = 0
        self.num_spec_accepted_tokens_total = 0
        self.num_spec_accepted_tokens_per_pos: list[int] = []  # [i]: drafts accepted at position i

    def apply(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
        live: Mapping[str, tuple[SequenceGroup, Sequence]], now: float,
    ) -> StepResult:
        """Apply one step's results (see the module docstring) to the `live` streams (req_id ->
        group and sequence; a stream missing from it was aborted meanwhile)."""
        bm = self._bm
        caching = bm.enable_prefix_caching
        index = runner_output.req_id_to_index
        sampled, all_logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        spec = scheduler_output.scheduled_spec_decode_tokens
        proposals = runner_output.spec_token_ids
        result = StepResult()
        touched = result.outputs
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            entry = live.get(req_id)
            if entry is None:
                continue  # aborted meanwhile
            group, seq = entry
            if seq.status is not _RUNNING:
                continue
            i = index.get(req_id)
            tokens = sampled[i] if i is not None else None
            start = seq.num_computed_tokens
            drafts = spec.get(req_id) if spec else None
            if drafts:  # rejected drafts' KV is stale: not computed
                assert tokens and len(tokens) <= len(drafts) + 1, f"{req_id}: bad verification"
                num_new -= len(drafts) + 1 - len(tokens)
                self._count_accepted(len(drafts), len(tokens) - 1)
            set_progress(seq, start + num_new, _RUNNING)
            # the next step's drafts (verified only if the sequence still decodes then)
            seq.spec_token_ids = proposals[i] if proposals and i is not None else []
            num_prompt = len(seq.prompt_token_ids)
            if start < num_prompt:
                self.num_prompt_tokens_total += min(num_new, num_prompt - start)
            if caching:
                bm.cache_computed_blocks(seq)
            # a prompt held for a peer keeps what the peer's query at its last token sees
            params = group.sampling_params.kv_transfer_params
            bm.release_out_of_window(
                seq, 1 if params and params.get("do_remote_decode")
                and start + num_new >= num_prompt else 0)
            if prompt_logprobs and req_id in prompt_logprobs:
                output_of(group, touched).prompt_logprobs = prompt_logprobs[req_id]
            if group.pooling_params is not None:
                pooled = runner_output.pooler_output.get(req_id)
                self._finish_pooled(group, seq, pooled, result, now)
                continue
            if not tokens:
                continue
            out = output_of(group, touched)
            if group.first_token_time is None:
                group.first_token_time = now
                out.metrics = request_metrics(group)
            group.last_token_time = now
            assert i is not None  # tokens came from row i
            logprobs = all_logprobs[i] if all_logprobs else None
            if len(tokens) > 1 and group.is_fork_pending:
                self._fork(group, seq, tokens[1:], logprobs and logprobs[1:], out, result)
                tokens, logprobs = tokens[:1], logprobs and logprobs[:1]
            self._append(group, seq, tokens, logprobs, out, result)
        return result

    def _finish_pooled(
        self, group: SequenceGroup, seq: Sequence, pooled: list[float] | None,
        result: StepResult, now: float,
    ) -> None:
        """An embedding request ends in the step that completes its prompt: its vector goes out
        and it is freed (after the prefix cache took its full blocks), so it never holds a decode
        seat."""
        if seq.num_computed_tokens < seq.get_len():
            assert pooled is None, f"{seq.req_id}: pooled before its prompt was complete"
            return
        assert pooled is not None, f"{seq.req_id}: prompt complete but the runner pooled nothing"
        output_of(group, result.outputs).pooler_output = pooled
        group.first_token_time = group.last_token_time = now
        set_progress(seq, seq.num_computed_tokens, SequenceStatus.FINISHED_STOPPED)
        result.finished.append((group, seq))

    def _count_accepted(self, num_drafts: int, num_accepted: int) -> None:
        """Speculative-decoding counters (vLLM's): one verified request, its drafts, and how many
        were accepted, per draft position."""
        self.num_spec_drafts_total += 1
        self.num_spec_draft_tokens_total += num_drafts
        self.num_spec_accepted_tokens_total += num_accepted
        per_pos = self.num_spec_accepted_tokens_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def _append(
        self, group: SequenceGroup, seq: Sequence, tokens: list[int],
        logprobs: list[dict[int, float]] | None, out: EngineCoreOutput, result: StepResult,
    ) -> None:
        """Append accepted tokens up to the first that stops the sequence."""
        params = group.sampling_params
        max_len = self._max_model_len
        kept = 0
        finished = False
        for token in tokens:
            seq.output_token_ids.append(token)
            kept += 1
            status = check_token_stop(seq, params, max_len, self._eos_token_ids)
            if status is not None:
                set_progress(seq, seq.num_computed_tokens, status)
                finished = True
                break
        self.num_generation_tokens_total += kept
        if kept < len(tokens):
            tokens, logprobs = tokens[:kept], logprobs and logprobs[:kept]
        delta = SeqDelta(seq.index, tokens, logprobs or [])
        if finished:
            delta.finish_reason = seq.status.finish_reason
            delta.stop_reason = seq.stop_reason
            result.finished.append((group, seq))
        out.seqs.append(delta)

    def _fork(
        self, group: SequenceGroup, parent: Sequence, tokens: list[int],
        logprobs: list[dict[int, float]] | None, out: EngineCoreOutput, result: StepResult,
    ) -> None:
        """The prompt of an n > 1 request is done: one child per extra sampled token, sharing all
        of the parent's blocks (copy-on-write later)."""
        for j, token in enumerate(tokens):
            k = len(group.seqs)
            child = parent.fork(new_seq_id(), k, child_req_id(group.request_id, k))
            group.seqs.append(child)
            self._bm.fork(parent, child)
            result.forked.append((group, child))
            self._append(group, child, [token], logprobs and [logprobs[j]], out, result)


def output_of(group: SequenceGroup, touched: Touched) -> EngineCoreOutput:
    """The group's output this step, made on first touch."""
    entry = touched.get(group.request_id)
    if entry is None:
        entry = touched[group.request_id] = (
            group, EngineCoreOutput(group.request_id, num_cached_tokens=group.num_cached_tokens)
        )
    return entry[1]


def request_metrics(group: SequenceGroup) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=group.arrival_time,
        first_scheduled_time=group.first_scheduled_time,
        first_token_time=group.first_token_time,
        last_token_time=group.last_token_time,
        finished_time=group.finished_time,
    )
