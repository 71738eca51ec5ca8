"""Resident memory of `tessera serve` on workload W1 with a 12,288-token KV cache, and where it
goes.

Two measurements, each in a fresh process:
1. **Where it goes** (`--breakdown`, in-process): RSS after each stage of start-up, in order: the
   interpreter, `import torch` (+ tessera and its compiled kernels), the tokenizer, the weights
   (the model built from them, the file's buffers freed), the engine (KV pool, swap pool
   reserved but not touched, grammar backend), then the peak (VmHWM) after W1 ran offline.
2. **The server** (default): `tessera serve --num-gpu-blocks-override 768` (768 x 16 = 12,288
   tokens, llama-server's `-c 12288`), W1 sent over HTTP (64 token-id prompts of 64-512 tokens,
   16-256 output tokens each, ignore_eos, all at once), then the server's idle RSS and peak RSS
   (VmHWM, the kernel's own high-water mark, so no sampling gap).

The peer: llama-server F16 with `-c 12288` held 0.6 GB peak on this machine (an earlier
measurement; llama.cpp is not installed here, so it is quoted, not re-measured).

    python benchmarks/memory.py [--dtype float32|bfloat16] [--kv-cache-dtype auto|bfloat16|float32]
                                [--num-requests 64]
    python benchmarks/memory.py --breakdown [--dtype bfloat16] [--kv-cache-dtype bfloat16]

`--kv-cache-dtype bfloat16` stores the 12,288-token cache in bf16 whatever the compute dtype, as
llama-server keeps an f16 KV cache by default.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

LLAMA_SERVER_PEAK_GB = 0.6  # llama-server F16, -c 12288, W1, measured here
KV_TOKENS = 12_288
BLOCK_SIZE = 16


def status_kb(field: str, pid: int | str = "self") -> int:
    """A `VmRSS`/`VmHWM`-style field of /proc/PID/status, in kB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_mb(pid: int | str = "self") -> float:
    return status_kb("VmRSS", pid) / 1024


def peak_mb(pid: int | str = "self") -> float:
    return status_kb("VmHWM", pid) / 1024


def breakdown(dtype: str, kv_cache_dtype: str, num_requests: int) -> None:
    stages: list[tuple[str, float]] = [("interpreter", rss_mb())]
    from tessera.engine.malloc_tuning import limit_malloc_retention, release_free_memory

    limit_malloc_retention()  # as `tessera serve` does
    import torch

    from tessera import SamplingParams
    from tessera.config import EngineArgs
    from tessera.engine.llm_engine import LLMEngine
    from tessera.engine.loading import ModelBundle, build_engine
    from tessera.kernels import fused, linear, paged_attention, quant_linear, token_mask
    from tessera.model.checkpoint_dtype import checkpoint_dtype
    from tessera.model.default_model import resolve_model_path
    from tessera.model.loader import load_model
    from tessera.model.registry import get_model_class
    from tessera.tokenizer import load_tokenizer

    # each kernel's .so is built (first time) or loaded from the cache by its own module
    fused.fused_ops_for(torch.device("cpu"), torch.float32)
    linear._module()
    quant_linear._module()
    paged_attention._load()
    token_mask.prepare()
    stages.append(("torch + tessera + kernels", rss_mb()))
    path = resolve_model_path(None)
    tokenizer = load_tokenizer(path)
    stages.append(("tokenizer", rss_mb()))
    args = EngineArgs(dtype=dtype, num_gpu_blocks_override=KV_TOKENS // BLOCK_SIZE,
                      block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype)
    stored = checkpoint_dtype(path)
    config = args.create_engine_config(None, stored)
    arch, weights = load_model(path, config.model.quantization)
    model = get_model_class(arch.architecture)(
        arch, weights, getattr(torch, config.model.dtype), torch.device("cpu"),
        config.model.max_model_len)
    del weights
    release_free_memory()  # as load_bundle does
    stages.append(("weights (model built)", rss_mb()))
    bundle = ModelBundle(path, arch, model, tokenizer, config.model.dtype, "cpu",
                         config.model.max_model_len, config.model.quantization, stored)
    engine = build_engine(LLMEngine, args, bundle)
    stages.append(("engine (KV pool, swap reserved)", rss_mb()))
    kv = engine.executor.runner.cache_engine.gpu_cache
    kv_mb = kv.numel() * kv.element_size() / 2**20

    from throughput import workload  # the sibling benchmark's W1

    prompts, out_lens = workload(num_requests)
    for k, (prompt, n) in enumerate(zip(prompts, out_lens, strict=True)):
        engine.add_request(str(k), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stages.append(("after W1 (current)", rss_mb()))
    stages.append(("peak during W1 (VmHWM)", peak_mb()))

    weights_mb = sum(model.weight_bytes().values()) / 2**20
    print(
        f"dtype {config.model.dtype}, KV {kv.dtype} {KV_TOKENS} tokens: weights {weights_mb:.0f} "
        f"MiB, "
        f"KV pool {kv_mb:.0f} MiB (tensor sizes)"
    )
    print(f"{'stage':<34}{'RSS MiB':>9}{'delta':>8}")
    prev = 0.0
    for name, mb in stages:
        delta = mb - prev if not name.startswith("peak") else mb - stages[-2][1]
        print(f"{name:<34}{mb:>9.0f}{delta:>+8.0f}")
        if not name.startswith("peak"):
            prev = mb


async def send_w1(url: str, num_requests: int) -> tuple[int, float]:
    import httpx
    from throughput import workload

    prompts, out_lens = workload(num_requests)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt, n):
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, out_lens, strict=True)))
        return sum(counts), time.perf_counter() - start


def serve(dtype: str, kv_cache_dtype: str, num_requests: int, extra: list[str]) -> None:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tessera.entrypoints.cli", "serve", "--port", str(port),
           "--log-level", "warning", "--dtype", dtype, "--block-size", str(BLOCK_SIZE),
           "--num-gpu-blocks-override", str(KV_TOKENS // BLOCK_SIZE),
           "--kv-cache-dtype", kv_cache_dtype, *extra]
    print(" ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        start = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        ready = time.perf_counter() - start
        idle = rss_mb(proc.pid)
        tokens, elapsed = asyncio.run(send_w1(url, num_requests))
        after, peak = rss_mb(proc.pid), peak_mb(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(f"ready in {ready:.1f}s; W1: {num_requests} requests, {tokens} output tokens in "
          f"{elapsed:.1f}s ({tokens / elapsed:.1f} tok/s)")
    print(f"RSS idle {idle:.0f} MiB, after W1 {after:.0f} MiB, peak {peak:.0f} MiB "
          f"({peak * 2**20 / 1e9:.2f} GB)")
    print(f"llama-server F16 -c {KV_TOKENS} peak {LLAMA_SERVER_PEAK_GB} GB (quoted): "
          f"ratio {peak * 2**20 / 1e9 / LLAMA_SERVER_PEAK_GB:.2f}x (target <= 2x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--breakdown", action="store_true", help="in-process RSS by start-up stage")
    ap.add_argument("--server-args", default="", help="extra `tessera serve` flags")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.breakdown:
        breakdown(args.dtype, args.kv_cache_dtype, args.num_requests)
    else:
        serve(args.dtype, args.kv_cache_dtype, args.num_requests, args.server_args.split())


if __name__ == "__main__":
    main()
