"""The linear C++ kernel against oneDNN's prepacked linear, same weights, same run.

30 layers of the default model's four linear shapes (fresh weights per layer, so they stream from
memory as in a real step), at several row counts, fp32 and bf16. Prints time, weight bandwidth,
GFLOP/s and the kernel/oneDNN time ratio.

    python benchmarks/linear.py [--rows 1,16,64,256,2048] [--dtype float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from tessera.config import default_num_threads
from tessera.kernels.linear import PackedLinearWeight, linear_kernel_supported

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
LAYERS = 30


def seconds(fn, layers, xs, reps: int) -> float:
    fn(layers, xs)
    t = time.perf_counter()
    for _ in range(reps):
        fn(layers, xs)
    return (time.perf_counter() - t) / reps


def run_onednn(layers, xs) -> None:
    for layer in layers:
        for w, x in zip(layer, xs, strict=True):
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def run_kernel(layers, xs) -> None:
    for layer in layers:
        for w, x in zip(layer, xs, strict=True):
            w(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--dtype", default="float32,bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(default_num_threads())
    params = sum(n * k for n, k in SHAPES) * LAYERS
    print(
        f"{'dtype':<10}{'rows':>6}{'oneDNN ms':>11}{'kernel ms':>11}{'kernel GB/s':>13}"
        f"{'GFLOP/s':>9}{'ratio':>7}"
    )
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        weights = [[(torch.randn(n, k) * 0.05).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
        if not linear_kernel_supported(weights[0][0]):
            print(f"{name}: kernel unavailable here")
            continue
        onednn = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in weights]
        kernel = [[PackedLinearWeight(w) for w in layer] for layer in weights]
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k).to(dtype) for _, k in SHAPES]

            reps = 10 if rows <= 64 else 2
            t_ref = seconds(run_onednn, onednn, xs, reps)
            t_ker = seconds(run_kernel, kernel, xs, reps)
            gbs = params * weights[0][0].element_size() / t_ker / 1e9
            gflops = 2 * rows * params / t_ker / 1e9
            print(
                f"{name:<10}{rows:>6}{t_ref * 1e3:>11.2f}{t_ker * 1e3:>11.2f}{gbs:>13.1f}"
                f"{gflops:>9.1f}{t_ker / t_ref:>7.2f}"
            )


if __name__ == "__main__":
    main()
