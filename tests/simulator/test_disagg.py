"""A simulated prefill/decode pair: the real schedulers with the real connector halves, the KV
pull priced by the cost model and on the client's TTFT."""

from __future__ import annotations

import pytest

from tessera.config import EngineArgs
from tessera.entrypoints.cli import build_parser
from tessera.simulator.cli import run_point
from tessera.simulator.disagg import DisaggSimulator
from tessera.simulator.parallel import LinkSpec
from tessera.simulator.report import request_results
from tessera.simulator.simulator import SimRequest
from tests.simulator.sim_fakes import FixedCost

KV = {"kv_connector": "TcpConnector", "kv_role": "kv_both"}


def _pair(link: LinkSpec, **engine):
    config = EngineArgs(max_model_len=512, block_size=4, kv_transfer_config=KV,
                        **engine).create_engine_config(512)
    cost = FixedCost(per_step=0.01, per_token=0.001)
    cost.kv_link = link
    return DisaggSimulator(config, cost, 256, 0), cost


def test_ttft_includes_the_kv_pull():
    sim, cost = _pair(LinkSpec(latency_s=0.5, bandwidth=1e6))
    outcome = sim.run([SimRequest(list(range(1, 13)), 5, 0.0)])
    (r,) = request_results(outcome)
    # 12 prompt tokens = 3 blocks of 4, 64 bytes a token (1 layer, 1 head of 8, fp32, K and V)
    pull = 0.5 + 12 * 64 / 1e6
    prefill = 0.01 + 12 * 0.001  # the producer's prefill step
    decode = 0.01 + 0.001  # each consumer step: the last prompt token, then one a step
    assert cost.kv_transfer_time(12) == pytest.approx(pull)
    assert r.success and r.output_tokens == 5
    assert r.ttft == pytest.approx(prefill + pull + decode)
    assert r.e2el == pytest.approx(prefill + pull + 5 * decode)
    c = outcome.counters
    assert c["kv_transfer_requests"] == 1 and c["kv_transfer_bytes"] == 12 * 64
    assert c["decode_prompt_tokens_computed"] == 1  # only the last prompt token is recomputed
    # every block is back: the producer let go once the pull read them
    for inst in (sim.prefill, sim.decode):
        assert inst.scheduler.block_manager.gpu_usage() == 0.0
        assert not inst.scheduler.has_pending_kv_transfers()


def test_a_slower_link_only_moves_ttft():
    reqs = [SimRequest([100 * k + i + 1 for i in range(40)], 8, 0.05 * k) for k in range(6)]
    fast = request_results(_pair(LinkSpec(1e-4, 1e9))[0].run(reqs))
    slow = request_results(_pair(LinkSpec(0.2, 1e9))[0].run(reqs))
    for f, s in zip(fast, slow, strict=True):
        assert s.ttft - f.ttft == pytest.approx(0.2 - 1e-4, abs=0.03)
        assert s.output_tokens == f.output_tokens == 8


def test_kv_transfer_config_simulates_the_pair_from_the_cli():
    args = build_parser().parse_args([
        "simulate", "--dtype", "bfloat16", "--kv-cache-space", "10", "--dataset", "random",
        "--num-prompts", "8", "--random-input-len", "64", "--random-output-len", "4",
        "--kv-transfer-config", '{"kv_connector": "TcpConnector", "kv_role": "kv_both"}'])
    from tessera.simulator.cli import load_samples

    m = run_point(args, load_samples(args), 4.0, include_requests=False)["metrics"]
    assert m["completed"] == 8 and m["kv_transfer_requests"] == 8
    assert m["mean_kv_transfer_ms"] > 0


def test_a_window_moves_only_its_live_blocks():
    """Mistral-style window of 8: the producer releases what the window left while it prefills
    in chunks, so the pull moves the window's blocks, not the prompt's."""
    config = EngineArgs(max_model_len=512, block_size=4, kv_transfer_config=KV,
                        max_num_batched_tokens=8).create_engine_config(512, sliding_window=8)
    assert config.cache.sliding_window == 8  # release stays on with a connector
    cost = FixedCost(per_step=0.01, per_token=0.001)
    cost.kv_link = LinkSpec(latency_s=0.01, bandwidth=1e6)
    sim = DisaggSimulator(config, cost, 256, 0)
    outcome = sim.run([SimRequest(list(range(1, 41)), 5, 0.0)])
    (r,) = request_results(outcome)
    assert r.success and r.output_tokens == 5
    c = outcome.counters
    # 40 tokens = 10 blocks; the last query (position 39) sees keys 32..39: blocks 8 and 9
    assert c["kv_transfer_requests"] == 1 and c["kv_transfer_bytes"] == 2 * 4 * 64
    assert c["decode_prompt_tokens_computed"] == 1
    for inst in (sim.prefill, sim.decode):
        assert inst.scheduler.block_manager.gpu_usage() == 0.0
        assert not inst.scheduler.has_pending_kv_transfers()
