"""The worker half of the KV connectors (disaggregated prefill/decode): moves KV blocks between
engines as the scheduler half (tessera/core/kv_connector.py) instructs.

    TcpConnector   built in: pyzmq over TCP, one message per request (tcp_connector.py)
    NixlConnector  NIXL, the library vLLM uses, when the `nixl` extra is installed
    (nixl_connector.py)
"""

from __future__ import annotations

from tessera.distributed.kv_transfer.base import KVConnectorWorker
from tessera.distributed.kv_transfer.factory import create_kv_connector_worker

__all__ = ["KVConnectorWorker", "create_kv_connector_worker"]
