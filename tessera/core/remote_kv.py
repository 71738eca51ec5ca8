"""`RemoteKVTracker`: the requests that wait on a peer engine (disaggregated prefill/decode). The
scheduler owns one and asks it at four points: admission (`park`), the end of a request
(`hold_for_peer`), the start of a step (`expire`) and the runner's report (`update`).

Consumer (decode side): a request whose peer computed its prompt is admitted as usual (blocks for
its whole prompt, prefix hits first), then parks in `waiting` with status WAITING_FOR_REMOTE_KVS.
It holds its blocks and a seat, takes no token budget and blocks nobody. When the worker reports
its KV landed, it is handed back to the scheduler RUNNING at `num_computed_tokens = prompt - 1`
(the last prompt token is recomputed to sample); when the pull failed, at its prefix hits, to
prefill locally. An abort frees its blocks at once and tells the worker to drop the pull.

Producer (prefill side): a request that asked for `do_remote_decode` and finished normally keeps
its blocks (held here, still in the block manager's tables, so `check_integrity` counts them) until
the worker reports them read out for the peer, or `hold_timeout` passes.

Without a connector the tracker is empty and every question answers "no".
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from tessera.core.block_manager import BlockManager
from tessera.core.kv_connector import KVConnectorMetadata, PullConnectorScheduler
from tessera.core.progress import set_progress
from tessera.core.runner_output import ModelRunnerOutput
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus

_WAITING_REMOTE = SequenceStatus.WAITING_FOR_REMOTE_KVS


class RemoteKVTracker:
    def __init__(self, connector: PullConnectorScheduler | None,
                 block_manager: BlockManager) -> None:
        self.connector = connector
        self._bm = block_manager
        self.waiting: dict[str, SequenceGroup] = {}  # parked for a peer's KV, by stream req_id
        self._held: dict[str, Sequence] = {}  # finished, blocks kept for a peer, by req_id
        self._params_out: dict[str, dict[str, Any]] = {}  # request id -> response params
        self.num_requests_total = 0  # reported by the worker half: requests, bytes, failures
        self.num_bytes_total = 0
        self.num_failures_total = 0

    # consumer

    def pulls_whole(self, group: SequenceGroup) -> bool:
        """A peer's prompt KV lands whole: blocks for the whole prompt in every group, when
        they fit an empty pool at all (else the request prefills here, chunk by chunk)."""
        params = group.sampling_params.kv_transfer_params
        return bool(params and params.get("do_remote_prefill")) and (
            self.connector is not None and self._bm.never_fits(group, whole=True) is None)

    def park(self, group: SequenceGroup, seqs: list[Sequence], can_pull: bool = True) -> bool:
        """`group` was just allocated: park it for its peer's KV if the connector has any for it.
        True if parked (it stays out of `running` until `update` hands it back). `can_pull`:
        its table covers the whole prompt (with a window it may not: then it prefills here)."""
        if self.connector is None or len(seqs) != 1:
            return False
        seq = seqs[0]
        num_external = self.connector.get_num_new_matched_tokens(
            group, seq, seq.num_computed_tokens) if can_pull else 0
        if num_external <= 0:
            # nothing worth pulling (a one-token prompt, or all local hits): still tell the
            # producer, with an empty pull, so it frees its blocks now rather than at timeout
            self.connector.release_remote(group, seq)
            return False
        table = self._bm.get_block_table(seq)
        self.connector.update_state_after_alloc(group, seq, table, num_external)
        set_progress(seq, seq.num_computed_tokens, _WAITING_REMOTE)
        self.waiting[seq.req_id] = group
        return True

    def abort(self, group: SequenceGroup) -> bool:
        """Abort a parked group (the caller frees its blocks); False if it is not parked."""
        req_id = group.seqs[0].req_id
        if self.waiting.pop(req_id, None) is None:
            return False
        assert self.connector is not None
        self.connector.request_aborted(req_id)
        return True

    def _resume(self, req_id: str, loaded: bool) -> SequenceGroup | None:
        """The pull of `req_id` ended: decode from the last prompt token, or prefill locally."""
        group = self.waiting.pop(req_id, None)
        if group is None:
            return None  # aborted meanwhile
        seq = group.seqs[0]
        group.remote_kv_tried = True
        computed = seq.num_computed_tokens
        if loaded:  # the peer computed the prompt; its last token is this step's decode input
            computed = max(computed, len(seq.prompt_token_ids) - 1)
        set_progress(seq, computed, SequenceStatus.RUNNING)
        if loaded:  # a window's entries the peer had released got nothing: let them go now
            self._bm.release_out_of_window(seq)
        return group

    # producer

    def hold_for_peer(self, group: SequenceGroup, seq: Sequence) -> bool:
        """`seq` finished normally: keep its blocks if a peer will pull them (True). Either way
        the response's `kv_transfer_params` are kept for `take_params`."""
        if self.connector is None or not self._bm.has_blocks(seq):
            return False
        table = self._bm.get_block_table(seq)
        delay, params = self.connector.request_finished(group, seq, table)
        if params is not None:
            self._params_out[group.request_id] = params
        if not delay:
            return False
        self._held[seq.req_id] = seq
        return True

    def is_held(self, seq: Sequence) -> bool:
        """Its blocks wait for a peer: whoever frees finished sequences must leave them."""
        return self._held.get(seq.req_id) is seq

    def _release(self, req_id: str) -> None:
        seq = self._held.pop(req_id, None)
        if seq is not None:
            self._bm.free(seq)

    def take_params(self, request_id: str) -> dict[str, Any] | None:
        """The finished request's `kv_transfer_params` for its response (once)."""
        return self._params_out.pop(request_id, None)

    # both

    def expire(self) -> None:
        """At the start of each step: free what no peer pulled in time."""
        if self.connector is None:
            return
        for req_id in self.connector.take_expired():
            if req_id in self._held:
                self.num_failures_total += 1
                self._release(req_id)

    def connector_meta(self) -> KVConnectorMetadata | None:
        """This step's instructions to the worker half (None without a connector)."""
        return None if self.connector is None else self.connector.build_connector_meta()

    def update(self, runner_output: ModelRunnerOutput) -> list[SequenceGroup]:
        """Apply what the worker half reported this step. Returns the parked groups whose pull
        ended, now RUNNING: the scheduler puts them in `running`."""
        if self.connector is None:
            return []
        self.connector.update_connector_output(runner_output)
        for req_id in runner_output.finished_sending:
            self._release(req_id)
        resumed = []
        for ids, loaded in ((runner_output.finished_recving, True),
                            (runner_output.failed_recving, False)):
            for req_id in ids:
                group = self._resume(req_id, loaded)
                if group is not None:
                    resumed.append(group)
        stats = runner_output.kv_transfer_stats
        if stats is not None:
            self.num_requests_total += stats.num_requests
            self.num_bytes_total += stats.num_bytes
            self.num_failures_total += stats.num_failures
        return resumed

    def has_pending(self) -> bool:
        """Blocks held for a peer or KV on its way: the engine keeps stepping to hear back."""
        return bool(self._held or self.waiting)

    def check_integrity(self, running: Container[SequenceGroup], live: Container[str]) -> None:
        """Every parked or held sequence holds device blocks, and is in one place only:
        a parked one not in `running`, a held one not among the `live` streams."""
        for req_id, group in self.waiting.items():
            seq = group.seqs[0]
            assert seq.req_id == req_id and seq.status is _WAITING_REMOTE, req_id
            assert self._bm.has_blocks(seq), f"{req_id} waits without blocks"
            assert group not in running, f"{req_id} waits and runs"
        for req_id, seq in self._held.items():
            assert seq.is_finished(), f"{req_id} is held but not finished"
            assert self._bm.has_blocks(seq), f"{req_id} is held without blocks"
            assert req_id not in live, f"{req_id} is held and live"
