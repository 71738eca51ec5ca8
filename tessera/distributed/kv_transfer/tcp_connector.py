"""`TcpConnector`: KV blocks over TCP with pyzmq, one message per request.

    consumer (DEALER, one socket per pull)            producer (ROUTER on kv_ip:kv_port)
      [{"request_id", "block_ids", "engine_id"}] ──▶  read the held blocks (a copy)
      ◀── [{"ok", "shape", "dtype"} | {"ok": false, "error"}, raw bytes of all layers' K and V]

Whole blocks of every layer in one frame: on loopback a per-layer split only adds messages (the
cost is the copy, not latency; benchmarks/disagg.py). zmq hides dead peers (it reconnects
silently), so a pull has a deadline: past `transfer_timeout` the consumer gives up and prefills
locally. The producer's socket thread polls in short slices so that shutdown is prompt.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import torch
import zmq

from tessera.config import KVTransferConfig
from tessera.core.kv_connector import RemotePrefill
from tessera.distributed.kv_transfer.base import KVCache, KVConnectorWorker, TransferError

logger = logging.getLogger(__name__)

_POLL_MS = 100
_PARKED_POLL_MS = 2
# a pull may come before the producer's next step has registered the request's blocks
_REGISTRATION_GRACE_S = 5.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TcpConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, cache_engine: KVCache, engine_id: str) -> None:
        super().__init__(config, cache_engine, engine_id)
        self._ctx = zmq.Context()
        self._port = 0
        self._thread: threading.Thread | None = None
        if config.is_producer:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            address = f"tcp://{config.kv_ip}:{config.kv_port}"
            try:
                if config.kv_port == 0:
                    self._port = sock.bind_to_random_port(f"tcp://{config.kv_ip}")
                else:
                    sock.bind(address)
                    self._port = config.kv_port
            except zmq.ZMQError as e:
                sock.close()
                raise ValueError(f"kv_transfer_config: cannot serve KV on {address} "
                                 f"(kv_ip, kv_port): {e}") from e
            self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                            name="kv-serve")
            self._thread.start()
            logger.info("serving KV blocks on tcp://%s:%d", config.kv_ip, self._port)

    @property
    def port(self) -> int:
        return self._port

    # producer

    def _serve(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        parked: list[tuple[float, bytes, dict]] = []  # pulls for requests not registered yet
        try:
            while not self._closed.is_set():
                ready = poller.poll(_PARKED_POLL_MS if parked else _POLL_MS)
                now = time.monotonic()
                todo, parked = parked, []
                if ready:
                    frames = sock.recv_multipart()
                    if len(frames) == 2:
                        todo.append((now + _REGISTRATION_GRACE_S, frames[0], frames[1]))
                for deadline, ident, body in todo:
                    try:
                        answer = self._answer(body, now > deadline)
                    except Exception as e:  # a malformed request fails only itself
                        answer = {"ok": False, "error": f"bad request: {e}"}, b""
                    if answer is None:
                        parked.append((deadline, ident, body))
                        continue
                    header, payload = answer
                    sock.send_multipart([ident, json.dumps(header).encode(), payload], copy=False)
        finally:
            sock.close(linger=0)

    def _answer(self, body, give_up: bool) -> tuple[dict, object] | None:
        """The reply to one pull; None: ask again shortly (not registered yet)."""
        data = self._held_blocks(json.loads(body), give_up)
        if not isinstance(data, torch.Tensor):
            return data
        header = {"ok": True, "shape": list(data.shape), "dtype": _dtype_name(data.dtype)}
        return header, data.contiguous().view(torch.uint8).numpy()

    def _held_blocks(self, req: dict, give_up: bool) -> torch.Tensor | tuple[dict, bytes] | None:
        """The blocks a pull asks for, or the error reply to send instead, or None: ask again
        shortly (the request is not registered yet, and `give_up` is not set)."""
        if req.get("engine_id") != self.engine_id:
            return {"ok": False, "error": "another engine (remote_engine_id does not match)"}, b""
        data = self.read_blocks(str(req["request_id"]), [int(b) for b in req["block_ids"]])
        if data is None:
            if not give_up:
                return None
            data = f"request {req['request_id']!r} is not held here"
        if isinstance(data, str):
            return {"ok": False, "error": data}, b""
        return data

    # consumer

    def _pull(self, rp: RemotePrefill, deadline: float) -> torch.Tensor:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{rp.remote_host}:{rp.remote_port}")
            sock.send(json.dumps({"request_id": rp.remote_request_id,
                                  "block_ids": rp.remote_block_ids,
                                  "engine_id": rp.remote_engine_id}).encode())
            while not sock.poll(_POLL_MS):
                if self._closed.is_set():
                    raise TransferError("shutting down")
                if time.monotonic() > deadline:
                    raise TransferError(f"no answer within {self.config.transfer_timeout:g} s "
                                        "(transfer_timeout)")
            header = json.loads(sock.recv())
            if not header.get("ok"):
                raise TransferError(header.get("error", "refused"))
            expected = self.expected_shape(len(rp.remote_block_ids))
            dtype = self.cache_engine.gpu_cache.dtype
            if tuple(header["shape"]) != expected or header["dtype"] != _dtype_name(dtype):
                raise TransferError(f"the peer's blocks are {header['dtype']} {header['shape']}, "
                                    f"this engine's {_dtype_name(dtype)} {list(expected)}: same "
                                    "model, dtype and --block-size on both sides")
            data = torch.empty(expected, dtype=dtype)
            # straight into the staging tensor: no intermediate copy of the payload
            size = sock.recv_into(data.view(-1).view(torch.uint8).numpy()) if data.numel() else 0
            if size != data.numel() * data.element_size():
                raise TransferError(
                    f"the payload has {size} bytes, not {data.numel() * data.element_size()}"
                )
            return data
        finally:
            sock.close(linger=0)

    def shutdown(self) -> None:
        super().shutdown()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._ctx.destroy(linger=0)
