"""The scheduler half of a KV connector: disaggregated prefill/decode as seen by the core.

One engine (the producer) prefills a request and keeps its KV blocks; another (the consumer) pulls
those blocks and decodes. The connector has two halves, as vLLM V1's `KVConnectorBase_V1` does:
this one, pure Python in the scheduler's process, decides *which* blocks move; the worker half
(tessera/distributed/kv_transfer/) moves the bytes, asynchronously, and reports what finished in
`ModelRunnerOutput`. They talk only through `KVConnectorMetadata`, carried in `SchedulerOutput`.

    proxy ──(max_tokens=1, {"do_remote_decode": true})──▶ producer: prefill, sample one token,
          ◀─────────── kv_transfer_params: where to pull, which blocks ───── (blocks held)
    proxy ──(the original request + those params)──────▶ consumer: WAITING_FOR_REMOTE_KVS,
                                                          pull, then decode from prompt_len - 1

The consumer recomputes the last prompt token (it needs its logits to sample), so the producer's
sampled token is discarded and greedy output is the colocated engine's.

With KV cache groups or a sliding window (core/block_layout.py) the block ids that move are the
interleaved table's, `num_groups` per token block, and a window group's entries that its window
has left are NULL_BLOCK (-1) on the producer: only live pairs move, and the consumer releases its
own entries that had no live peer as soon as the KV lands (core/remote_kv.py). The producer
keeps its window one token wider once the prompt is computed, so that the consumer's query at
the last prompt token finds every key it sees. Both transports here
(TcpConnector, NixlConnector) pull: the consumer asks, the producer serves. The producer frees a
request's blocks when its worker has read them out for the peer, or after `hold_timeout` seconds
if no peer comes; a consumer whose pull fails prefills locally.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tessera.utils import cdiv

if TYPE_CHECKING:
    from tessera.config import KVTransferConfig
    from tessera.core.runner_output import ModelRunnerOutput
    from tessera.sequence import Sequence, SequenceGroup

_PARAM_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id",
               "remote_host", "remote_port", "remote_request_id", "tp_size")


@dataclass(slots=True)
class RemotePrefill:
    """A consumer's pull: the producer's blocks `remote_block_ids` land in `local_block_ids`."""

    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    remote_engine_id: str
    remote_request_id: str


@dataclass
class KVConnectorMetadata:
    """One step's instructions to the worker half. Applied before the step's cache operations and
    forward pass, so a block freed by a cancellation can be reused by the same step."""

    reqs_to_recv: dict[str, RemotePrefill] = field(default_factory=dict)  # start pulling these
    reqs_to_send: dict[str, list[int]] = field(default_factory=dict)  # serve these blocks
    reqs_to_cancel: list[str] = field(default_factory=list)  # forget: blocks are freed now

    def __bool__(self) -> bool:
        return bool(self.reqs_to_recv or self.reqs_to_send or self.reqs_to_cancel)


def check_kv_transfer_params(params: Any, config: KVTransferConfig | None,
                             num_prompt_tokens: int, block_size: int, num_groups: int = 1) -> None:
    """A request's `kv_transfer_params` (vLLM's keys), checked at add_request: ValueError naming
    the key. A consumer needs one remote block per block of the prompt and KV cache group (-1:
    a window group's entry its window has left)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    unknown = sorted(set(params) - set(_PARAM_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown key(s) {', '.join(unknown)}")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(key, False), bool):
            raise ValueError(f"kv_transfer_params.{key} must be a bool")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude "
                         "each other")
    if params.get("do_remote_decode") and (config is None or not config.is_producer):
        raise ValueError("kv_transfer_params.do_remote_decode needs a server started with "
                         "--kv-transfer-config and kv_role kv_producer or kv_both")
    if not params.get("do_remote_prefill"):
        return
    if config is None or not config.is_consumer:
        raise ValueError("kv_transfer_params.do_remote_prefill needs a server started with "
                         "--kv-transfer-config and kv_role kv_consumer or kv_both")
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= -1 for b in ids):
        raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids")
    need = cdiv(num_prompt_tokens, block_size) * num_groups
    if len(ids) != need:
        groups = f" in each of {num_groups} KV cache groups" if num_groups > 1 else ""
        raise ValueError(f"kv_transfer_params.remote_block_ids holds {len(ids)} blocks, but the "
                         f"prompt of {num_prompt_tokens} tokens takes "
                         f"{cdiv(num_prompt_tokens, block_size)} of {block_size} tokens{groups}")
    for key in ("remote_host", "remote_engine_id", "remote_request_id"):
        if not isinstance(params.get(key), str) or not params[key]:
            raise ValueError(f"kv_transfer_params.{key} must be a non-empty string")
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65535:
        raise ValueError("kv_transfer_params.remote_port must be a port number")


class KVConnectorScheduler(ABC):
    """What the scheduler asks a connector (vLLM V1's scheduler-side methods)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, group: SequenceGroup, seq: Sequence,
                                   num_computed_tokens: int) -> int:
        """Prompt tokens beyond `num_computed_tokens` (the local prefix-cache hits) whose KV a
        peer has computed and will send; 0: prefill locally."""

    @abstractmethod
    def update_state_after_alloc(self, group: SequenceGroup, seq: Sequence, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """`seq` holds `block_ids` now; the peer's tokens go into them (a load to start)."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's instructions for the worker half (None: nothing to do)."""

    @abstractmethod
    def request_finished(self, group: SequenceGroup, seq: Sequence,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """`seq` finished normally: (keep its blocks until the worker reports them sent, the
        `kv_transfer_params` for the response)."""

    @abstractmethod
    def request_aborted(self, req_id: str) -> None:
        """A request waiting for remote KV was aborted: its blocks are freed now."""

    @abstractmethod
    def take_expired(self) -> list[str]:
        """Held requests no peer pulled in time; the scheduler frees their blocks now."""


class PullConnectorScheduler(KVConnectorScheduler):
    """The scheduler half of the pull transports (TcpConnector, NixlConnector)."""

    def __init__(self, config: KVTransferConfig, block_size: int,
                 clock: Callable[[], float] = time.monotonic, engine_id: str | None = None,
                 num_groups: int = 1) -> None:
        """`num_groups`: table entries per token block (KV cache groups; 1: one table)."""
        self.config = config
        self.block_size = block_size
        self.num_groups = num_groups
        self.clock = clock
        self.engine_id = engine_id or uuid.uuid4().hex
        self._meta = KVConnectorMetadata()
        self._deadlines: dict[str, float] = {}  # held for a peer: req_id -> when to give up
        self.num_expired_total = 0

    def get_num_new_matched_tokens(self, group: SequenceGroup, seq: Sequence,
                                   num_computed_tokens: int) -> int:
        params = group.sampling_params.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.config.is_consumer:
            return 0
        if group.remote_kv_tried or group.sampling_params.n != 1 or seq.output_token_ids:
            return 0  # a resumed or forked stream: its KV is not the peer's prompt
        if group.sampling_params.prompt_logprobs is not None:
            return 0  # those need the logits of every prompt position: computed here
        # the last prompt token is recomputed: sampling needs its logits
        return max(0, len(seq.prompt_token_ids) - 1 - num_computed_tokens)

    def update_state_after_alloc(self, group: SequenceGroup, seq: Sequence, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = group.sampling_params.kv_transfer_params
        assert params is not None and num_external_tokens > 0
        # local hits are whole blocks; a pair moves only where both entries hold a block
        first = seq.num_computed_tokens // self.block_size * self.num_groups
        remote = params["remote_block_ids"]
        pairs = [(lo, re) for lo, re in zip(block_ids[first:len(remote)], remote[first:],
                                             strict=True) if lo >= 0 and re >= 0]
        self._meta.reqs_to_recv[seq.req_id] = RemotePrefill(
            local_block_ids=[lo for lo, _ in pairs],
            remote_block_ids=[re for _, re in pairs],
            remote_host=params["remote_host"], remote_port=params["remote_port"],
            remote_engine_id=params["remote_engine_id"],
            remote_request_id=params["remote_request_id"],
        )

    def release_remote(self, group: SequenceGroup, seq: Sequence) -> None:
        """`seq` prefills here although its peer holds its prompt's KV: an empty pull (no
        blocks) tells the peer to let go. Its outcome is not awaited."""
        params = group.sampling_params.kv_transfer_params
        if (not params or not params.get("do_remote_prefill") or group.remote_kv_tried
                or not self.config.is_consumer):
            return
        group.remote_kv_tried = True
        self._meta.reqs_to_recv[seq.req_id] = RemotePrefill(
            [], [], params["remote_host"], params["remote_port"], params["remote_engine_id"],
            params["remote_request_id"])

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta or None

    def request_finished(self, group: SequenceGroup, seq: Sequence,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = group.sampling_params.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not self.config.is_producer:
            return False, None
        if group.sampling_params.n != 1:
            return False, None
        blocks = list(block_ids[:cdiv(len(seq.prompt_token_ids), self.block_size)
                                * self.num_groups])
        self._meta.reqs_to_send[seq.req_id] = [b for b in blocks if b >= 0]
        self._deadlines[seq.req_id] = self.clock() + self.config.hold_timeout
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": blocks, "remote_engine_id": self.engine_id,
            "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port,
            "remote_request_id": seq.req_id, "tp_size": 1,
        }

    def request_aborted(self, req_id: str) -> None:
        self._meta.reqs_to_recv.pop(req_id, None)
        self._meta.reqs_to_cancel.append(req_id)

    def sent(self, req_id: str) -> None:
        """The worker reported the request's blocks read out for the peer."""
        self._deadlines.pop(req_id, None)

    def take_expired(self) -> list[str]:
        if not self._deadlines:
            return []
        now = self.clock()
        expired = [r for r, t in self._deadlines.items() if t <= now]
        for req_id in expired:
            del self._deadlines[req_id]
            self._meta.reqs_to_send.pop(req_id, None)
            self._meta.reqs_to_cancel.append(req_id)
        self.num_expired_total += len(expired)
        return expired

    def update_connector_output(self, runner_output: ModelRunnerOutput) -> None:
        for req_id in runner_output.finished_sending:
            self.sent(req_id)
