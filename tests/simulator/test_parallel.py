"""The seams that landed: tensor parallelism's all-reduces, a disaggregated consumer's KV pull,
speculative decoding's acceptance model, and the serving latency outside the engine. Each test
fails if its seam goes back to costing nothing."""

from __future__ import annotations

import pytest

from tessera.config import EngineArgs
from tessera.entrypoints.cli import build_parser
from tessera.simulator.batch import BatchShape
from tessera.simulator.cli import acceptance_model, engine_setup, make_cost_model
from tessera.simulator.parallel import LinkSpec, TensorParallelCost, ring_all_reduce_time
from tessera.simulator.report import request_results
from tessera.simulator.roofline import RooflineCostModel
from tessera.simulator.simulator import SimRequest, Simulator
from tessera.simulator.spec_decode import GeometricAcceptance
from tessera.simulator.specs import load_hardware, load_model_config
from tests.simulator.sim_fakes import FixedCost

ROOFLINE = ["--dtype", "bfloat16", "--kv-cache-space", "10"]


def _parse(*flags: str):
    return build_parser().parse_args(["simulate", *flags])


def test_ring_all_reduce_by_hand():
    link = LinkSpec(latency_s=1e-5, bandwidth=1e9)
    # 4 ranks: 2 (N - 1) = 6 latencies and 2 (N - 1) / N = 1.5 payloads through each link
    assert ring_all_reduce_time(1e6, 4, link) == pytest.approx(6e-5 + 1.5e-3)
    assert ring_all_reduce_time(1e6, 1, link) == 0.0
    with pytest.raises(ValueError):
        LinkSpec(latency_s=0.0, bandwidth=0.0)


def test_tensor_parallel_step_pays_its_all_reduces():
    model, h100 = load_model_config("Llama-3-8B"), load_hardware("H100-SXM")
    one = RooflineCostModel(model, h100, "bfloat16")
    two = RooflineCostModel(model, h100, "bfloat16", tensor_parallel_size=2)
    batch = BatchShape(num_decode_tokens=32, num_context_tokens=32 * 512, num_seqs=32,
                       num_attention_pairs=32 * 512)
    assert one.all_reduce_time(batch) == 0.0
    link = h100.link("tp_link")
    # by hand: 2 x 32 layers + 1 all-reduces of 32 tokens x 4096 bf16, plus the logits gather
    payload = 32 * 4096 * 2
    expected = 65 * (2 * link.latency_s + payload / link.bandwidth)
    expected += link.latency_s + 32 * 128256 * 4 / 2 / link.bandwidth
    assert two.all_reduce_time(batch) == pytest.approx(expected)
    assert two.step_time(batch) == pytest.approx(
        two.compute_time(batch) + two.swap_time(batch) + expected)
    # each rank streams half the weights and holds half the KV heads (8 -> 4)
    assert two.compute_time(batch) < one.compute_time(batch)
    assert two.geometry.num_kv_heads == 4 and one.geometry.num_kv_heads == 8
    # a multiple of the KV heads replicates one per rank, as the engine shards them
    assert RooflineCostModel(model, h100, "bfloat16", 16).geometry.num_kv_heads == 1


def test_tensor_parallel_size_flag_reaches_the_cost_model_and_the_pool():
    args = _parse(*ROOFLINE, "--model-config", "Llama-3-8B", "-tp", "2")
    cost = make_cost_model(args)
    assert cost.tp is not None and cost.tp.world_size == 2
    config, num_gpu, _ = engine_setup(args, cost)
    assert config.parallel.tensor_parallel_size == 2
    # --kv-cache-space is per rank and a rank holds half the KV heads: twice the blocks
    assert num_gpu == 2 * (10 * 2**30 // (16 * 131072))
    with pytest.raises(ValueError, match="num_attention_heads"):
        make_cost_model(_parse(*ROOFLINE, "-tp", "3"))


def test_profiled_model_refuses_tensor_parallelism(tmp_path):
    import json

    from tests.simulator.test_cost_models import _profile

    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile([0.01, 0, 0, 0, 0, 0])))
    with pytest.raises(ValueError, match="roofline"):
        make_cost_model(_parse("--profile", str(path), "-tp", "2"))


def test_tp_slows_the_simulated_decode_by_the_all_reduces():
    """The same run with TP=2 over a slow link: every token waits for the collectives."""
    model, cpu = load_model_config("Llama-3-8B"), load_hardware("cpu-zen4-2core")
    fast = RooflineCostModel(model, cpu, "bfloat16", 2)
    slow = RooflineCostModel(model, cpu, "bfloat16", 2)
    slow.tp = TensorParallelCost.for_model(2, 32, 4096, 128256, 2, LinkSpec(1e-2, 1e9))
    config = EngineArgs(max_model_len=512).create_engine_config(512)
    reqs = [SimRequest(list(range(1, 65)), 8, 0.0)]
    tpot = {}
    for name, cost in (("fast", fast), ("slow", slow)):
        (r,) = request_results(Simulator(config, cost, 64, 0).run(reqs))
        tpot[name] = r.tpot
    # 65 all-reduces of 2 ring steps at 10 ms more each, plus the gather's latency
    assert tpot["slow"] - tpot["fast"] > 65 * 2 * (1e-2 - 471e-6)


def test_kv_transfer_time_is_latency_plus_bytes_over_the_link():
    cost = make_cost_model(_parse(*ROOFLINE, "--model-config", "Llama-3-8B"))
    link = load_hardware("H100-SXM").link("kv_link")
    # 512 tokens of Llama-3-8B bf16 KV: 128 KiB a token
    assert cost.kv_transfer_time(512) == pytest.approx(link.latency_s + 512 * 131072 /
                                                       link.bandwidth)
    assert cost.kv_transfer_time(512) > cost.kv_transfer_time(16) > 0


def test_geometric_acceptance_mean_and_bounds():
    # README's A1 workload: 60.9% of 4 drafts accepted and 3.44 tokens per verification step
    model = GeometricAcceptance(0.609, 4, seed=1)
    assert model.alpha == pytest.approx(0.81, abs=0.01)
    assert model.mean_tokens_returned(4) == pytest.approx(3.44, abs=0.01)
    draws = [model.num_tokens_returned("r", 4) for _ in range(20000)]
    assert min(draws) == 1 and max(draws) == 5
    assert sum(draws) / len(draws) == pytest.approx(3.44, rel=0.02)
    assert GeometricAcceptance(0.0, 4).num_tokens_returned("r", 4) == 1
    assert GeometricAcceptance(1.0, 4).num_tokens_returned("r", 4) == 5
    half = GeometricAcceptance(0.5, 4, proposal_rate=0.25, seed=2)
    assert sum(half.proposes("r") for _ in range(4000)) == pytest.approx(1000, rel=0.1)
    with pytest.raises(ValueError, match="--spec-acceptance-rate"):
        GeometricAcceptance(1.5, 4)
    with pytest.raises(ValueError, match="--spec-proposal-rate"):
        GeometricAcceptance(0.5, 4, proposal_rate=0.0)


def _spec_run(rate: float | None, k: int = 4, proposal: float = 1.0, **extra):
    spec = {"method": "ngram", "num_speculative_tokens": k, **extra} if rate is not None else None
    config = EngineArgs(max_model_len=512, block_size=4,
                        speculative_config=spec).create_engine_config(512)
    acceptance = GeometricAcceptance(rate, k, proposal) if rate is not None else None
    cost = FixedCost(per_step=0.01, per_token=0.001)
    sim = Simulator(config, cost, 512, 0, acceptance=acceptance)
    reqs = [SimRequest([100 * j + i + 1 for i in range(20)], 40, 0.0) for j in range(4)]
    return sim.run(reqs), cost


def test_speculation_advances_by_the_accepted_drafts():
    base, _ = _spec_run(None)
    spec, cost = _spec_run(0.6)
    assert all(r.output_tokens == 40 for r in request_results(spec))  # lengths unchanged
    c = spec.counters
    assert c["spec_decode_num_draft_tokens"] > 0
    accepted = c["spec_decode_num_accepted_tokens"] / c["spec_decode_num_draft_tokens"]
    assert accepted == pytest.approx(0.6, abs=0.1)  # the server's ratio comes back
    assert spec.num_steps < base.num_steps * 0.5  # ~3.4 tokens per verification step
    fewer, _ = _spec_run(0.6, proposal=0.3)  # prompt lookup finds drafts on 30% of steps
    assert spec.num_steps < fewer.num_steps < base.num_steps
    # a verification step runs 1 + k tokens per request: the cost model sees them
    assert max(b.num_prefill_tokens for b in cost.batches) >= 4 * 5
    none, _ = _spec_run(0.0)  # nothing accepted: one token per step, as without drafts
    assert none.num_steps == base.num_steps
    assert none.counters["spec_decode_num_accepted_tokens"] == 0


def test_disable_by_batch_size_stops_drafting():
    off, _ = _spec_run(0.8, disable_by_batch_size=2)  # 4 requests run together: no drafts
    assert off.counters["spec_decode_num_draft_tokens"] == 0


def test_speculative_flags_are_checked():
    def accept(*flags):
        args = _parse(*ROOFLINE, *flags)
        return acceptance_model(args, engine_setup(args, make_cost_model(args))[0])

    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert accept("--speculative-config", spec, "--spec-acceptance-rate", "0.5").acceptance == 0.5
    assert accept() is None
    with pytest.raises(ValueError, match="--spec-acceptance-rate"):
        accept("--speculative-config", spec)
    with pytest.raises(ValueError, match="--speculative-config"):
        accept("--spec-acceptance-rate", "0.5")


def test_request_latency_delays_the_engine_arrival():
    config = EngineArgs(max_model_len=512, block_size=4).create_engine_config(512)
    cost = FixedCost(per_step=0.01)
    cost.request_latency_s = 0.2
    outcome = Simulator(config, cost, 256, 0).run([SimRequest([1, 2, 3], 3, 1.0)])
    (r,) = request_results(outcome)
    assert outcome.records[0].sent == 1.0
    assert r.ttft == pytest.approx(0.2 + 0.01)  # the client waits the latency, then a step
    assert outcome.records[0].first_scheduled == pytest.approx(1.2)


def test_server_histogram_means_and_the_latency_outside_the_engine():
    from tessera.simulator.serving import parse_histogram_means, request_latency

    text = "\n".join([
        "# HELP tessera:time_to_first_token_seconds Time from arrival to the first output token.",
        'tessera:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 2.0',
        'tessera:time_to_first_token_seconds_sum{model_name="m"} 1.2',
        'tessera:time_to_first_token_seconds_count{model_name="m"} 4.0',
        'tessera:request_queue_time_seconds_sum{model_name="m"} 0.4',
        'tessera:request_queue_time_seconds_count{model_name="m"} 4.0',
        'tessera:num_preemptions_total{model_name="m"} 3.0',
    ])
    means = parse_histogram_means(text)
    assert means == pytest.approx({"mean_ttft_ms": 300.0, "mean_queue_ms": 100.0})
    assert request_latency({"mean_ttft_ms": 340.0, "server": means}) == pytest.approx(0.04)
    with pytest.raises(ValueError, match="time_to_first_token"):
        request_latency({"mean_ttft_ms": 340.0, "server": {}})


def test_median_run_takes_the_median_of_every_figure():
    from tessera.simulator.serving import median_run

    runs = [{"mean_tpot_ms": t, "failed": f, "num_preemptions": p, "server": {"mean_ttft_ms": s},
             "label": "x"} for t, f, p, s in ((30.0, 0, 1, 200.0), (20.0, 1, None, 100.0),
                                              (25.0, 0, 3, 400.0))]
    m = median_run(runs)
    assert m["mean_tpot_ms"] == 25.0 and m["server"] == {"mean_ttft_ms": 200.0}
    assert m["failed"] == 1 and m["num_preemptions"] is None and m["label"] == "x"
