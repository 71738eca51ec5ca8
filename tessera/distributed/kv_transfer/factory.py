"""`create_kv_connector_worker`: the worker half named by `--kv-transfer-config`'s `kv_connector`.

Its own module, above the connectors it builds: in `base.py` it made the base class and its
subclasses import one another.
"""

from __future__ import annotations

from tessera.config import KVTransferConfig
from tessera.distributed.kv_transfer.base import KVCache, KVConnectorWorker


def create_kv_connector_worker(config: KVTransferConfig, cache_engine: KVCache,
                               engine_id: str) -> KVConnectorWorker:
    """The worker half named by `kv_connector` (TcpConnector or NixlConnector)."""
    if config.kv_connector == "TcpConnector":
        from tessera.distributed.kv_transfer.tcp_connector import TcpConnectorWorker

        return TcpConnectorWorker(config, cache_engine, engine_id)
    from tessera.distributed.kv_transfer.nixl_connector import NixlConnectorWorker

    return NixlConnectorWorker(config, cache_engine, engine_id)
