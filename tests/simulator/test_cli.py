"""`tessera simulate` and `tessera simulate calibrate` from the command line: flags reach the
scheduler, a tiny run writes bench serve's JSON and the figures, a sweep, and a calibration on a
tiny random model whose profile then drives a simulation."""

from __future__ import annotations

import json

import pytest

from tessera.config import PreemptionMode
from tessera.entrypoints.cli import build_parser, main
from tessera.simulator.cli import engine_setup, make_cost_model, setting_args
from tessera.simulator.simulator import Simulator
from tests.simulator.sim_fakes import step_log_lines

ROOFLINE = ["--dtype", "bfloat16", "--kv-cache-space", "10"]
TINY_RANDOM = ["--dataset", "random", "--num-prompts", "12", "--random-input-len", "48",
               "--random-output-len", "6"]


def _parse(*flags: str):
    return build_parser().parse_args(["simulate", *flags])


def test_engine_flags_reach_the_scheduler():
    args = _parse(*ROOFLINE, "--block-size", "32", "--max-num-batched-tokens", "96",
                  "--max-num-seqs", "5", "--enable-chunked-prefill", "--enable-prefix-caching",
                  "--preemption-mode", "recompute", "--swap-space", "2",
                  "--num-gpu-blocks-override", "300", "--max-model-len", "1024",
                  "--scheduling-policy", "priority")
    cost = make_cost_model(args)
    config, num_gpu, num_cpu = engine_setup(args, cost)
    sim = Simulator(config, cost, num_gpu, num_cpu)
    s, bm = sim.scheduler.config, sim.scheduler.block_manager
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.max_model_len) == (96, 5, 1024)
    assert s.enable_chunked_prefill and s.preemption_mode is PreemptionMode.RECOMPUTE
    assert s.scheduling_policy.value == "priority"
    assert bm.block_size == 32 and bm.enable_prefix_caching and bm.num_gpu_blocks == 300
    # 2 GiB of swap in Llama-3-8B bf16 blocks of 32 tokens (128 KiB a token)
    assert bm.num_cpu_blocks == 2 * 2**30 // (32 * 131072)


def test_kv_cache_space_sizes_the_pool_like_the_server():
    args = _parse(*ROOFLINE)
    _, num_gpu, _ = engine_setup(args, make_cost_model(args))
    assert num_gpu == 10 * 2**30 // (16 * 131072)


def test_bad_flags_name_themselves():
    with pytest.raises(ValueError, match="--profile"):
        make_cost_model(_parse("--cost-model", "profiled"))
    with pytest.raises(ValueError, match="--kv-cache-space"):
        args = _parse("--dtype", "bfloat16", "--kv-cache-space", "200")
        engine_setup(args, make_cost_model(args))
    with pytest.raises(ValueError, match="--settings"):
        setting_args(_parse(*ROOFLINE), "--no-such-flag 3")
    with pytest.raises(SystemExit):
        main(["simulate", "--hardware", "TPU-v9"])


def test_setting_flags_overlay_the_command():
    args = _parse(*ROOFLINE, "--max-num-seqs", "7")
    overlaid = setting_args(args, " --no-enable-chunked-prefill --max-num-batched-tokens 512")
    assert not overlaid.enable_chunked_prefill and overlaid.max_num_batched_tokens == 512
    assert overlaid.max_num_seqs == 7 and overlaid.kv_cache_space == 10
    assert args.enable_chunked_prefill  # the command's own flags untouched (on by default)


def test_simulate_writes_bench_json_and_figures(tmp_path, capsys):
    result, timeline, cdf = (tmp_path / "sim.json", tmp_path / "tl.png", tmp_path / "cdf.png")
    assert main(["simulate", *ROOFLINE, *TINY_RANDOM, "--request-rate", "20",
                 "--goodput", "ttft:50", "--result-file", str(result),
                 "--timeline-file", str(timeline), "--plot-file", str(cdf)]) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    data = json.loads(result.read_text())
    assert set(data) >= {"config", "metrics", "requests", "timeline"}
    m = data["metrics"]
    assert m["completed"] == 12 and m["total_output_tokens"] == 12 * 6
    assert m["request_goodput"] is not None and m["median_tpot_ms"] > 0
    assert data["config"]["hardware"] == "H100-SXM"
    assert timeline.stat().st_size > 0 and cdf.stat().st_size > 0


def test_sweep_over_rates_and_a_flag(tmp_path, capsys):
    result, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert main(["simulate", *ROOFLINE, *TINY_RANDOM, "--sweep", "--request-rates", "5", "inf",
                 "--settings", "", " --enable-chunked-prefill --max-num-batched-tokens 16",
                 "--result-file", str(result), "--plot-file", str(plot)]) == 0
    data = json.loads(result.read_text())
    assert [(p["setting"], p["request_rate"]) for p in data["points"]] == [
        ("default", 5.0), ("default", "inf"),
        ("--enable-chunked-prefill --max-num-batched-tokens 16", 5.0),
        ("--enable-chunked-prefill --max-num-batched-tokens 16", "inf")]
    chunked = data["points"][3]["config"]["engine"]
    assert chunked["enable_chunked_prefill"] and chunked["max_num_batched_tokens"] == 16
    # 48-token prompts in 16-token chunks take more steps than whole prefills
    assert data["points"][3]["metrics"]["num_steps"] > data["points"][1]["metrics"]["num_steps"]
    assert plot.stat().st_size > 0


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def test_calibrate_a_tiny_model_then_simulate_with_its_profile(tiny_llama, tmp_path, capsys):
    profile = tmp_path / "profile.json"
    assert main(["simulate", "calibrate", "--model", tiny_llama, "--grid", "tiny",
                 "--repeats", "1", "--num-gpu-blocks-override", "64", "--swap-space", "0.01",
                 "--output", str(profile)]) == 0
    data = json.loads(profile.read_text())
    assert len(data["grid"]) == 12 and data["dtype"] == "float32"
    assert all(c >= 0 for c in data["coefficients"].values())
    assert "shared_context_token" in data["coefficients"]  # the grid has shared prefixes
    assert any(p["batch"]["num_shared_context_tokens"] for p in data["grid"])
    assert data["kv_geometry"] == {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
                                   "elem_size": 4}
    assert data["swap_s_per_byte"] > 0 and data["fit"]["method"].startswith("non-negative")
    assert all(p["seconds"] > 0 for p in data["grid"])
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(profile), *TINY_RANDOM,
                 "--result-file", str(out), "--quiet"]) == 0
    sim = json.loads(out.read_text())
    assert sim["config"]["cost_model"] == "profiled" and sim["metrics"]["completed"] == 12
    assert sim["config"]["engine"]["max_model_len"] == 512  # the profiled model's own limit
    with pytest.raises(SystemExit):  # a profile is for the dtype it was measured in
        main(["simulate", "--profile", str(profile), "--dtype", "bfloat16", *TINY_RANDOM])


def test_calibration_times_every_shape_in_every_pass(tiny_llama, tmp_path, monkeypatch):
    """--rounds passes over the grid; a shape's time is the median of its steps in all of
    them (here pass i times every step at i x 10 ms: the median of 10, 20, 30 is 20)."""
    from tessera.simulator import calibrate as cal

    timed = cal._Driver.time_shape
    passes: dict = {}

    def fake(self, shape, repeats):
        batch, _ = timed(self, shape, repeats)
        passes[shape] = passes.get(shape, 0) + 1
        return batch, [0.01 * passes[shape]] * repeats

    monkeypatch.setattr(cal._Driver, "time_shape", fake)
    profile = tmp_path / "profile.json"
    assert main(["simulate", "calibrate", "--model", tiny_llama, "--grid", "tiny",
                 "--repeats", "2", "--rounds", "3", "--num-gpu-blocks-override", "64",
                 "--swap-space", "0.01", "--output", str(profile)]) == 0
    data = json.loads(profile.read_text())
    assert set(passes.values()) == {3} and data["fit"]["rounds"] == 3
    assert [p["seconds"] for p in data["grid"]] == pytest.approx([0.02] * len(data["grid"]))
    with pytest.raises(SystemExit):
        main(["simulate", "calibrate", "--model", tiny_llama, "--rounds", "0"])


def test_serving_runs_alternate_with_grid_passes(tiny_llama, tmp_path, monkeypatch):
    """With --serving-requests, a real-server run of the calibration trace follows each pass
    over the grid, each with its own step log; the latency outside the engine comes from the
    median run and the serving rates from every logged step (here a stand-in for the server,
    since a real one is the fidelity benchmark's job)."""
    from tessera.simulator import calibrate as cal
    from tessera.simulator import serving

    order: list[str] = []
    timed = cal._Driver.time_shape
    ttfts = iter([500.0, 50.0, 60.0])  # one slow run: the median ignores it

    def shape_timed(self, shape, repeats):
        if not order or order[-1] != "grid":
            order.append("grid")
        return timed(self, shape, repeats)

    def server_run(flags, samples, rate, seed, log_dir=None, label="server", step_log=None):
        order.append("serve")
        with open(step_log, "w") as f:  # two decode steps of 20 ms, the second before idle
            f.write("\n".join(step_log_lines([([[1, 9]], 0.02), ([[1, 10]], 0.02 / 0.9)])) + "\n")
        ttft = next(ttfts)
        return {"mean_tpot_ms": 20.0, "median_tpot_ms": 20.0, "mean_ttft_ms": ttft,
                "median_ttft_ms": ttft, "mean_e2el_ms": 500.0, "output_throughput": 10.0,
                "server": {"mean_ttft_ms": 40.0}}

    fitted_steps = []  # the fit itself is test_cost_models'; here only what it is given
    monkeypatch.setattr(cal._Driver, "time_shape", shape_timed)
    monkeypatch.setattr(serving, "real_server_metrics", server_run)
    monkeypatch.setattr(serving, "fit_serving_rates", lambda profile, steps: (
        fitted_steps.extend(steps) or {"serving_s_per_step": 0.002, "serving_s_per_seq": 0.001,
                                       "serving_s_per_prefill_token": 0.0}, {}))
    profile = tmp_path / "profile.json"
    assert main(["simulate", "calibrate", "--model", tiny_llama, "--grid", "tiny",
                 "--repeats", "1", "--rounds", "2", "--serving-requests", "4",
                 "--serving-runs", "3", "--num-gpu-blocks-override", "64", "--swap-space",
                 "0.01", "--output", str(profile)]) == 0
    assert order == ["grid", "serve", "grid", "serve", "serve"]
    data = json.loads(profile.read_text())
    assert data["serving_fit"]["runs"] == 3 and data["serving_fit"]["logged_steps"] == 6
    assert [round(s.seconds, 6) for s in fitted_steps] == [0.02] * 6
    assert data["serving_fit"]["real"]["mean_ttft_ms"] == pytest.approx(60.0)
    assert data["serving_s_per_step"] == 0.002 and data["serving_s_per_seq"] == 0.001
    assert data["request_latency_s"] == pytest.approx(0.02)  # median of 460, 10 and 20 ms


def test_dtype_auto_is_the_model_configs():
    # the shipped Llama-3-8B config says bfloat16; an explicit --dtype wins
    cost = make_cost_model(_parse("--kv-cache-space", "10"))
    assert cost.dtype == "bfloat16"
    assert engine_setup(_parse("--kv-cache-space", "10"), cost)[0].model.dtype == "bfloat16"
    with pytest.raises(ValueError, match="--dtype float16 has no peak FLOP/s"):  # not the CPU's
        make_cost_model(_parse("--dtype", "half", "--kv-cache-space", "10"))  # refusal
    shipped = make_cost_model(_parse("--dtype", "float32", "--kv-cache-space", "10"))
    assert shipped.dtype == "float32"


def test_gemma3_prices_kv_blocks_by_group_and_holds_more_long_requests():
    """Gemma 3 1B mixes 4 global and 22 local layers: 13 KV cache groups of 2 layers, so the same
    memory is 13 times as many (smaller) blocks, the override counts blocks of every layer, and
    long requests decode more at once than with one full-length table per layer."""
    from tessera.simulator.simulator import SimRequest

    flags = ["--model-config", "Gemma-3-1B", "--dtype", "bfloat16", "--kv-cache-space", "0.05",
             "--max-model-len", "4096", "--no-enable-chunked-prefill"]
    hybrid_args, plain_args = _parse(*flags), _parse(*flags, "--disable-hybrid-kv-cache-manager")
    cost = make_cost_model(hybrid_args)
    assert cost.layer_windows.count(None) == 4 and cost.sliding_window is None
    config, num_gpu, num_cpu = engine_setup(hybrid_args, cost)
    plain_config, num_plain, _ = engine_setup(plain_args, make_cost_model(plain_args))
    # bf16, 1 KV head of 256: 1 KiB a token per layer; a pool block is 2 layers of 16 tokens
    assert num_gpu == int(0.05 * 2**30) // (16 * 1024 * 2)
    assert num_plain == int(0.05 * 2**30) // (16 * 1024 * 26) and num_gpu >= 13 * num_plain
    _, override, _ = engine_setup(_parse(*flags, "--num-gpu-blocks-override", "300"), cost)
    assert override == 13 * 300

    requests = [SimRequest(list(range(5, 3005)), 200, 0.0) for _ in range(12)]
    peaks = []
    for cfg, n_gpu in ((plain_config, num_plain), (config, num_gpu)):
        sim = Simulator(cfg, cost, n_gpu, num_cpu)
        seen = []
        schedule = sim.scheduler.schedule

        def counting(schedule=schedule, sim=sim, seen=seen):
            out = schedule()
            seen.append(len(sim.scheduler.running))
            return out

        sim.scheduler.schedule = counting
        sim.run(requests, record_timeline=False)
        peaks.append(max(seen))
    assert peaks[1] >= 2 * peaks[0], peaks
