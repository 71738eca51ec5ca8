"""The scheduler's remote-KV states (disaggregated prefill/decode), in process with a fake runner:
a consumer's request waits in WAITING_FOR_REMOTE_KVS holding its blocks, blocks nobody, and
decodes from prompt - 1 once its KV lands (or prefills locally when the pull fails); a producer's
finished request keeps its blocks until sent, or until its hold times out."""

from __future__ import annotations

import pytest
from core_fakes import FakeRunner, make_group, make_scheduler

from tessera.config import KVTransferConfig
from tessera.core.kv_connector import PullConnectorScheduler, check_kv_transfer_params
from tessera.core.runner_output import KVTransferStats, ModelRunnerOutput
from tessera.sampling.params import SamplingParams
from tessera.sequence import SequenceStatus
from tessera.utils import cdiv

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReportingRunner(FakeRunner):
    """A fake runner that also reports the connector's transfers the test decides on."""

    def __init__(self, scheduler) -> None:
        super().__init__(scheduler)
        self.sent: list[str] = []
        self.recved: list[str] = []
        self.failed: list[str] = []
        self.metas = []

    def execute(self, out):
        self.metas.append(out.kv_connector_metadata)
        result = super().execute(out)
        result.finished_sending, self.sent = self.sent, []
        result.finished_recving, self.recved = self.recved, []
        result.failed_recving, self.failed = self.failed, []
        return result

    def step(self):
        out = super().step()
        self.scheduler.block_manager.check_integrity()
        self.scheduler.check_remote_kv_integrity()
        return out


def connector(role: str, clock=None, hold_timeout: float = 10.0) -> PullConnectorScheduler:
    config = KVTransferConfig(kv_role=role, kv_port=5555,
                              kv_connector_extra_config={"hold_timeout": hold_timeout})
    return PullConnectorScheduler(config, BS, clock=clock or Clock(), engine_id="peer")


def remote_group(req_id: str, prompt_len: int, max_tokens: int = 4, prompt=None):
    group = make_group(req_id, prompt_len, max_tokens=max_tokens, prompt=prompt)
    group.sampling_params = SamplingParams(max_tokens=max_tokens, kv_transfer_params={
        "do_remote_prefill": True, "remote_block_ids": list(range(100, 100 + cdiv(prompt_len, BS))),
        "remote_host": "127.0.0.1", "remote_port": 5555, "remote_engine_id": "peer",
        "remote_request_id": "p-" + req_id})
    return group


def test_consumer_waits_holding_blocks_without_blocking_others_then_decodes_from_prompt_minus_one():
    sched = make_scheduler(block_size=BS, kv_connector=connector("kv_consumer"))
    runner = ReportingRunner(sched)
    sched.add_seq_group(remote_group("r", 10))
    sched.add_seq_group(make_group("local", 6, max_tokens=3))
    out = runner.step()
    remote = sched.waiting_for_remote_kvs["r"]
    assert remote.seqs[0].status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert "r" not in out.num_scheduled_tokens and out.num_scheduled_tokens == {"local": 6}
    table = sched.block_manager.get_block_table(remote.seqs[0])
    assert len(table) == 3
    pull = out.kv_connector_metadata.reqs_to_recv["r"]
    assert pull.local_block_ids == table and pull.remote_block_ids == [100, 101, 102]
    assert pull.remote_request_id == "p-r"
    for _ in range(3):  # the local request runs on while the KV travels
        out = runner.step()
        assert "r" not in out.num_scheduled_tokens
    assert "local" in runner.finished
    assert sched.get_num_unfinished_seq_groups() == 1
    prompt_before = sched.stats().num_prompt_tokens_total
    runner.recved = ["r"]
    runner.step()  # the report lands; the request joins running
    assert not sched.waiting_for_remote_kvs
    out = runner.step()
    assert out.num_scheduled_tokens == {"r": 1}  # only the last prompt token, to sample
    new = out.scheduled_new_reqs[0]
    assert new.req_id == "r" and new.num_computed_tokens == 9 and list(new.block_ids) == table
    assert sched.stats().num_prompt_tokens_total - prompt_before == 1
    runner.run()
    assert "r" in runner.finished
    assert sched.block_manager.get_num_free_gpu_blocks() == 64


def test_nothing_to_pull_prefills_at_once_and_releases_the_peer():
    sched = make_scheduler(block_size=BS, kv_connector=connector("kv_consumer"))
    runner = ReportingRunner(sched)
    sched.add_seq_group(remote_group("one", 1))  # a one-token prompt: the token is recomputed
    out = runner.step()
    assert out.num_scheduled_tokens == {"one": 1}
    release = out.kv_connector_metadata.reqs_to_recv["one"]
    assert release.local_block_ids == [] and release.remote_block_ids == []
    runner.recved = ["one"]  # its (empty) pull's report changes nothing
    runner.run()
    assert sched.block_manager.get_num_free_gpu_blocks() == 64


def test_failed_pull_prefills_locally():
    sched = make_scheduler(block_size=BS, kv_connector=connector("kv_consumer"))
    runner = ReportingRunner(sched)
    sched.add_seq_group(remote_group("r", 10))
    runner.step()
    runner.failed = ["r"]
    runner.step()
    out = runner.step()
    assert out.num_scheduled_tokens == {"r": 10}  # the whole prompt, here
    runner.run()
    assert sched.block_manager.get_num_free_gpu_blocks() == 64


def test_abort_while_waiting_frees_blocks_and_cancels_the_pull():
    sched = make_scheduler(block_size=BS, kv_connector=connector("kv_consumer"))
    runner = ReportingRunner(sched)
    sched.add_seq_group(remote_group("r", 10))
    runner.step()
    assert sched.block_manager.get_num_free_gpu_blocks() == 61
    sched.abort_seq_group("r")
    assert sched.block_manager.get_num_free_gpu_blocks() == 64
    assert not sched.has_unfinished_seqs()
    runner.recved = ["r"]  # a late report is ignored
    out = runner.step()
    assert out.kv_connector_metadata.reqs_to_cancel == ["r"]
    assert not sched.running and not sched.has_unfinished_seqs()


def test_local_prefix_hits_are_not_pulled():
    sched = make_scheduler(block_size=BS, prefix=True, kv_connector=connector("kv_consumer"))
    runner = ReportingRunner(sched)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks + 2
    sched.add_seq_group(make_group("first", 0, prompt=prompt[:9], max_tokens=1))
    runner.run()
    sched.add_seq_group(remote_group("r", 14, prompt=prompt))
    out = runner.step()
    pull = out.kv_connector_metadata.reqs_to_recv["r"]
    assert pull.remote_block_ids == [102, 103]  # blocks 0, 1 are this engine's own hits
    runner.recved = ["r"]
    runner.step()
    out = runner.step()
    assert out.num_scheduled_tokens == {"r": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 13
    runner.run()


def test_producer_holds_blocks_until_sent_and_returns_params():
    sched = make_scheduler(block_size=BS, kv_connector=connector("kv_producer"))
    runner = ReportingRunner(sched)
    group = make_group("p", 10, max_tokens=1)
    group.sampling_params = SamplingParams(max_tokens=1,
                                           kv_transfer_params={"do_remote_decode": True})
    sched.add_seq_group(group)
    out = sched.schedule()
    table = list(sched.block_manager.get_block_table(group.seqs[0]))
    (core,) = sched.update_from_output(out, runner.execute(out))
    assert core.finished
    params = core.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_block_ids"] == table
    assert params["remote_port"] == 5555 and params["remote_request_id"] == "p"
    assert sched.block_manager.get_num_free_gpu_blocks() == 61  # held for the peer
    assert sched.has_pending_kv_transfers() and not sched.has_unfinished_seqs()
    out = runner.step()
    assert out.kv_connector_metadata.reqs_to_send == {"p": table}
    runner.sent = ["p"]
    runner.step()
    assert sched.block_manager.get_num_free_gpu_blocks() == 64
    assert not sched.has_pending_kv_transfers()


def test_producer_hold_times_out():
    clock = Clock()
    sched = make_scheduler(block_size=BS, kv_connector=connector("kv_producer", clock, 5.0))
    runner = ReportingRunner(sched)
    group = make_group("p", 10, max_tokens=1)
    group.sampling_params = SamplingParams(max_tokens=1,
                                           kv_transfer_params={"do_remote_decode": True})
    sched.add_seq_group(group)
    runner.step()
    clock.now = 4.9
    runner.step()
    assert sched.block_manager.get_num_free_gpu_blocks() == 61
    clock.now = 5.0
    out = runner.step()
    assert out.kv_connector_metadata.reqs_to_cancel == ["p"]
    assert sched.block_manager.get_num_free_gpu_blocks() == 64
    assert sched.stats().num_kv_transfer_failures_total == 1
    runner.sent = ["p"]  # a report racing the timeout changes nothing
    runner.step()
    assert sched.block_manager.get_num_free_gpu_blocks() == 64


def test_transfer_stats_are_summed():
    sched = make_scheduler(block_size=BS, kv_connector=connector("kv_both"))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(kv_transfer_stats=KVTransferStats(
        num_requests=2, num_bytes=100, num_failures=1, transfer_seconds=[0.1, 0.2])))
    stats = sched.stats()
    assert (stats.num_kv_transfer_requests_total, stats.num_kv_transfer_bytes_total,
            stats.num_kv_transfer_failures_total) == (2, 100, 1)


@pytest.mark.parametrize("params, key", [
    ({"do_remote_prefill": True, "remote_block_ids": [1], "remote_host": "h",
      "remote_engine_id": "e", "remote_request_id": "r", "remote_port": 1}, "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "",
      "remote_engine_id": "e", "remote_request_id": "r", "remote_port": 1}, "remote_host"),
    ({"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "h",
      "remote_engine_id": "e", "remote_request_id": "r", "remote_port": 0}, "remote_port"),
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_kv_transfer_params_name_the_key(params, key):
    config = KVTransferConfig(kv_role="kv_both")
    with pytest.raises(ValueError, match=key):
        check_kv_transfer_params(params, config, num_prompt_tokens=8, block_size=BS)


def test_params_need_the_right_role():
    with pytest.raises(ValueError, match="do_remote_decode"):
        check_kv_transfer_params(
            {"do_remote_decode": True}, KVTransferConfig(kv_role="kv_consumer"), 8, BS
        )
    with pytest.raises(ValueError, match="kv-transfer-config"):
        check_kv_transfer_params({"do_remote_decode": True}, None, 8, BS)


@pytest.mark.parametrize("value, key", [
    ({"kv_connector": "Foo", "kv_role": "kv_both"}, "kv_connector"),
    ({"kv_connector": "TcpConnector", "kv_role": "both"}, "kv_role"),
    ({"kv_connector": "TcpConnector"}, "kv_role"),
    ({"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_port": 70000}, "kv_port"),
    ({"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_ip": ""}, "kv_ip"),
    ({"kv_connector": "TcpConnector", "kv_role": "kv_both", "port": 1}, "port"),
    ({"kv_connector": "TcpConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"hold_timeout": -1}}, "hold_timeout"),
    ('{"kv_connector": ', "JSON"),
])
def test_bad_kv_transfer_config_names_the_key(value, key):
    with pytest.raises(ValueError, match=key):
        KVTransferConfig.from_dict(value)
