"""llama.cpp as a peer: batch-1 decode and 512-token prefill on the same GGUF, in one run.

    flock -x /work/cpu.lock python benchmarks/llamacpp_peer.py [--model FILE.gguf ...] \\
        [--isa avx2,avx512] [--quantization gguf,gguf_int8] [--threads 2] [--build-dir DIR] \\
        [--rounds 3]

llama.cpp: `llama-bench -p 512 -n 128 -t THREADS` (pp512 and tg128, tok/s), built once from the
llama-cpp-python 0.3.36 sdist's vendored llama.cpp (benchmarks/llamacpp_build.py: pip download,
CMake with GGML_NATIVE=ON and everything else off, targets llama-bench and llama-server with -j2;
~10 min on two cores) and cached outside the repository (default ~/.cache/tessera/llama.cpp).
Tessera's avx2 rows are compared with a second build for AVX2 only (GGML_NATIVE=OFF,
AVX2/FMA/F16C/BMI2 on, AVX-512 off: what Zen 3 runs), so that on an AVX-512 machine both engines
run the instruction set of an AVX2 CPU; `--peer-isa native` compares them with the native build
instead.

Tessera: the model runner on the same file (benchmarks/runner.py's `Ours`, the default engine
settings' model, fp32 activations), each TESSERA_CPU_ISA in its own process: one 512-token
prefill after a warm-up, then 128 decode steps at batch 1 from a 16-token prompt. The two engines
take turns `--rounds` times (a two-core cloud host's speed drifts by 10-20% within minutes, and
a round's two figures drift together). Printed: both engines' median figures, the median of the
rounds' ratios Tessera / llama.cpp and their range; then each decode's share of the DRAM
roofline: the weight bytes a decode token streams (every projection and the lm_head) times its
tok/s, over the streaming-read bandwidth benchmarks/w1_ceiling.py measures.
benchmarks/peers.py --llama-cpp runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # run as a script or imported by peers.py
from llamacpp_build import DEFAULT_BUILD_DIR, build_llama_cpp, llama_bench  # noqa: E402


def tessera_child(model: str, quantization: str, threads: int) -> dict[str, float]:
    """This process's figures (the ISA comes from TESSERA_CPU_ISA in its environment)."""
    import torch
    from runner import Ours  # benchmarks/runner.py

    from tessera.model.loader import load_model, weight_quantization

    torch.set_num_threads(threads)
    cfg, weights = load_model(model, weight_quantization(quantization, "float32", "cpu", model))
    ours = Ours(cfg, weights, torch.float32)
    del weights
    gen = torch.Generator().manual_seed(0)
    prompt = [torch.randint(100, cfg.vocab_size - 100, (512,), generator=gen).tolist()]
    with torch.inference_mode():
        ours.prefill(prompt)  # warm-up: kernels built and loaded, pages touched
        t = time.perf_counter()
        ours.prefill(prompt)
        prefill = 512 / (time.perf_counter() - t)
        tok = ours.prefill([prompt[0][:16]], max_new_tokens=130)
        tok = ours.decode(tok)
        t = time.perf_counter()
        for _ in range(128):
            tok = ours.decode(tok)
        decode = 128 / (time.perf_counter() - t)
    # what a decode step streams: every layer's projections and the lm_head
    return {"prefill": prefill, "decode": decode, "weight_bytes": ours.weight_bytes["linear"]}


def dram_read_bandwidth() -> float:
    """Bytes/s of a streaming read from DRAM on torch's threads (w1_ceiling.py's peak)."""
    import torch
    from w1_ceiling import measure_peaks

    return measure_peaks(torch.float32).bandwidth


def run_tessera(model: str, quantization: str, threads: int, isa: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=REPO, TESSERA_CPU_ISA=isa)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                f.name,
                "--model",
                model,
                "--quantization",
                quantization,
                "--threads",
                str(threads),
            ],
            env=env,
            check=True,
        )
        return json.load(open(f.name))


def peer_build(isa: str, peer_isa: str) -> str:
    """The llama.cpp build Tessera's `isa` is compared with: the AVX2 one for avx2 under
    `--peer-isa matched`, else the native one."""
    return "avx2" if peer_isa == "matched" and isa == "avx2" else "native"


def median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    """One engine's figures over rounds: the median of each (the other entries, such as the
    weight bytes or llama.cpp's repack flag, are the same in every round)."""
    out = dict(runs[0])
    for key in ("decode", "prefill"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def compare(
    models: list[str], isas: list[str], quantizations: list[str], threads: int, build_dir: str,
    peer_isa: str = "matched", rounds: int = 3,
) -> list[dict]:
    """Every model, `rounds` times in turn: llama.cpp once per build in use (peer_build), then
    Tessera once per ISA and quantization. A host whose speed drifts within minutes moves both
    engines of a round alike, so a row's ratio is the median of its rounds' own ratios (its
    figures the medians of each engine's). Prints a table, returns its rows."""
    builds = sorted({peer_build(isa, peer_isa) for isa in isas})
    benches = {b: build_llama_cpp(build_dir, b) for b in builds}
    rows = []
    for model in models:
        runs = []  # per round: (llama.cpp by build, Tessera by (isa, quantization))
        for _ in range(rounds):
            peers = {b: llama_bench(benches[b], model, threads) for b in builds}
            ours = {(isa, q): run_tessera(model, q, threads, isa)
                    for isa in isas for q in quantizations}
            runs.append((peers, ours))
        for isa in isas:
            build = peer_build(isa, peer_isa)
            for quantization in quantizations:
                pairs = [(ours[(isa, quantization)], peers[build]) for peers, ours in runs]
                rows.append(
                    {
                        "model": os.path.basename(model),
                        "isa": isa,
                        "quantization": quantization,
                        "threads": threads,
                        "tessera": median_figures([o for o, _ in pairs]),
                        "llama.cpp": median_figures([p for _, p in pairs]),
                        "llama.cpp build": build,
                        "ratios": {key: [o[key] / p[key] for o, p in pairs]
                                   for key in ("decode", "prefill")},
                    }
                )
    print(
        f"{'model':<34}{'isa':<9}{'quant':<10}{'figure':<7}{'tessera':>9}{'llama.cpp':>11}"
        f"{'ratio':>8}  {'rounds':<13}  peer build (repack)"
    )
    for r in rows:
        for key, label in (("decode", "tg128"), ("prefill", "pp512")):
            ours, peer, ratios = r["tessera"][key], r["llama.cpp"][key], r["ratios"][key]
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}x"
            print(
                f"{r['model']:<34}{r['isa']:<9}{r['quantization']:<10}{label:<7}{ours:>9.1f}"
                f"{peer:>11.1f}{statistics.median(ratios):>7.2f}x  {spread:<13}  "
                f"{r['llama.cpp build']} ({r['llama.cpp']['repack']})"
            )
    bandwidth = dram_read_bandwidth()
    print(f"decode against the DRAM roofline (streaming read {bandwidth / 1e9:.1f} GB/s, "
          "benchmarks/w1_ceiling.py's): weight bytes a token x tok/s")
    for r in rows:
        streamed = r["tessera"]["decode"] * r["tessera"]["weight_bytes"]
        r["roofline"] = streamed / bandwidth
        print(f"{r['model']:<34}{r['isa']:<9}{r['quantization']:<10}"
              f"{r['tessera']['weight_bytes'] / 1e6:>8.1f} MB a token  {streamed / 1e9:>5.1f} GB/s"
              f"  {100 * r['roofline']:>5.1f}% of the roofline")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        action="append",
        default=None,
        help="GGUF file (repeatable); default: the default model",
    )
    ap.add_argument("--isa", default="avx512,avx2", help="TESSERA_CPU_ISA values, comma list")
    ap.add_argument("--quantization", default="gguf_int8",
                    help="Tessera's --quantization values (auto, gguf, gguf_int8, gguf_int8_a16, "
                         "none), comma list")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--build-dir", default=DEFAULT_BUILD_DIR)
    ap.add_argument("--peer-isa", choices=("matched", "native"), default="matched",
                    help="matched: Tessera's avx2 rows against llama.cpp built for AVX2 only, as "
                         "on an AVX2 CPU; native: every row against the -march=native build")
    ap.add_argument("--rounds", type=int, default=3,
                    help="llama.cpp and Tessera in turn this many times; medians")
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    models = args.model
    if models is None:
        from tessera.model.default_model import resolve_model_path

        models = [resolve_model_path(None)]
    if args.child:
        with open(args.child, "w") as f:
            json.dump(tessera_child(models[0], args.quantization, args.threads), f)
        return 0
    isas = [i.strip() for i in args.isa.split(",") if i.strip()]
    quantizations = [q.strip() for q in args.quantization.split(",") if q.strip()]
    from tessera.config import QUANTIZATION_CHOICES

    for q in quantizations:
        if q not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization {q!r}: expected one of "
                             f"{', '.join(QUANTIZATION_CHOICES)}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    rows = compare(models, isas, quantizations, args.threads, args.build_dir, args.peer_isa,
                   args.rounds)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
