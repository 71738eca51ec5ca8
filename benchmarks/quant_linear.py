"""The quantized linear kernel (Q4_1 blocks) against the dense kernel on the same weights, same run.

30 layers of the default model's four linear shapes, random weights quantized to Q4_1 by gguf; for
each row count, the dense fp32/bf16 kernel on the dequantized weights and the quantized kernel
with each way through a panel forced (registers: dense_min_rows 0; dense panel: 1; bf16 has one
way, the block-sum form, printed in both columns). Prints ms per
pass over the 30 layers and GB/s of weight bytes streamed. This is what DENSE_MIN_ROWS in
tessera/kernels/quant_linear.py is chosen from.

    python benchmarks/quant_linear.py [--rows 1,8,16,32,64,512] [--dtype float32,bfloat16]
    python benchmarks/quant_linear.py --baseline REF [--rounds 9] [--rows 64,512,2048]

`--baseline REF` builds the quantized kernel of REF's sources (a temporary `git worktree`) beside
this tree's and alternates the two in one process on the same packed weights, round by round,
printing each one's min and median ms and the ratio. On a noisy machine this is the A/B to
trust: whole-script runs one after the other drifted by more than a 5% change. The
two builds must agree on the packed layout; the script says so when their outputs differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from tessera.config import default_num_threads
from tessera.kernels import quant_linear as ql
from tessera.kernels.build import load_extension
from tessera.kernels.linear import PackedLinearWeight
from tessera.model.gguf_quant import QuantizedTensor

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
LAYERS = 30
Q4_1 = gguf.GGMLQuantizationType.Q4_1


def seconds(layers, xs, reps: int) -> float:
    def once():
        for layer in layers:
            for lin, x in zip(layer, xs, strict=True):
                lin(x)

    once()
    t = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - t) / reps


def baseline_kernel(tree: str):
    """quant_linear_out of the C++ kernel built from another checkout's sources, loaded beside
    this tree's (its own module name, so both stay importable in one process)."""
    kernels = Path(tree) / "tessera" / "kernels"
    headers = sorted(kernels.glob("*.h"))
    module = load_extension("tessera_quant_linear_baseline", kernels / "quant_linear.cpp", headers)
    if module is None:
        raise SystemExit(f"the baseline's quantized kernel did not build ({kernels})")
    return module.quant_linear_out


def compare_with_baseline(quant, xs_by_rows, baseline, rounds: int, name: str) -> None:
    """Alternate this tree's kernel and the baseline's on the same layers, `rounds` times."""
    ours = quant[0][0]._kernel
    for rows, xs in xs_by_rows.items():
        reps = max(2, 64 // rows)
        times: dict[str, list[float]] = {"new": [], "baseline": []}
        outputs = {}
        for _ in range(rounds):
            for label, kernel in (("new", ours), ("baseline", baseline)):
                for layer in quant:
                    for lin in layer:
                        lin._kernel = kernel
                times[label].append(seconds(quant, xs, reps))
        for label, kernel in (("new", ours), ("baseline", baseline)):
            quant[0][0]._kernel = kernel
            outputs[label] = quant[0][0](xs[0])
        same = torch.equal(outputs["new"], outputs["baseline"])
        new, base = (min(times[k]) for k in ("new", "baseline"))
        med_new, med_base = (statistics.median(times[k]) for k in ("new", "baseline"))
        print(
            f"{name:<10}{rows:>6}{new * 1e3:>10.2f}{med_new * 1e3:>10.2f}{base * 1e3:>14.2f}"
            f"{med_base * 1e3:>10.2f}{new / base:>9.3f}x{med_new / med_base:>9.3f}x"
            f"{'' if same else '  (outputs differ: another packed layout or arithmetic)'}",
            flush=True,
        )
    for layer in quant:
        for lin in layer:
            lin._kernel = ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,32,64,512")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--baseline", metavar="REF", help="alternate with REF's kernel in this process")
    ap.add_argument("--rounds", type=int, default=9, help="with --baseline: rounds of each kernel")
    args = ap.parse_args()
    torch.set_num_threads(default_num_threads())
    if args.baseline:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from peers import baseline_worktree  # benchmarks/peers.py

        with baseline_worktree(args.baseline) as (tree, commit):
            print(f"baseline {args.baseline} = {commit[:10]}; default way of each dtype, ms per "
                  f"pass over {LAYERS} layers, min and median of {args.rounds} alternated rounds")
            run(args, baseline_kernel(tree))
        return
    run(args, None)


def run(args, baseline) -> None:
    rng = np.random.default_rng(0)
    weights = [
        [
            QuantizedTensor(
                Q4_1,
                gguf.quants.quantize((rng.standard_normal(s) * 0.05).astype(np.float32), Q4_1),
                torch.Size(s),
            )
            for s in SHAPES
        ]
        for _ in range(LAYERS)
    ]
    if baseline is not None:
        print(f"{'dtype':<10}{'rows':>6}{'new min':>10}{'median':>10}{'baseline min':>14}"
              f"{'median':>10}{'min':>10}{'median':>10}")
    else:
        print(f"{'dtype':<10}{'rows':>6}{'dense ms':>10}{'GB/s':>7}{'q regs ms':>11}{'GB/s':>7}"
              f"{'q dense-panel ms':>18}{'GB/s':>7}")
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        if not ql.quant_kernel_supported(dtype, torch.device("cpu")):
            print(f"{name}: quantized kernel unavailable here")
            continue
        quant = [
            [
                ql.QuantLinear(
                    [w.pack(pairs=ql.pairs_layout(dtype, torch.device("cpu")))],
                    dtype,
                    torch.device("cpu"),
                )
                for w in layer
            ]
            for layer in weights
        ]
        if baseline is not None:
            xs_by_rows = {rows: [torch.randn(rows, k).to(dtype) for _, k in SHAPES]
                          for rows in (int(r) for r in args.rows.split(","))}
            compare_with_baseline(quant, xs_by_rows, baseline, args.rounds, name)
            continue
        dense = [[PackedLinearWeight(w.dequantize().to(dtype)) for w in layer] for layer in weights]
        q_bytes = sum(lin.weight_bytes for layer in quant for lin in layer)
        d_bytes = sum(
            lin.panels.numel() * lin.panels.element_size() for layer in dense for lin in layer
        )
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k).to(dtype) for _, k in SHAPES]
            reps = max(2, 64 // rows)
            td = seconds(dense, xs, reps)
            times = []
            ways = (0,) if quant[0][0].parts[0].pairs else (0, 1)  # bf16 block-sum: one way
            for min_rows in ways:  # registers always, dense panel always
                for layer in quant:
                    for lin in layer:
                        lin._dense_min_rows = min_rows
                times.append(seconds(quant, xs, reps))
            if len(times) == 1:
                times.append(times[0])
            print(f"{name:<10}{rows:>6}{td * 1e3:>10.2f}{d_bytes / td / 1e9:>7.1f}"
                  f"{times[0] * 1e3:>11.2f}{q_bytes / times[0] / 1e9:>7.1f}"
                  f"{times[1] * 1e3:>18.2f}{q_bytes / times[1] / 1e9:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
