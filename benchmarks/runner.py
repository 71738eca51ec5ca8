"""Model-runner speed against HF transformers' own forward pass (DynamicCache), same weights, same
run.

Prints prefill tok/s for 1x512 tokens, decode tok/s at batch 1/16/64 with 256-token contexts, and
achieved GFLOP/s against a matmul peak measured here. Ratios are what carry across machines.

    python benchmarks/runner.py [--dtype bfloat16] [--batches 1,16,64] [--skip-hf]
    python benchmarks/runner.py --profile 8,16,32,64 [--dtype bfloat16]   # where engine decode
    steps go
    python benchmarks/runner.py --quantization none   # dequantized weights (default: auto)
    python benchmarks/runner.py --compare-quantization   # GGUF-quantized vs bf16 vs fp32, one run

`--compare-quantization` runs the same workloads on the default model with its Q4_1/Q8_0 weights
kept quantized (fp32 and bf16 activations) and dequantized to bf16 and fp32, and prints tok/s,
the weight bytes each token streams (all linear weights once per step, divided by the batch) and
the GB/s of weights that reaches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from tessera.config import QUANTIZATION_CHOICES, default_num_threads
from tessera.model.default_model import resolve_model_path
from tessera.model.gguf_quant import QuantizedTensor
from tessera.model.llama import LlamaForCausalLM
from tessera.model.loader import load_model, weight_quantization
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
from tessera.worker.model_runner import ModelRunner
from tessera.worker.static_batch import StaticBatch


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def linear_flops_per_token(cfg) -> float:
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * cfg.intermediate_size
    return 2.0 * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h)


def attn_flops(cfg, num_queries: int, context: float) -> float:
    return (
        4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * num_queries * context
    )


class Ours:
    def __init__(self, cfg, weights, dtype, block_size=16, num_blocks=1300):
        self.model = LlamaForCausalLM(cfg, weights, dtype, torch.device("cpu"), 2048)
        self.weight_bytes = self.model.weight_bytes()
        spec = KVCacheSpec(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, dtype
        )
        self.cache = CacheEngine(spec, num_blocks, 0, torch.device("cpu"))
        self.runner = ModelRunner(self.model, self.cache, block_size, torch.device("cpu"))
        self.block_size = block_size

    def prefill(self, prompts, max_new_tokens=64):
        self.batch = StaticBatch(self.runner, self.block_size)  # fresh blocks and request ids
        max_len = max(len(p) for p in prompts) + max_new_tokens
        self.seqs = [self.batch.new_seq(p, max_len) for p in prompts]
        return self.batch.logits(self.seqs).argmax(-1)

    def decode(self, tokens):
        self.batch.advance(self.seqs, tokens.tolist())
        return self.batch.logits(self.seqs).argmax(-1)


class HF:
    def __init__(self, cfg, weights, dtype):
        hf_cfg = LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            tie_word_embeddings=cfg.tie_word_embeddings,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        self.model = HFLlama(hf_cfg).eval()
        self.model.load_state_dict(weights, strict=False)
        self.model.to(dtype)

    def prefill(self, prompts):
        self.cache = DynamicCache()
        out = self.model(torch.tensor(prompts), past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1].argmax(-1)

    def decode(self, tokens):
        out = self.model(tokens.view(-1, 1), past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1].argmax(-1)


def timed(fn, *args) -> tuple[float, object]:
    t = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t, result


@torch.inference_mode()
def run(engine, cfg, batches, ctx, steps, prefill_len):
    torch.manual_seed(0)
    res = {}
    prompt = [torch.randint(100, 49000, (prefill_len,)).tolist()]
    engine.prefill(prompt)  # warm-up
    dt, _ = timed(engine.prefill, prompt)
    res["prefill"] = (
        prefill_len / dt,
        (linear_flops_per_token(cfg) * prefill_len + attn_flops(cfg, prefill_len, prefill_len / 2))
        / dt
        / 1e9,
    )
    for b in batches:
        prompts = [torch.randint(100, 49000, (ctx,)).tolist() for _ in range(b)]
        tok = engine.prefill(prompts)
        tok = engine.decode(tok)  # warm-up
        t = time.perf_counter()
        for _ in range(steps):
            tok = engine.decode(tok)
        dt = time.perf_counter() - t
        flops = steps * b * (linear_flops_per_token(cfg) + attn_flops(cfg, 1, ctx + steps / 2))
        res[f"decode@{b}"] = (steps * b / dt, flops / dt / 1e9)
    return res


COMPARED = [("gguf", "float32"), ("gguf", "bfloat16"), ("none", "bfloat16"), ("none", "float32")]


def compare_quantization(batches, ctx, steps, prefill_len, rounds: int = 3) -> None:
    """Quantized against dequantized weights, every workload, one process. All four models are
    loaded first and run in turn, `rounds` times: on a noisy machine a slow phase then hits every
    model of a round, and each cell is the median over rounds (the ratio column: the median of
    the per-round ratios)."""
    path = resolve_model_path(None)
    engines = {}
    for quantization, dtype in COMPARED:
        cfg, weights = load_model(path, quantization)
        engines[f"{'q' if quantization == 'gguf' else 'dense'}/{dtype}"] = Ours(
            cfg, weights, getattr(torch, dtype)
        )
        del weights
    for name, ours in engines.items():
        mb = ours.weight_bytes
        print(
            f"{name}: linear weights {mb['linear'] / 1e6:.1f} MB, separate embedding "
            f"{mb['embedding'] / 1e6:.1f} MB",
            flush=True,
        )
    per_round: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, ours in engines.items():
            per_round[name].append(run(ours, cfg, batches, ctx, steps, prefill_len))
    rows = {
        name: {
            k: (statistics.median(r[k][0] for r in res), engines[name].weight_bytes["linear"])
            for k in res[0]
        }
        for name, res in per_round.items()
    }
    ratios = {
        name: {
            k: statistics.median(
                r[k][0] / b[k][0] for r, b in zip(res, per_round["dense/bfloat16"], strict=True)
            )
            for k in res[0]
        }
        for name, res in per_round.items()
    }
    base = "dense/bfloat16"
    print(f"{'workload':<12}{'weights':<16}{'tok/s':>9}{'MB/token':>10}{'GB/s':>7}{'vs bf16':>9}")
    for key in rows[base]:
        per_step = prefill_len if key == "prefill" else int(key.split("@")[1])
        for name, res in rows.items():
            tps, wbytes = res[key]
            print(f"{key:<12}{name:<16}{tps:>9.1f}{wbytes / per_step / 1e6:>10.2f}"
                  f"{tps / per_step * wbytes / 1e9:>7.1f}{ratios[name][key]:>8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES)
    ap.add_argument("--compare-quantization", action="store_true")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="with --compare-quantization: rounds of all four models in turn",
    )
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--profile",
        metavar="BATCHES",
        help="only profile whole engine decode steps at these batches (e.g. 8,16,32,64): "
        "ms and %% per part (benchmarks/step_profile.py)",
    )
    ap.add_argument("--model", help="with --profile: a GGUF file or model folder in place of the "
                    "default model (e.g. benchmarks/large_model.py's 1B files)")
    ap.add_argument("--cpu-time", action="store_true", help="with --profile: one thread, every "
                    "part in the thread's CPU time (robust to other jobs on shared cores)")
    ap.add_argument("--speculative-config", help="with --profile: the engine's speculative "
                    "config (JSON), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    args = ap.parse_args()
    torch.set_num_threads(default_num_threads())
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    if args.compare_quantization:
        compare_quantization(batches, args.ctx, args.steps, args.prefill_len, args.rounds)
        return
    if args.profile:
        from step_profile import main_profile  # benchmarks/step_profile.py

        spec = json.loads(args.speculative_config) if args.speculative_config else None
        main_profile([int(b) for b in args.profile.split(",")], args.dtype, args.quantization,
                     args.ctx, args.steps, spec, cpu_time=args.cpu_time, model=args.model)
        return
    path = resolve_model_path(None)
    cfg, weights = load_model(path, weight_quantization(args.quantization, args.dtype, "cpu", path))
    peak = matmul_peak(dtype)
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} matmul peak {peak:.0f} GFLOP/s")
    results = {
        "tessera": run(
            Ours(cfg, weights, dtype), cfg, batches, args.ctx, args.steps, args.prefill_len
        )
    }
    if not args.skip_hf:
        dense = {
            k: v.dequantize() if isinstance(v, QuantizedTensor) else v for k, v in weights.items()
        }
        results["hf"] = run(
            HF(cfg, dense, dtype), cfg, batches, args.ctx, args.steps, args.prefill_len
        )
    print(
        f"{'workload':<14}{'tessera tok/s':>14}{'GFLOP/s':>9}{'% peak':>8}"
        + (f"{'HF tok/s':>10}{'ratio':>8}" if "hf" in results else "")
    )
    for key, (tps, gf) in results["tessera"].items():
        line = f"{key:<14}{tps:>14.1f}{gf:>9.1f}{100 * gf / peak:>7.0f}%"
        if "hf" in results:
            hf_tps = results["hf"][key][0]
            line += f"{hf_tps:>10.1f}{tps / hf_tps:>7.2f}x"
        print(line)


if __name__ == "__main__":
    main()
