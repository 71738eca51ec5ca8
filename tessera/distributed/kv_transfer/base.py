"""`KVConnectorWorker`: the worker half of a pull connector, whatever the transport.

The model runner calls two methods per step, and neither blocks on the network:

    bind_connector_metadata(meta)   before the step's cache ops: forget cancelled requests, serve
                                    the blocks of finished prefills (save), start pulls (load)
    get_finished()                  after the forward pass: copy the KV that arrived into its
                                    blocks, and report what was sent, received or failed

Threads and the cache. Pulls run on a small thread pool, each blocking on its own socket with a
deadline (`transfer_timeout`); what they receive waits in a staging tensor until the engine
thread copies it into the cache in `get_finished`, so only the engine thread ever writes the
cache. The serving side reads held blocks from its own thread (a copy, under `_lock`); the
scheduler never frees a held block before the worker reports it sent, and a cancellation (an
expired hold) takes the same lock, so once `bind_connector_metadata` returns no transport thread
touches a freed block.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from tessera.config import KVTransferConfig
from tessera.core.kv_connector import KVConnectorMetadata, RemotePrefill
from tessera.core.runner_output import KVTransferStats

logger = logging.getLogger(__name__)

_MAX_PULLS = 8  # concurrent pulls per consumer
_MAX_GONE = 4096  # served or expired request ids remembered


class KVCache(Protocol):
    """What a connector needs of the worker's cache (tessera/worker/cache_engine.py's
    CacheEngine): the device pool [2, num_layers, num_blocks, ...] and its device. A protocol, so
    this layer does not import the worker above it."""

    @property
    def device(self) -> torch.device: ...

    @property
    def gpu_cache(self) -> torch.Tensor: ...


class TransferError(RuntimeError):
    """A pull failed (peer gone, unknown request, wrong geometry, timeout)."""


class KVConnectorWorker(ABC):
    def __init__(self, config: KVTransferConfig, cache_engine: KVCache, engine_id: str) -> None:
        self.config = config
        self.cache_engine = cache_engine
        self.engine_id = engine_id
        self._lock = threading.Lock()
        self._serving: dict[str, list[int]] = {}  # producer: req_id -> blocks a peer may pull
        self._sent: list[str] = []
        self._landed: list[tuple[str, RemotePrefill, torch.Tensor | None]] = []  # None: failed
        self._pulling: set[str] = set()
        self._cancelled: set[str] = set()
        self._stats = KVTransferStats()
        self._pool = ThreadPoolExecutor(_MAX_PULLS, thread_name_prefix="kv-pull") \
            if config.is_consumer else None
        self._closed = threading.Event()
        self._gone: set[str] = set()  # served or expired lately: a pull for one fails at once
        self._gone_order: deque[str] = deque()

    def _forget(self, req_id: str) -> None:
        """(under _lock) `req_id` will not be served again."""
        self._gone.add(req_id)
        self._gone_order.append(req_id)
        if len(self._gone_order) > _MAX_GONE:
            self._gone.discard(self._gone_order.popleft())

    # the transport

    @property
    @abstractmethod
    def port(self) -> int:
        """The port this producer serves on (the real one when kv_port is 0)."""

    @abstractmethod
    def _pull(self, rp: RemotePrefill, deadline: float) -> torch.Tensor:
        """Fetch the peer's blocks `rp.remote_block_ids` as one tensor shaped like
        `read_blocks` returns; raise TransferError. Runs on a pool thread."""

    # the engine thread's calls

    def bind_connector_metadata(self, meta: KVConnectorMetadata | None) -> None:
        """This step's instructions, in order: cancel, save, load."""
        if meta is None:
            return
        with self._lock:
            for req_id in meta.reqs_to_cancel:
                if self._serving.pop(req_id, None) is not None:
                    self._forget(req_id)
                if req_id in self._pulling:
                    self._cancelled.add(req_id)
        self.save_kv(meta.reqs_to_send)
        self.start_load_kv(meta.reqs_to_recv)

    def save_kv(self, reqs: dict[str, list[int]]) -> None:
        """Finished prefills: serve these blocks to the peer that pulls them (the scheduler
        keeps them until `get_finished` reports them sent)."""
        if reqs:
            with self._lock:
                self._serving.update(reqs)

    def start_load_kv(self, reqs: dict[str, RemotePrefill]) -> None:
        """Start pulling each request's KV from its peer; returns at once."""
        for req_id, rp in reqs.items():
            assert self._pool is not None, "a pull on an engine that is not a kv consumer"
            self._pulling.add(req_id)
            self._pool.submit(self._run_pull, req_id, rp)

    def get_finished(self) -> tuple[list[str], list[str], list[str], KVTransferStats | None]:
        """(sent, received, failed, stats since the last call)."""
        with self._lock:
            sent, self._sent = self._sent, []
            landed, self._landed = self._landed, []
            stats, self._stats = self._stats, KVTransferStats()
            cancelled = self._cancelled
            for req_id, _, _ in landed:
                self._pulling.discard(req_id)
            self._cancelled = {r for r in cancelled if r in self._pulling}
        received, failed = [], []
        for req_id, rp, data in landed:
            if req_id in cancelled:
                continue  # aborted: its blocks may belong to another request by now
            if data is None:
                failed.append(req_id)
                continue
            if rp.local_block_ids:  # an empty pull only released the peer's blocks
                self.write_blocks(rp.local_block_ids, data)
            received.append(req_id)
        if not (sent or received or failed or stats.num_requests or stats.num_failures):
            return sent, received, failed, None
        return sent, received, failed, stats

    def shutdown(self) -> None:
        self._closed.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # shared by the transports

    def read_blocks(self, req_id: str, block_ids: list[int]) -> torch.Tensor | str | None:
        """Serving side, any thread: a copy of `block_ids` of a request this producer serves,
        `[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]`; or why not; or
        None when the request is not known yet (the step that registers it has not run: the
        proxy can be faster than the producer's next step). A request is served once: its
        blocks are released when it has been read."""
        t0 = time.perf_counter()
        with self._lock:
            held = self._serving.get(req_id)
            if held is None:
                if req_id in self._gone:
                    return f"request {req_id!r} is no longer held here (expired or pulled)"
                return None
            if not set(block_ids) <= set(held):
                return f"blocks {block_ids} are not request {req_id!r}'s"
            ids = torch.tensor(block_ids, dtype=torch.long, device=self.cache_engine.device)
            data = self.cache_engine.gpu_cache.index_select(2, ids).cpu()
            del self._serving[req_id]
            self._forget(req_id)
            self._sent.append(req_id)
            self._stats.num_requests += 1
            self._stats.num_bytes += data.numel() * data.element_size()
            self._stats.transfer_seconds.append(time.perf_counter() - t0)
        return data

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Engine thread: the pulled KV into this engine's blocks, all layers at once."""
        cache = self.cache_engine.gpu_cache
        ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        cache.index_copy_(2, ids, data.to(cache.device))

    def expected_shape(self, num_blocks: int) -> tuple[int, ...]:
        shape = self.cache_engine.gpu_cache.shape
        return (shape[0], shape[1], num_blocks, *shape[3:])

    def _run_pull(self, req_id: str, rp: RemotePrefill) -> None:
        t0 = time.perf_counter()
        data: torch.Tensor | None = None
        try:
            data = self._pull(rp, time.monotonic() + self.config.transfer_timeout)
        except Exception as e:  # any failure: the request prefills locally
            logger.warning("KV pull of %s from %s:%d failed (%s); prefilling it locally",
                           req_id, rp.remote_host, rp.remote_port, e)
        with self._lock:
            self._landed.append((req_id, rp, data))
            if data is None:
                self._stats.num_failures += 1
            else:
                self._stats.num_requests += 1
                self._stats.num_bytes += data.numel() * data.element_size()
                self._stats.transfer_seconds.append(time.perf_counter() - t0)
