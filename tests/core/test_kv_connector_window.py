"""Disaggregated prefill/decode with a sliding window or KV cache groups, in process: a producer
scheduler prefills (its window groups releasing as usual), and the consumer pulls only the live
entries of the per-group tables, releases its own entries that got nothing, and decodes. Both
sides run a fake KV cache (tests/core/core_fakes.py: FakeKVRunner) whose blocks the "transfer"
copies pair by pair, so every consumer query reads back its window's tokens only if the right
blocks moved."""

from __future__ import annotations

import pytest

from tessera.config import CacheConfig, KVTransferConfig, SchedulerConfig
from tessera.core.block_manager import NULL_BLOCK
from tessera.core.kv_cache_groups import cache_group_windows
from tessera.core.kv_connector import PullConnectorScheduler, check_kv_transfer_params
from tessera.core.scheduler import Scheduler
from tessera.sampling.params import SamplingParams
from tests.core.core_fakes import FakeKVRunner, make_group

BS = 4


class TransferRunner(FakeKVRunner):
    """Applies the connector's instructions to the fake caches: a pull copies the peer's blocks
    pair by pair and lands at once; a send is reported read out at once."""

    def __init__(self, scheduler: Scheduler, peer: FakeKVRunner | None = None) -> None:
        super().__init__(scheduler, scheduler.block_manager.group_windows)
        self.peer = peer
        self.pulled: list[tuple[list[int], list[int]]] = []

    def execute(self, out):
        meta = out.kv_connector_metadata
        recved, sent = [], []
        if meta:
            for req_id, rp in meta.reqs_to_recv.items():
                assert self.peer is not None
                assert NULL_BLOCK not in rp.local_block_ids + rp.remote_block_ids
                for local, remote in zip(rp.local_block_ids, rp.remote_block_ids, strict=True):
                    self.gpu[local] = dict(self.peer.gpu[remote])
                self.pulled.append((rp.local_block_ids, rp.remote_block_ids))
                recved.append(req_id)
            sent = list(meta.reqs_to_send)
        result = super().execute(out)
        result.finished_recving = recved
        result.finished_sending = sent
        return result


def _scheduler(role: str, windows: dict, budget: int) -> Scheduler:
    cache = CacheConfig(block_size=BS, enable_prefix_caching=False, watermark=0.0, **windows)
    num_groups = len(cache_group_windows(cache.sliding_window, cache.layer_windows))
    kv = KVTransferConfig(kv_role=role, kv_port=5555)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=128,
                        enable_chunked_prefill=True),
        cache, 60 * num_groups, 0,
        kv_connector=PullConnectorScheduler(kv, BS, engine_id=role, num_groups=num_groups))


@pytest.mark.parametrize("windows", [{"sliding_window": 8}, {"layer_windows": (None, 8, 8)}],
                         ids=["mistral", "mixed"])
@pytest.mark.parametrize("prompt_len", [30, 31, 33])  # 31: the last query's window starts a block
def test_consumer_decodes_from_the_live_window_blocks(windows, prompt_len):
    prompt = [(11 * j) % 97 + 3 for j in range(prompt_len)]
    producer = _scheduler("kv_producer", windows, budget=8)
    group = make_group("p", 0, prompt=prompt, max_tokens=1)
    group.sampling_params = SamplingParams(max_tokens=1, kv_transfer_params={
        "do_remote_decode": True})
    producer.add_seq_group(group)
    p_runner = TransferRunner(producer)
    params = None
    while producer.has_unfinished_seqs():
        out = producer.schedule()
        for core in producer.update_from_output(out, p_runner.execute(out)):
            params = core.kv_transfer_params or params
    assert params is not None and producer.has_pending_kv_transfers()
    bm = producer.block_manager
    assert bm.num_released_blocks > 0
    ids = params["remote_block_ids"]
    ng = bm.num_groups
    assert len(ids) == -(-prompt_len // BS) * ng and NULL_BLOCK in ids
    check_kv_transfer_params(params, KVTransferConfig(kv_role="kv_consumer"), prompt_len, BS, ng)

    consumer = _scheduler("kv_consumer", windows, budget=8)
    c_runner = TransferRunner(consumer, peer=p_runner)
    remote = make_group("c", 0, prompt=prompt, max_tokens=6)
    remote.sampling_params = SamplingParams(max_tokens=6, kv_transfer_params=params)
    consumer.add_seq_group(remote)
    computed_prompt = []
    seq = remote.seqs[0]
    landed = None
    while consumer.has_unfinished_seqs():
        out = consumer.schedule()
        computed_prompt += [n for n in out.num_scheduled_tokens.values()]
        consumer.update_from_output(out, c_runner.execute(out))
        consumer.block_manager.check_integrity()
        if landed is None and seq.num_computed_tokens == prompt_len - 1:
            landed = list(consumer.block_manager.get_block_table(seq)[:len(ids)])
    # landed: the entries that got nothing from the peer are released at once (never read,
    # never offered to the prefix cache)
    assert landed is not None
    assert [b == NULL_BLOCK for b in landed] == [b == NULL_BLOCK for b in ids]
    assert computed_prompt[0] == 1  # the last prompt token only: the rest was pulled
    (local, pulled), = c_runner.pulled
    assert len(pulled) == sum(b != NULL_BLOCK for b in ids)
    assert consumer.block_manager.gpu.num_free == consumer.block_manager.num_gpu_blocks
    # the producer lets go once its blocks are read out
    out = producer.schedule()
    producer.update_from_output(out, p_runner.execute(out))
    assert not producer.has_pending_kv_transfers()
    assert bm.gpu.num_free == bm.num_gpu_blocks


def test_remote_block_ids_count_every_group():
    kv = KVTransferConfig(kv_role="kv_consumer")
    base = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
            "remote_engine_id": "e", "remote_request_id": "r"}
    check_kv_transfer_params({**base, "remote_block_ids": [1, -1, 2, 3]}, kv, 8, BS, 2)
    with pytest.raises(ValueError, match="in each of 2 KV cache groups"):
        check_kv_transfer_params({**base, "remote_block_ids": [1, 2]}, kv, 8, BS, 2)
    with pytest.raises(ValueError, match="remote_block_ids must be a list"):
        check_kv_transfer_params({**base, "remote_block_ids": [1, -2]}, kv, 8, BS, 1)
