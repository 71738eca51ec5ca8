"""The NixlConnector's worker halves over loopback (UCX), when the `nixl` extra is installed:
the same pull as TcpConnector's, moved by a NIXL READ; skipped cleanly without the extra."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from tessera.config import KVTransferConfig
from tessera.core.kv_connector import KVConnectorMetadata, RemotePrefill
from tessera.distributed.kv_transfer import create_kv_connector_worker
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec

HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl_cu12", "nixl_cu13", "nixl"))


def cache() -> CacheEngine:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    return CacheEngine(spec, 16, 0, torch.device("cpu"))


def worker(role: str, engine: CacheEngine, engine_id: str):
    config = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, kv_port=0,
                              kv_connector_extra_config={"transfer_timeout": 10})
    return create_kv_connector_worker(config, engine, engine_id)


def wait_finished(w, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, recv, failed, _ = w.get_finished()
        if recv or failed:
            return recv, failed
        time.sleep(0.01)
    raise AssertionError("the pull neither landed nor failed")


@pytest.mark.skipif(HAVE_NIXL, reason="the nixl extra is installed")
def test_without_the_extra_the_config_error_says_what_to_install():
    with pytest.raises(ValueError, match="nixl"):
        worker("kv_producer", cache(), "P")


@pytest.mark.skipif(not HAVE_NIXL, reason="the nixl extra is not installed")
def test_nixl_pull_copies_exactly_the_blocks_and_is_served_once():
    p_cache, d_cache = cache(), cache()
    p_cache.gpu_cache.copy_(torch.randn_like(p_cache.gpu_cache))
    producer, consumer = worker("kv_producer", p_cache, "P"), worker("kv_consumer", d_cache, "D")
    try:
        producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [3, 7, 1]}))
        before = d_cache.gpu_cache.clone()
        consumer.bind_connector_metadata(KVConnectorMetadata(reqs_to_recv={
            "d": RemotePrefill([0, 5, 9], [3, 7, 1], "127.0.0.1", producer.port, "P", "r")}))
        assert wait_finished(consumer) == (["d"], [])
        for src, dst in ((3, 0), (7, 5), (1, 9)):
            assert torch.equal(d_cache.gpu_cache[:, :, dst], p_cache.gpu_cache[:, :, src])
        others = [b for b in range(16) if b not in (0, 5, 9)]
        assert torch.equal(d_cache.gpu_cache[:, :, others], before[:, :, others])
        assert producer.get_finished()[0] == ["r"]
        # a second request from the same producer (a new stage, new registrations)
        producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r2": [4]}))
        consumer.bind_connector_metadata(KVConnectorMetadata(reqs_to_recv={
            "d2": RemotePrefill([2], [4], "127.0.0.1", producer.port, "P", "r2")}))
        assert wait_finished(consumer) == (["d2"], [])
        assert torch.equal(d_cache.gpu_cache[:, :, 2], p_cache.gpu_cache[:, :, 4])
        consumer.bind_connector_metadata(KVConnectorMetadata(reqs_to_recv={
            "again": RemotePrefill([0], [3], "127.0.0.1", producer.port, "P", "r")}))
        assert wait_finished(consumer) == ([], ["again"])
        time.sleep(0.2)
        assert not producer._staged  # the consumer's "done" dropped the stage
    finally:
        producer.shutdown()
        consumer.shutdown()
