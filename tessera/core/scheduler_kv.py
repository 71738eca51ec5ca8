"""The scheduler's remote-KV states (disaggregated prefill/decode), kept apart from the scheduling
phases as a base class of `Scheduler`, like `update_from_output`.

Consumer (decode side): a request whose peer computed its prompt is admitted as usual (blocks for
its whole prompt, prefix hits first), then parks in `waiting_for_remote_kvs` with status
WAITING_FOR_REMOTE_KVS. It holds its blocks and a seat, takes no token budget and blocks nobody.
When the worker reports its KV landed, it joins `running` at `num_computed_tokens = prompt - 1`
(the last prompt token is recomputed to sample); when the pull failed, it joins at its prefix hits
and prefills locally. An abort frees its blocks at once and tells the worker to drop the pull.

Producer (prefill side): a request that asked for `do_remote_decode` and finished normally keeps
its blocks (`_held`, still in the block manager's tables, so `check_integrity` counts them) until
the worker reports them read out for the peer, or `hold_timeout` passes.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

from tessera.core.kv_connector import PullConnectorScheduler
from tessera.core.progress import set_progress
from tessera.core.runner_output import ModelRunnerOutput
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from tessera.core.block_manager import BlockManager
    from tessera.core.runner_view import RunnerView

_WAITING_REMOTE = SequenceStatus.WAITING_FOR_REMOTE_KVS


class RemoteKVStates:
    # the scheduler's state this half reads and writes (set by Scheduler.__init__)
    kv_connector: PullConnectorScheduler | None
    block_manager: BlockManager
    running: list[SequenceGroup]
    _runner: RunnerView
    _live: dict[str, tuple[SequenceGroup, Sequence]]

    def _init_remote_kv(self, connector: PullConnectorScheduler | None) -> None:
        self.kv_connector = connector
        self.waiting_for_remote_kvs: dict[str, SequenceGroup] = {}  # by the stream's req_id
        self._held: dict[str, Sequence] = {}  # finished, blocks kept for a peer, by req_id
        self._kv_params_out: dict[str, dict[str, Any]] = {}  # request id -> response params
        self.num_kv_transfer_requests_total = 0
        self.num_kv_transfer_bytes_total = 0
        self.num_kv_transfer_failures_total = 0

    def _key(self, group: SequenceGroup) -> tuple[int, float]:
        raise NotImplementedError

    # consumer

    def _admit_remote(self, group: SequenceGroup, seqs: list[Sequence]) -> bool:
        """Just allocated: park the group for its peer's KV if the connector has any for it."""
        if self.kv_connector is None or len(seqs) != 1:
            return False
        seq = seqs[0]
        num_external = self.kv_connector.get_num_new_matched_tokens(
            group, seq, seq.num_computed_tokens)
        if num_external <= 0:
            # nothing worth pulling (a one-token prompt, or all local hits): still tell the
            # producer, with an empty pull, so it frees its blocks now rather than at timeout
            self.kv_connector.release_remote(group, seq)
            return False
        table = self.block_manager.get_block_table(seq)
        self.kv_connector.update_state_after_alloc(group, seq, table, num_external)
        set_progress(seq, seq.num_computed_tokens, _WAITING_REMOTE)
        self.waiting_for_remote_kvs[seq.req_id] = group
        return True

    def _resume_remote(self, req_id: str, loaded: bool) -> None:
        """The pull of `req_id` ended: decode from the last prompt token, or prefill locally."""
        group = self.waiting_for_remote_kvs.pop(req_id, None)
        if group is None:
            return  # aborted meanwhile
        seq = group.seqs[0]
        group.remote_kv_tried = True
        computed = seq.num_computed_tokens
        if loaded:  # the peer computed the prompt; its last token is this step's decode input
            computed = max(computed, len(seq.prompt_token_ids) - 1)
        set_progress(seq, computed, SequenceStatus.RUNNING)
        bisect.insort(self.running, group, key=self._key)

    def _abort_remote(self, group: SequenceGroup) -> bool:
        """Abort a group waiting for remote KV; False if it is not waiting."""
        req_id = group.seqs[0].req_id
        if self.waiting_for_remote_kvs.pop(req_id, None) is None:
            return False
        assert self.kv_connector is not None
        self.kv_connector.request_aborted(req_id)
        return True

    # producer

    def _hold_for_peer(self, group: SequenceGroup, seq: Sequence) -> bool:
        """`seq` finished normally: keep its blocks if a peer will pull them. Its runner copy is
        dropped either way; the blocks stay in the block manager until sent or expired."""
        if self.kv_connector is None or not self.block_manager.has_blocks(seq):
            return False
        table = self.block_manager.get_block_table(seq)
        delay, params = self.kv_connector.request_finished(group, seq, table)
        if params is not None:
            self._kv_params_out[group.request_id] = params
        if not delay:
            return False
        self._held[seq.req_id] = seq
        return True

    def _release_held(self, req_id: str) -> None:
        seq = self._held.pop(req_id, None)
        if seq is not None:
            self.block_manager.free(seq)

    # both

    def _schedule_remote_kv(self) -> None:
        """At the start of each step: free what no peer pulled in time."""
        if self.kv_connector is None:
            return
        for req_id in self.kv_connector.take_expired():
            if req_id in self._held:
                self.num_kv_transfer_failures_total += 1
                self._release_held(req_id)

    def _update_remote_kv(self, runner_output: ModelRunnerOutput) -> None:
        """Apply what the worker half reported this step."""
        if self.kv_connector is None:
            return
        self.kv_connector.update_connector_output(runner_output)
        for req_id in runner_output.finished_sending:
            self._release_held(req_id)
        for req_id in runner_output.finished_recving:
            self._resume_remote(req_id, loaded=True)
        for req_id in runner_output.failed_recving:
            self._resume_remote(req_id, loaded=False)
        stats = runner_output.kv_transfer_stats
        if stats is not None:
            self.num_kv_transfer_requests_total += stats.num_requests
            self.num_kv_transfer_bytes_total += stats.num_bytes
            self.num_kv_transfer_failures_total += stats.num_failures

    def take_kv_transfer_params(self, request_id: str) -> dict[str, Any] | None:
        return self._kv_params_out.pop(request_id, None)

    def has_pending_kv_transfers(self) -> bool:
        """Blocks held for a peer or KV on its way: the engine keeps stepping to hear back."""
        return bool(self._held or self.waiting_for_remote_kvs)

    def check_remote_kv_integrity(self) -> None:
        """Every parked or held sequence holds device blocks, and is in one place only."""
        for req_id, group in self.waiting_for_remote_kvs.items():
            seq = group.seqs[0]
            assert seq.req_id == req_id and seq.status is _WAITING_REMOTE, req_id
            assert self.block_manager.has_blocks(seq), f"{req_id} waits without blocks"
            assert group not in self.running, f"{req_id} waits and runs"
        for req_id, seq in self._held.items():
            assert seq.is_finished(), f"{req_id} is held but not finished"
            assert self.block_manager.has_blocks(seq), f"{req_id} is held without blocks"
            assert req_id not in self._live, f"{req_id} is held and live"
