"""Cost models: the roofline's arithmetic against hand-computed numbers, the shipped specs and
configs, the profiled model, the NNLS fit, and the seams."""

from __future__ import annotations

import glob
import os
import tomllib

import numpy as np
import pytest

from tessera.config import GiB
from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.simulator.batch import BatchShape, SyntheticRunner
from tessera.simulator.cost_model import FEATURES, ProfiledCostModel
from tessera.simulator.fit import fit_step_times, nnls
from tessera.simulator.roofline import RooflineCostModel
from tessera.simulator.specs import (
    hardware_names,
    load_hardware,
    load_model_config,
    model_config_names,
)
from tessera.utils import cdiv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_shipped_hardware_and_models():
    assert {"A100-80GB", "H100-SXM", "H200", "L4", "cpu-zen4-2core"} <= set(hardware_names())
    for name in hardware_names():
        hw = load_hardware(name)
        assert hw.source and hw.memory_bandwidth > 0 and hw.flops("bfloat16") > 0
    assert {"Llama-3-8B", "Llama-3-70B", "Qwen2.5-7B"} <= set(model_config_names())
    with pytest.raises(ValueError, match="--hardware"):
        load_hardware("TPU-v9")
    with pytest.raises(ValueError, match="--model-config"):
        load_model_config("no-such-model")


@pytest.mark.parametrize("name,params", [("Llama-3-8B", 8.03e9), ("Llama-3-70B", 70.55e9),
                                         ("Qwen2.5-7B", 7.62e9)])
def test_model_configs_have_the_published_sizes(name, params):
    spec = load_model_config(name)
    assert spec.num_params == pytest.approx(params, rel=0.01)


def test_package_data_is_declared_for_setuptools():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["tessera.simulator"]
    base = os.path.join(REPO, "tessera", "simulator")
    declared = {p for g in globs for p in glob.glob(os.path.join(base, g))}
    shipped = set(glob.glob(os.path.join(base, "data", "**", "*.json"), recursive=True))
    assert shipped and shipped == declared


def test_llama3_8b_kv_and_roofline_by_hand():
    spec = load_model_config("Llama-3-8B")
    assert spec.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2  # 128 KiB
    hw = load_hardware("H100-SXM")
    model = RooflineCostModel(spec, hw, "bfloat16")
    # one decode: memory-bound, the weights (linears + LM head) streamed once
    weights = (32 * spec.linear_params_per_layer + 128256 * 4096) * 2
    decode = BatchShape(num_decode_tokens=1, num_context_tokens=1000, num_seqs=1,
                        num_attention_pairs=1000)
    kv = 1000 * 131072 / (hw.memory_bandwidth * hw.memory_efficiency)
    expected = weights / (hw.memory_bandwidth * hw.memory_efficiency) + kv + hw.step_overhead_s
    assert model.step_time(decode) == pytest.approx(expected)
    # a long prefill: compute-bound
    n = 4096
    prefill = BatchShape(num_prefill_tokens=n, num_context_tokens=n, num_seqs=1,
                         num_attention_pairs=n * (n + 1) // 2)
    peak = hw.peak_flops["bfloat16"] * hw.compute_efficiency
    linear = (n * 2 * 32 * spec.linear_params_per_layer + 2 * 128256 * 4096) / peak
    attention = n * (n + 1) // 2 * 4 * 32 * 32 * 128 / peak
    assert model.step_time(prefill) == pytest.approx(linear + attention + hw.step_overhead_s)


def test_roofline_kv_cache_dtype_sizes_blocks_and_attention_bytes():
    """--kv-cache-dtype bfloat16 beside fp32 compute: half the KV bytes per block and per read."""
    spec, hw = load_model_config("Llama-3-8B"), load_hardware("H100-SXM")
    fp32 = RooflineCostModel(spec, hw, "float32")
    bf16_kv = RooflineCostModel(spec, hw, "float32", kv_cache_dtype="bfloat16")
    assert bf16_kv.geometry.block_bytes(16) * 2 == fp32.geometry.block_bytes(16)
    decode = BatchShape(num_decode_tokens=1, num_context_tokens=4000, num_seqs=1,
                        num_attention_pairs=4000)
    saved = (
        4000 * spec.kv_bytes_per_token("bfloat16") / (hw.memory_bandwidth * hw.memory_efficiency)
    )
    assert fp32.step_time(decode) - bf16_kv.step_time(decode) == pytest.approx(saved)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        RooflineCostModel(spec, hw, "float32", kv_cache_dtype="fp8")


def test_roofline_orders_hardware_and_batches():
    spec = load_model_config("Llama-3-8B")
    models = {h: RooflineCostModel(spec, load_hardware(h), "bfloat16")
              for h in ("L4", "A100-80GB", "H100-SXM", "H200")}
    decode = BatchShape(num_decode_tokens=32, num_context_tokens=32 * 500, num_seqs=32,
                        num_attention_pairs=32 * 500)
    times = [models[h].step_time(decode) for h in ("L4", "A100-80GB", "H100-SXM", "H200")]
    assert times == sorted(times, reverse=True)  # bandwidth order for a decode batch
    small = BatchShape(num_decode_tokens=1, num_context_tokens=10, num_seqs=1,
                       num_attention_pairs=10)
    h100 = models["H100-SXM"]
    assert h100.step_time(decode) < 32 * h100.step_time(small)  # batching amortises weights
    assert h100.swap_time(BatchShape(swap_bytes=10**9)) == pytest.approx(1e9 / 50e9)
    assert h100.all_reduce_time(decode) == 0.0  # one rank: no collectives


def test_roofline_refuses_a_cache_that_does_not_fit():
    model = RooflineCostModel(load_model_config("Llama-3-70B"), load_hardware("H100-SXM"),
                              "bfloat16")
    with pytest.raises(ValueError, match="--kv-cache-space"):
        model.check_fits(10.0)  # 141 GB of weights alone
    RooflineCostModel(load_model_config("Llama-3-8B"), load_hardware("H100-SXM"),
                      "bfloat16").check_fits(50.0)
    assert 16 * GiB < 80 * GiB


def _profile(coefs):
    """A profile with `coefs` for the first features (a profile calibrated before the later ones
    existed lacks them)."""
    return {"coefficients": dict(zip([n for n, _ in FEATURES], coefs, strict=False)),
            "swap_s_per_byte": 1e-10, "dtype": "bfloat16", "max_position_embeddings": 2048,
            "kv_geometry": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "elem_size": 2}}


def test_profiled_model_is_the_fitted_linear_form():
    coefs = [0.01, 1e-3, 2e-4, 1e-6, 5e-5, 1e-8, 3e-7]
    model = ProfiledCostModel(_profile(coefs))
    b = BatchShape(num_prefill_tokens=100, num_decode_tokens=10, num_context_tokens=5000,
                   num_seqs=11, num_attention_pairs=9000, swap_bytes=10**6,
                   num_shared_context_tokens=2000)
    expected = 0.01 + 0.1 + 2e-3 + 3000 * 1e-6 + 11 * 5e-5 + 9e-5 + 2000 * 3e-7 + 1e-4
    assert model.step_time(b) == pytest.approx(expected)
    assert model.step_time(BatchShape()) == 0.0
    assert model.geometry.block_bytes(16) == 16 * 2 * 2 * 1 * 4 * 2
    with pytest.raises(ValueError, match="profile"):
        ProfiledCostModel({"coefficients": {}})


def _decodes_over_a_prefix(shared: bool) -> BatchShape:
    """8 decodes at 576 tokens of context whose first 512 are one shared prefix, or private."""
    return BatchShape(num_decode_tokens=8, num_seqs=8, num_context_tokens=8 * 577,
                      num_attention_pairs=8 * 577,
                      num_shared_context_tokens=7 * 512 if shared else 0)


def test_a_shared_prefix_is_priced_below_as_many_private_tokens():
    # profiled: a shared token at its own rate (below a private one's, as calibrated here)
    model = ProfiledCostModel(_profile([0.015, 2e-4, 1e-4, 1e-6, 3e-4, 7e-7, 2e-7]))
    shared, private = _decodes_over_a_prefix(True), _decodes_over_a_prefix(False)
    assert model.step_time(shared) == pytest.approx(
        model.step_time(private) - 7 * 512 * (1e-6 - 2e-7))
    # roofline: the prefix's KV streams from memory once
    h100 = RooflineCostModel(load_model_config("Llama-3-8B"), load_hardware("H100-SXM"),
                             "bfloat16")
    assert h100.attention_time(shared) < h100.attention_time(private)
    assert h100.attention_time(shared) == pytest.approx(
        h100.attention_time(private) * (8 * 577 - 7 * 512) / (8 * 577))


def test_a_profile_without_the_shared_rate_prices_shared_tokens_as_private_ones():
    """A profile calibrated before the grid had shared prefixes keeps its prices."""
    old = ProfiledCostModel(_profile([0.015, 2e-4, 1e-4, 1e-6, 3e-4, 7e-7]))
    assert "shared_context_token" not in old.profile["coefficients"]
    assert old.step_time(_decodes_over_a_prefix(True)) == pytest.approx(
        old.step_time(_decodes_over_a_prefix(False)))


def test_the_grid_times_decodes_over_a_shared_prefix():
    """The calibration grid's shared-prefix shapes hand every request the same prefix blocks,
    as a prefix hit does, and describe the step with its shared tokens."""
    from tessera.simulator.calibrate import Shape, _Driver, grid_shapes

    class Runner:  # records the messages; the timing itself is not under test here
        def __init__(self):
            self.outs = []

        def execute_model(self, out):
            self.outs.append(out)

    runner = Runner()
    driver = _Driver(runner, block_size=16, vocab_size=100, num_blocks=64)
    # 3 decodes at 40 tokens and an 8-token chunk after 32 cached, all over one 32-token prefix
    batch, times = driver.time_shape(Shape(3, 40, 8, 32, shared_prefix=32), repeats=2)
    assert len(times) == 2
    reqs = runner.outs[0].scheduled_new_reqs
    assert {tuple(r.block_ids[:2]) for r in reqs} == {tuple(reqs[0].block_ids[:2])}
    private = [b for r in reqs for b in r.block_ids[2:]]
    assert len(set(private)) == len(private)
    # two untimed steps first (the requests sent whole, one step of diffs)
    assert len(runner.outs) == 2 + 2 + 1  # and the message that finishes them
    # the last timed step: decodes at 43 + 1 tokens, the chunk at 40; 3 of 4 readers re-read
    assert batch.num_context_tokens == 3 * 44 + 40
    assert batch.num_shared_context_tokens == 3 * 32
    # the shared blocks are counted once when checking that a shape fits the cache
    need = 32 + 8 * (cdiv(576 + 2 + 3, 16) - 32)
    assert _Driver(runner, 16, 100, need).fits(Shape(8, 576, 0, 0, 512), 2)
    assert not _Driver(runner, 16, 100, need - 1).fits(Shape(8, 576, 0, 0, 512), 2)
    for grid in ("tiny", "small", "default"):
        assert any(s.shared_prefix and s.num_decodes > 1 for s in grid_shapes(grid))


def test_nnls_matches_a_known_solution_and_stays_non_negative():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, size=(40, 4))
    truth = np.array([0.5, 0.0, 2.0, 1.0])
    assert nnls(a, a @ truth) == pytest.approx(truth, abs=1e-8)
    # a target that plain least squares fits with a negative coefficient
    b = a @ np.array([1.0, -0.5, 0.2, 0.3])
    assert np.linalg.lstsq(a, b, rcond=None)[0][1] < 0
    x = nnls(a, b)
    assert (x >= 0).all()
    # optimal: no non-negative direction improves it (KKT: the gradient is <= 0 off the support)
    grad = a.T @ (b - a @ x)
    assert np.all(grad[x == 0] <= 1e-9) and np.allclose(grad[x > 0], 0, atol=1e-8)


def test_fit_recovers_step_costs_from_timings():
    truth = np.array([0.012, 8e-4, 3e-4, 2e-7, 1e-4, 4e-9])
    rows = []
    for d in (1, 4, 16, 64):
        for c in (64, 512):
            for p in (0, 64, 128, 512, 1024):  # >= 4 values: p, [p > 0], p^2 independent
                rows.append([1, p, d, d * (c + 1) + p, d + (p > 0), d * (c + 1) + p * (p + 1) / 2])
    times = list(np.asarray(rows) @ truth)
    coefs, fit = fit_step_times(rows, times)
    assert coefs == pytest.approx(truth, rel=1e-6)
    assert fit["relative_rms_error"] < 1e-9


def _new(req_id, prompt_len, computed):
    return NewRequestData(req_id, list(range(prompt_len)), [], SamplingParams(), [0, 1, 2, 3],
                          computed)


def test_synthetic_runner_describes_the_batch_and_samples_like_a_runner():
    runner = SyntheticRunner(block_bytes=100)
    out = SchedulerOutput(scheduled_new_reqs=[_new("a", 10, 9), _new("b", 40, 0),
                                              _new("c", 50, 20)],
                          num_scheduled_tokens={"a": 1, "b": 40, "c": 16},
                          blocks_to_swap_in={5: 6, 7: 8})
    batch, result = runner.execute(out)
    assert batch == BatchShape(num_prefill_tokens=56, num_decode_tokens=1,
                               num_context_tokens=10 + 40 + 36, num_seqs=3, swap_bytes=200,
                               num_attention_pairs=10 + 40 * 41 // 2 + 16 * 20 + 16 * 17 // 2)
    assert result.req_ids == ["a", "b"]  # c's chunk does not reach its length: no sample
    nxt = SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("a", [1], [], False, 10)],
                          num_scheduled_tokens={"a": 1}, finished_req_ids=["b"])
    batch, result = runner.execute(nxt)
    assert batch.num_decode_tokens == 1 and result.req_ids == ["a"]


def test_synthetic_runner_counts_the_blocks_requests_share():
    from tessera.core.context_sharing import BlockTables

    def new(req_id, blocks, prompt_len, computed):
        return NewRequestData(req_id, list(range(prompt_len)), [], SamplingParams(), blocks,
                              computed)

    runner = SyntheticRunner(block_bytes=100, block_tables=BlockTables(block_size=4))
    # b hits a's first two blocks (8 tokens): its chunk starts after them
    out = SchedulerOutput(scheduled_new_reqs=[new("a", [0, 1, 2], 10, 9),
                                              new("b", [0, 1, 3], 12, 8)],
                          num_scheduled_tokens={"a": 1, "b": 4})
    batch, _ = runner.execute(out)
    assert batch.num_context_tokens == 10 + 12 and batch.num_shared_context_tokens == 8
    assert batch.num_distinct_context_tokens == 14
    # without block tables nothing is counted as shared
    alone = SyntheticRunner(block_bytes=100).execute(out)[0]
    assert alone.num_shared_context_tokens == 0 and alone.num_context_tokens == 22


def test_spec_decode_seam_needs_an_acceptance_model():
    out = SchedulerOutput(scheduled_new_reqs=[_new("a", 10, 9)], num_scheduled_tokens={"a": 3},
                          scheduled_spec_decode_tokens={"a": [5, 6]})
    with pytest.raises(ValueError, match="acceptance model"):
        SyntheticRunner(block_bytes=1).execute(out)

    class AcceptOne:
        def num_tokens_returned(self, req_id, num_draft_tokens):
            return 2

    _, result = SyntheticRunner(block_bytes=1, acceptance=AcceptOne()).execute(out)
    assert result.sampled_token_ids == [[1, 1]]


def _write_step_log(path, steps):
    """A step log as the engine writes it (tessera/engine/step_log.py) for (reqs, seconds) steps
    run back to back; the last one leaves the engine idle."""
    from tests.simulator.sim_fakes import step_log_lines

    path.write_text("\n".join(step_log_lines(steps)) + "\n")


def test_step_log_intervals_run_start_to_start_while_busy(tmp_path):
    from tessera.simulator.step_fit import read_step_log

    log = tmp_path / "steps.jsonl"
    _write_step_log(log, [([[8, 0]], 0.2), ([[1, 8], [5, 0]], 0.1), ([[1, 9]], 0.05)])
    steps = read_step_log(str(log), block_bytes=64)
    assert [round(s.seconds, 6) for s in steps] == [0.2, 0.1, 0.045]  # the idle one: to its end
    assert steps[1].batch == BatchShape(num_prefill_tokens=5, num_decode_tokens=1,
                                        num_context_tokens=14, num_seqs=2,
                                        num_attention_pairs=9 + 15)


def test_step_log_shared_context_tokens_are_read_and_old_logs_read_as_none(tmp_path):
    import json

    from tessera.simulator.step_fit import read_step_log
    from tests.simulator.sim_fakes import step_log_lines

    lines = step_log_lines([([[1, 40], [1, 40]], 0.02), ([[1, 41], [1, 41]], 0.02)])
    old = tmp_path / "old.jsonl"  # written before the log carried the count
    old.write_text("\n".join(lines) + "\n")
    assert [s.batch.num_shared_context_tokens for s in read_step_log(str(old))] == [0, 0]
    records = [json.loads(line) for line in lines]
    records[2]["num_shared_context_tokens"] = 32
    new = tmp_path / "new.jsonl"
    new.write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = read_step_log(str(new))
    assert [s.batch.num_shared_context_tokens for s in steps] == [0, 32]
    assert steps[1].batch.num_distinct_context_tokens == 2 * 42 - 32


def test_serving_rates_are_fitted_to_the_logged_steps(tmp_path):
    """Steps that took the runner's time plus 3 ms a step and 0.5 ms a sequence give back those
    rates; the per-prefill-token rate the steps do not show stays at 0."""
    from tessera.simulator.step_fit import fit_serving_rates, read_step_log

    profile = _profile([0.01, 1e-4, 2e-4, 0.0, 0.0, 0.0])
    runner = ProfiledCostModel(profile)
    shapes = [[[1, 50]] * d + ([[p, 0]] if p else []) for d in (1, 4, 16) for p in (0, 0, 128)]
    steps = []
    for reqs in shapes:
        batch = BatchShape(num_prefill_tokens=sum(n for n, c in reqs if c == 0),
                           num_decode_tokens=sum(1 for n, c in reqs if c), num_seqs=len(reqs))
        steps.append((reqs, runner.step_time(batch) + 0.003 + 0.0005 * len(reqs)))
    log = tmp_path / "steps.jsonl"
    _write_step_log(log, steps + [([[1, 50]], 1.0)])  # the idle last step: its own end, 0.9 s
    terms, by_kind = fit_serving_rates(profile, read_step_log(str(log), block_bytes=64)[:-1])
    assert terms["serving_s_per_step"] == pytest.approx(0.003, rel=1e-6)
    assert terms["serving_s_per_seq"] == pytest.approx(0.0005, rel=1e-6)
    assert terms["serving_s_per_prefill_token"] == pytest.approx(0.0, abs=1e-12)
    assert set(by_kind) == {"decode-only", "mixed"}
    for kind in by_kind.values():
        assert kind["fitted_ms"] == pytest.approx(kind["real_ms"], abs=0.01)
        assert kind["runner_ms"] < kind["real_ms"]
    model = ProfiledCostModel({**profile, **terms})
    assert model.step_time(BatchShape(num_decode_tokens=2, num_seqs=2)) == pytest.approx(
        runner.step_time(BatchShape(num_decode_tokens=2, num_seqs=2)) + 0.004)
    with pytest.raises(ValueError, match="at least"):
        fit_serving_rates(profile, [])

    # a refit of the fitted profile (the fidelity benchmark's, after its rounds) must not count
    # the old rates as runner time: stripped, it gives back the same rates, not ~0
    from tessera.simulator.serving import runner_only

    fitted = {**profile, **terms, "request_latency_s": 0.01, "serving_fit": {"runs": 3}}
    assert runner_only(fitted) == profile
    again, _ = fit_serving_rates(runner_only(fitted), read_step_log(str(log), block_bytes=64)[:-1])
    assert again == pytest.approx(terms, rel=1e-6)


def test_engine_flags_round_trip_through_the_cli():
    from tessera.config import EngineArgs
    from tessera.entrypoints.cli import build_parser, engine_args_from
    from tessera.simulator.serving import engine_flags

    args = EngineArgs(dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=256,
                      num_gpu_blocks_override=160, preemption_mode="recompute")
    flags = engine_flags(args)  # chunked prefill is on by default: no flag for it
    assert "--no-enable-prefix-caching" in flags and "--model" not in flags
    assert not any("chunked" in f for f in flags)
    parsed = engine_args_from(build_parser().parse_args(["serve", *flags]))
    assert parsed == args
