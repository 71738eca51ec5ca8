"""`NixlConnector`: the KV moves by a NIXL READ (UCX; DRAM to DRAM over TCP on this CPU), the
library vLLM's disaggregation uses. Optional: `pip install tessera[nixl]`.

The TcpConnector's zmq socket stays as the side channel (who may read what), so both transports
share the scheduler half, the parking of early pulls and every failure path:

    consumer                                          producer
      {"op": "lease", request_id, block_ids} ──────▶  copy the held blocks into a staging tensor
                                                      registered with NIXL; the cache blocks are
                                                      released at once (as after a TCP send)
      ◀── {"ok", addr, nbytes, shape, dtype} + the producer agent's NIXL metadata
      NIXL READ of the staging tensor into its own registered staging tensor
      {"op": "done", request_id} ─────────────────▶  deregister and drop the staging tensor

Why a staging copy on both sides, when NIXL could read the cache in place: a one-sided READ
cannot be stopped by the producer, so a hold that expires mid-read would let a reused block be
read half-overwritten; and the consumer's engine thread must stay the only writer of its cache
(see base.py). A stage nobody collects is dropped after `transfer_timeout`.
"""

from __future__ import annotations

import json
import threading
import time

import torch
import zmq

from tessera.config import KVTransferConfig
from tessera.core.kv_connector import RemotePrefill
from tessera.distributed.kv_transfer.base import KVCache, TransferError
from tessera.distributed.kv_transfer.tcp_connector import (
    _POLL_MS,
    TcpConnectorWorker,
    _dtype_name,
)

_MEM = "DRAM"


def _load_nixl():
    import importlib

    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):  # the meta package, or a build
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        return api.nixl_agent, api.nixl_agent_config
    raise ValueError("kv_transfer_config: kv_connector NixlConnector needs the nixl extra "
                     "(pip install 'tessera[nixl]'); or use TcpConnector")


class NixlConnectorWorker(TcpConnectorWorker):
    def __init__(self, config: KVTransferConfig, cache_engine: KVCache, engine_id: str) -> None:
        nixl_agent, nixl_agent_config = _load_nixl()
        if cache_engine.device.type != "cpu":
            raise ValueError("kv_transfer_config: NixlConnector here moves DRAM only (device cpu)")
        self._agent = nixl_agent(engine_id, nixl_agent_config(backends=["UCX"]))
        self._agent_lock = threading.Lock()  # one caller of the agent at a time
        self._remote_agents: dict[str, str] = {}  # engine id -> NIXL agent name
        self._staged: dict[str, tuple[torch.Tensor, object, float]] = {}  # req -> stage, reg, until
        super().__init__(config, cache_engine, engine_id)

    # producer: the side channel's answers

    def _answer(self, body, give_up: bool) -> tuple[dict, object] | None:
        req = json.loads(body)
        self._drop_stale_stages()
        if req.get("op") == "done":
            self._unstage(str(req["request_id"]))
            return {"ok": True}, b""
        req_id = str(req["request_id"])
        held = self._held_blocks(req, give_up)
        if not isinstance(held, torch.Tensor):
            return held
        data = held.contiguous()
        with self._agent_lock:
            reg = self._agent.register_memory(data) if data.numel() else None
            meta = self._agent.get_agent_metadata()
        self._staged[req_id] = (data, reg, time.monotonic() + self.config.transfer_timeout)
        header = {"ok": True, "addr": data.data_ptr(), "nbytes": data.numel() * data.element_size(),
                  "shape": list(data.shape), "dtype": _dtype_name(data.dtype)}
        return header, meta

    def _unstage(self, req_id: str) -> None:
        entry = self._staged.pop(req_id, None)
        if entry is not None and entry[1] is not None:
            with self._agent_lock:
                self._agent.deregister_memory(entry[1])

    def _drop_stale_stages(self) -> None:
        now = time.monotonic()
        for req_id in [r for r, (_, _, until) in self._staged.items() if until < now]:
            self._unstage(req_id)

    # consumer

    def _pull(self, rp: RemotePrefill, deadline: float) -> torch.Tensor:
        header, meta = self._ask(rp, {"op": "lease", "request_id": rp.remote_request_id,
                                      "block_ids": rp.remote_block_ids,
                                      "engine_id": rp.remote_engine_id}, deadline)
        expected = self.expected_shape(len(rp.remote_block_ids))
        dtype = self.cache_engine.gpu_cache.dtype
        if tuple(header["shape"]) != expected or header["dtype"] != _dtype_name(dtype):
            raise TransferError(f"the peer's blocks are {header['dtype']} {header['shape']}, "
                                f"this engine's {_dtype_name(dtype)} {list(expected)}")
        data = torch.empty(expected, dtype=dtype)
        if data.numel():
            try:
                self._read(rp.remote_engine_id, meta, data, header, deadline)
            finally:
                self._ask(rp, {"op": "done", "request_id": rp.remote_request_id}, deadline)
        return data

    def _read(self, engine_id: str, meta: bytes, data: torch.Tensor, header: dict,
              deadline: float) -> None:
        nbytes = data.numel() * data.element_size()
        if nbytes != header["nbytes"]:
            raise TransferError(f"the peer stages {header['nbytes']} bytes, not {nbytes}")
        # one read at a time per process, under the lock: the peer's metadata is loaded afresh
        # for each (its stage is a new registration), which must not happen under a live read
        with self._agent_lock:
            known = self._remote_agents.pop(engine_id, None)
            if known is not None:
                self._agent.remove_remote_agent(known)
            remote = self._remote_agents[engine_id] = self._agent.add_remote_agent(meta)
            reg = self._agent.register_memory(data)
            handle = None
            try:
                local = self._agent.get_xfer_descs([(data.data_ptr(), nbytes, 0)], _MEM)
                remote_descs = self._agent.get_xfer_descs([(int(header["addr"]), nbytes, 0)], _MEM)
                handle = self._agent.initialize_xfer("READ", local, remote_descs, remote)
                state = self._agent.transfer(handle)
                while state == "PROC":
                    if time.monotonic() > deadline or self._closed.is_set():
                        raise TransferError("the NIXL read did not finish in time "
                                            "(transfer_timeout)")
                    time.sleep(0.0002)
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise TransferError(f"the NIXL read failed ({state})")
            finally:
                if handle is not None:
                    self._agent.release_xfer_handle(handle)
                self._agent.deregister_memory(reg)

    def _ask(self, rp: RemotePrefill, message: dict, deadline: float) -> tuple[dict, bytes]:
        """One request on the side channel: (header, payload)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{rp.remote_host}:{rp.remote_port}")
            sock.send(json.dumps(message).encode())
            while not sock.poll(_POLL_MS):
                if self._closed.is_set():
                    raise TransferError("shutting down")
                if time.monotonic() > deadline:
                    raise TransferError(f"no answer within {self.config.transfer_timeout:g} s "
                                        "(transfer_timeout)")
            header_frame, payload = sock.recv_multipart()
        finally:
            sock.close(linger=0)
        header = json.loads(header_frame)
        if not header.get("ok"):
            raise TransferError(header.get("error", "refused"))
        return header, payload

    def shutdown(self) -> None:
        super().shutdown()
        for req_id in list(self._staged):
            self._unstage(req_id)
