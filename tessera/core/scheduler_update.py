"""`Scheduler.update_from_output`: after the forward pass, the only writer of request progress.

Per scheduled stream it advances `num_computed_tokens` by the tokens actually computed (a rejected
draft token's KV does not count: a stream that verified k drafts and got a + 1 tokens back, the a
accepted drafts and the target's own next token, advances by 1 + a), stores the drafts the runner
proposed for its next step, appends the sampled tokens up to the first that stops the stream
(core/stop_conditions.py), forks the n-1 children of an n > 1 request when its prompt completes,
frees what finished and offers newly full blocks to the prefix cache. It answers, per request that
changed, an `EngineCoreOutput` for the engine's output processor.

Kept apart from the scheduling phases (core/scheduler.py) as a base class of `Scheduler`: the two
halves share the scheduler's state, but a reader of one need not read the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tessera.core.core_output import EngineCoreOutput, SeqDelta
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.core.stop_conditions import check_token_stop
from tessera.outputs import RequestMetrics
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus, child_req_id, new_seq_id

if TYPE_CHECKING:
    from tessera.config import SchedulerConfig
    from tessera.core.block_manager import BlockManager
    from tessera.core.runner_view import RunnerView

_RUNNING = SequenceStatus.RUNNING


class UpdateFromOutput:
    # the scheduler's state this half reads and writes (set by Scheduler.__init__)
    config: SchedulerConfig
    block_manager: BlockManager
    eos_token_ids: tuple[int, ...]
    _groups: dict[str, SequenceGroup]
    _live: dict[str, tuple[SequenceGroup, Sequence]]
    _ignored: list[SequenceGroup]
    _runner: RunnerView
    running: list[SequenceGroup]
    clock: Callable[[], float]
    num_generation_tokens_total: int
    num_prompt_tokens_total: int
    num_spec_drafts_total: int
    num_spec_draft_tokens_total: int
    num_spec_accepted_tokens_total: int
    num_spec_accepted_tokens_per_pos: list[int]
    _held: dict[str, Sequence]

    if TYPE_CHECKING:  # the remote-KV half (core/scheduler_kv.py), also a base of Scheduler
        def _hold_for_peer(self, group: SequenceGroup, seq: Sequence) -> bool: ...
        def _update_remote_kv(self, runner_output: ModelRunnerOutput) -> None: ...
        def take_kv_transfer_params(self, request_id: str) -> dict[str, Any] | None: ...

    def _free_seq(self, seq: Sequence) -> None:
        if self._held.get(seq.req_id) is not seq:  # a finished prefill's blocks wait for its peer
            self.block_manager.free(seq)
        self._runner.finished(seq)
        self._live.pop(seq.req_id, None)

    def _drop(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._free_seq(seq)
        self._groups.pop(group.request_id, None)

    def _sweep_finished(self) -> None:
        """Drop finished groups from `running` (their sequences are already freed)."""
        kept = []
        for group in self.running:
            if group.is_finished():
                self._drop(group)
            else:
                kept.append(group)
        self.running = kept

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results; the only writer of request progress (see the module
        docstring). Returns, per request that changed, what its sequences gained."""
        now = self.clock()
        caching = self.block_manager.enable_prefix_caching
        index = runner_output.req_id_to_index
        sampled, all_logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        spec = scheduler_output.scheduled_spec_decode_tokens
        proposals = runner_output.spec_token_ids
        live = self._live
        touched: dict[str, tuple[SequenceGroup, EngineCoreOutput]] = {}
        any_finished = False
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
            seq.num_computed_tokens = start + num_new
            # the next step's drafts (verified only if the sequence still decodes then)
            seq.spec_token_ids = proposals[i] if proposals and i is not None else []
            num_prompt = len(seq.prompt_token_ids)
            if start < num_prompt:
                self.num_prompt_tokens_total += min(num_new, num_prompt - start)
            if caching:
                self.block_manager.cache_computed_blocks(seq)
            self.block_manager.release_out_of_window(seq)
            if prompt_logprobs and req_id in prompt_logprobs:
                self._output_of(group, touched).prompt_logprobs = prompt_logprobs[req_id]
            if not tokens:
                continue
            out = self._output_of(group, touched)
            if group.first_token_time is None:
                group.first_token_time = now
                out.metrics = _metrics(group)
            group.last_token_time = now
            assert i is not None  # tokens came from row i
            logprobs = all_logprobs[i] if all_logprobs else None
            if len(tokens) > 1 and group.is_fork_pending:
                any_finished |= self._fork(group, seq, tokens[1:], logprobs and logprobs[1:], out)
                tokens, logprobs = tokens[:1], logprobs and logprobs[:1]
            any_finished |= self._append(group, seq, tokens, logprobs, out)
        self._update_remote_kv(runner_output)
        for group in self._ignored:
            touched[group.request_id] = (group, EngineCoreOutput(group.request_id, error=group.error))
        self._ignored = []
        if any_finished:
            self._sweep_finished()
        groups = self._groups
        for group, out in touched.values():
            if group.request_id not in groups:  # dropped: finished (or rejected)
                out.finished = True
                out.kv_transfer_params = self.take_kv_transfer_params(group.request_id)
                if group.finished_time is None:
                    group.finished_time = now
                out.metrics = _metrics(group)
        return [out for _, out in touched.values()]

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
    # a step that raised (engine/step_recovery.py)

    def resend_whole(self, scheduler_output: SchedulerOutput, req_ids: list[str]) -> SchedulerOutput:
        """The part of a failed step's `scheduler_output` that concerns `req_ids`, each request
        sent whole (the runner's copy may hold half-applied diffs; a whole one replaces it). No
        cache operations and no finished ids: the runner applied those before the forward pass
        that failed. Writes no progress."""
        sub = SchedulerOutput()
        table = self.block_manager.get_block_table
        for req_id in req_ids:
            group, seq = self._live[req_id]
            self._runner.preempted(seq)  # marks it to be described whole
            self._runner.describe(group, seq, table(seq), sub)
            n = scheduler_output.num_scheduled_tokens[req_id]
            sub.num_scheduled_tokens[req_id] = n
            sub.total_num_scheduled_tokens += n
            if req_id in scheduler_output.num_samples:
                sub.num_samples[req_id] = scheduler_output.num_samples[req_id]
            if req_id in scheduler_output.scheduled_spec_decode_tokens:
                sub.scheduled_spec_decode_tokens[req_id] = (
                    scheduler_output.scheduled_spec_decode_tokens[req_id])
        return sub

    def request_id_of(self, req_id: str) -> str | None:
        """The request a stream (req_id) belongs to, while it is unfinished."""
        entry = self._live.get(req_id)
        return None if entry is None else entry[0].request_id

    @staticmethod
    def _output_of(
        group: SequenceGroup, touched: dict[str, tuple[SequenceGroup, EngineCoreOutput]]
    ) -> EngineCoreOutput:
        entry = touched.get(group.request_id)
        if entry is None:
            entry = touched[group.request_id] = (
                group, EngineCoreOutput(group.request_id, num_cached_tokens=group.num_cached_tokens)
            )
        return entry[1]

    def _append(
        self, group: SequenceGroup, seq: Sequence, tokens: list[int],
        logprobs: list[dict[int, float]] | None, out: EngineCoreOutput,
    ) -> bool:
        """Append accepted tokens up to the first that stops the sequence; True if it finished."""
        params = group.sampling_params
        max_len = self.config.max_model_len
        kept = 0
        finished = False
        for token in tokens:
            seq.output_token_ids.append(token)
            kept += 1
            if check_token_stop(seq, params, max_len, self.eos_token_ids):
                finished = True
                break
        self.num_generation_tokens_total += kept
        if kept < len(tokens):
            tokens, logprobs = tokens[:kept], logprobs and logprobs[:kept]
        delta = SeqDelta(seq.index, tokens, logprobs or [])
        if finished:
            delta.finish_reason = seq.status.finish_reason
            delta.stop_reason = seq.stop_reason
            if self._hold_for_peer(group, seq):  # a peer pulls its KV first
                self._runner.finished(seq)
                self._live.pop(seq.req_id, None)
            else:
                self._free_seq(seq)
        out.seqs.append(delta)
        return finished

    def _fork(
        self, group: SequenceGroup, parent: Sequence, tokens: list[int],
        logprobs: list[dict[int, float]] | None, out: EngineCoreOutput,
    ) -> bool:
        """The prompt of an n > 1 request is done: one child per extra sampled token, sharing all
        of the parent's blocks (copy-on-write later). Returns whether any child finished at once."""
        finished = False
        for j, token in enumerate(tokens):
            k = len(group.seqs)
            child = parent.fork(new_seq_id(), k, child_req_id(group.request_id, k))
            group.seqs.append(child)
            self.block_manager.fork(parent, child)
            self._live[child.req_id] = (group, child)
            finished |= self._append(group, child, [token], logprobs and [logprobs[j]], out)
        return finished


def _metrics(group: SequenceGroup) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=group.arrival_time,
        first_scheduled_time=group.first_scheduled_time,
        first_token_time=group.first_token_time,
        last_token_time=group.last_token_time,
        finished_time=group.finished_time,
    )
