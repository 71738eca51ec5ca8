"""The TcpConnector's worker halves over loopback, two small KV caches in one process: a pull
copies exactly the producer's blocks into the consumer's, is served once, and every failure (an
unknown request, a dead peer, another engine, a different geometry, a hold that expired) ends in
`failed` within the deadline instead of hanging."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from tessera.config import KVTransferConfig
from tessera.core.kv_connector import KVConnectorMetadata, RemotePrefill
from tessera.distributed.kv_transfer import create_kv_connector_worker
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache(block_size: int = 4, num_blocks: int = 16, dtype=torch.float32) -> CacheEngine:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=block_size, dtype=dtype)
    return CacheEngine(spec, num_blocks, 0, torch.device("cpu"))


def worker(role: str, engine: CacheEngine, timeout: float = 5.0, engine_id: str = "P"):
    config = KVTransferConfig(kv_role=role, kv_port=0,
                              kv_connector_extra_config={"transfer_timeout": timeout})
    return create_kv_connector_worker(config, engine, engine_id)


def wait_finished(w, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    sent, recv, failed = [], [], []
    while time.monotonic() < deadline:
        s, r, f, _ = w.get_finished()
        sent, recv, failed = sent + s, recv + r, failed + f
        if recv or failed:
            return recv, failed
        time.sleep(0.01)
    raise AssertionError("the pull neither landed nor failed")


@pytest.fixture
def pair():
    p_cache, d_cache = cache(), cache()
    p_cache.gpu_cache.copy_(torch.randn_like(p_cache.gpu_cache))
    producer, consumer = worker("kv_producer", p_cache), worker("kv_consumer", d_cache)
    yield p_cache, d_cache, producer, consumer
    producer.shutdown()
    consumer.shutdown()


def pull(producer, local, remote, req="r", engine_id="P", port=None) -> RemotePrefill:
    return RemotePrefill(local, remote, "127.0.0.1", port or producer.port, engine_id, req)


def test_pull_copies_exactly_the_blocks_and_is_served_once(pair):
    p_cache, d_cache, producer, consumer = pair
    producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [3, 7, 1]}))
    before = d_cache.gpu_cache.clone()
    consumer.bind_connector_metadata(KVConnectorMetadata(
        reqs_to_recv={"d": pull(producer, [0, 5, 9], [3, 7, 1])}))
    recv, failed = wait_finished(consumer)
    assert (recv, failed) == (["d"], [])
    for src, dst in ((3, 0), (7, 5), (1, 9)):
        assert torch.equal(d_cache.gpu_cache[:, :, dst], p_cache.gpu_cache[:, :, src])
    untouched = [b for b in range(16) if b not in (0, 5, 9)]
    assert torch.equal(d_cache.gpu_cache[:, :, untouched], before[:, :, untouched])
    sent, _, _, stats = producer.get_finished()
    assert sent == ["r"] and stats.num_requests == 1
    assert stats.num_bytes == 3 * p_cache.spec.block_bytes
    # a second pull of the same request is refused at once: its blocks may be reused
    consumer.bind_connector_metadata(KVConnectorMetadata(
        reqs_to_recv={"again": pull(producer, [0], [3])}))
    t0 = time.monotonic()
    assert wait_finished(consumer) == ([], ["again"])
    assert time.monotonic() - t0 < 2


def test_a_suffix_of_the_blocks_can_be_pulled(pair):
    p_cache, d_cache, producer, consumer = pair
    producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [3, 7, 1]}))
    consumer.bind_connector_metadata(KVConnectorMetadata(
        reqs_to_recv={"d": pull(producer, [4], [1])}))
    assert wait_finished(consumer) == (["d"], [])
    assert torch.equal(d_cache.gpu_cache[:, :, 4], p_cache.gpu_cache[:, :, 1])


def test_an_empty_pull_releases_the_blocks(pair):
    p_cache, d_cache, producer, consumer = pair
    producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [3]}))
    before = d_cache.gpu_cache.clone()
    consumer.bind_connector_metadata(
        KVConnectorMetadata(reqs_to_recv={"d": pull(producer, [], [])})
    )
    assert wait_finished(consumer) == (["d"], [])
    assert torch.equal(d_cache.gpu_cache, before)
    assert producer.get_finished()[0] == ["r"]


def test_a_pull_before_registration_waits_for_it(pair):
    p_cache, d_cache, producer, consumer = pair
    consumer.bind_connector_metadata(KVConnectorMetadata(
        reqs_to_recv={"d": pull(producer, [2], [6])}))
    time.sleep(0.3)  # the producer's next step has not run yet
    producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [6]}))
    assert wait_finished(consumer) == (["d"], [])
    assert torch.equal(d_cache.gpu_cache[:, :, 2], p_cache.gpu_cache[:, :, 6])


@pytest.mark.parametrize("case", ["foreign_blocks", "other_engine", "expired"])
def test_refusals_fail_fast(pair, case):
    p_cache, d_cache, producer, consumer = pair
    producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [3, 7]}))
    engine_id, remote = "P", [3, 7]
    if case == "foreign_blocks":
        remote = [3, 8]
    elif case == "other_engine":
        engine_id = "someone else"
    else:
        producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_cancel=["r"]))
    before = d_cache.gpu_cache.clone()
    consumer.bind_connector_metadata(KVConnectorMetadata(
        reqs_to_recv={"d": pull(producer, [0, 1], remote, engine_id=engine_id)}))
    t0 = time.monotonic()
    assert wait_finished(consumer) == ([], ["d"])
    assert time.monotonic() - t0 < 2
    assert torch.equal(d_cache.gpu_cache, before)
    assert consumer.get_finished()[3] is None  # reported once


def test_geometry_mismatch_fails():
    p_cache, d_cache = cache(block_size=4), cache(block_size=8)
    producer, consumer = worker("kv_producer", p_cache), worker("kv_consumer", d_cache)
    try:
        producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [1]}))
        consumer.bind_connector_metadata(KVConnectorMetadata(
            reqs_to_recv={"d": pull(producer, [1], [1])}))
        assert wait_finished(consumer) == ([], ["d"])
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_dead_peer_times_out():
    consumer = worker("kv_consumer", cache(), timeout=0.5)
    try:
        port = free_port()  # nothing listens there
        consumer.bind_connector_metadata(KVConnectorMetadata(
            reqs_to_recv={"d": RemotePrefill([0], [0], "127.0.0.1", port, "P", "r")}))
        t0 = time.monotonic()
        recv, failed = wait_finished(consumer)
        assert (recv, failed) == ([], ["d"])
        assert 0.4 < time.monotonic() - t0 < 3
    finally:
        consumer.shutdown()


def test_cancelled_pull_never_writes(pair):
    p_cache, d_cache, producer, consumer = pair
    producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [3]}))
    before = d_cache.gpu_cache.clone()
    consumer.bind_connector_metadata(KVConnectorMetadata(
        reqs_to_recv={"d": pull(producer, [0], [3])}))
    time.sleep(0.5)  # landed in staging by now
    consumer.bind_connector_metadata(KVConnectorMetadata(reqs_to_cancel=["d"]))
    recv, failed, *_ = consumer.get_finished()[1:]
    assert recv == [] and failed == []
    assert torch.equal(d_cache.gpu_cache, before)


def test_bfloat16_blocks_travel_bit_exact():
    p_cache, d_cache = cache(dtype=torch.bfloat16), cache(dtype=torch.bfloat16)
    p_cache.gpu_cache.copy_(torch.randn(p_cache.gpu_cache.shape))
    producer, consumer = worker("kv_producer", p_cache), worker("kv_consumer", d_cache)
    try:
        producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={"r": [2, 5]}))
        consumer.bind_connector_metadata(KVConnectorMetadata(
            reqs_to_recv={"d": pull(producer, [1, 0], [2, 5])}))
        assert wait_finished(consumer) == (["d"], [])
        assert torch.equal(d_cache.gpu_cache[:, :, [1, 0]], p_cache.gpu_cache[:, :, [2, 5]])
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_busy_port_is_an_error_naming_the_key():
    producer = worker("kv_producer", cache())
    try:
        config = KVTransferConfig(kv_role="kv_producer", kv_port=producer.port)
        with pytest.raises(ValueError, match="kv_port"):
            create_kv_connector_worker(config, cache(), "Q")
    finally:
        producer.shutdown()
