"""Tensor parallelism on this machine: TP=2 (one thread per rank) against TP=1 (two threads), in
one run, on W1 (benchmarks/throughput.py's workload) and on batch-1 decode; the all-reduce time
per call, per layer and per step (µs), resident memory per rank, start-up time; the control
channel (torch.distributed broadcast against a pipe and pyzmq); and, from the shapes of
Llama-3-8B and 70B, the all-reduce bytes per token a real TP deployment would move.

    python benchmarks/tensor_parallel.py [--num-requests 32] [--decode-tokens 128] [--model DIR]

The default SmolLM2-135M has 9 heads, so TP=2 cannot split it; the benchmark builds a random
Llama of the same size with 8 heads and 4 KV heads (hidden 576, 30 layers, FFN 1536, vocabulary
49152, fp32 safetensors), unless --model names another checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from tessera import LLM, SamplingParams
from tessera.distributed.traffic import tp_traffic

sys.path.insert(0, os.path.dirname(__file__))
from throughput import workload  # noqa: E402  (benchmarks/ is not a package)

ALL_REDUCE_ROWS = (1, 64)  # tokens in a step: batch-1 decode, a batch of 64 decodes
DATA = os.path.join(os.path.dirname(__file__), "..", "tessera", "simulator", "data", "models")


def _all_reduce_figures(phase: str, before, after, steps: int, wall: float) -> dict:
    """Rank 0's all-reduce time between two `collective_stats()`: µs per call and per step, and
    its share of the phase's wall time."""
    s0, s1 = before[0]["stats"], after[0]["stats"]
    calls = s1.num_all_reduce - s0.num_all_reduce
    secs = s1.all_reduce_seconds - s0.all_reduce_seconds
    return {f"{phase}_all_reduce_us_per_call": secs / calls * 1e6,
            f"{phase}_all_reduce_us_per_step": secs / steps * 1e6,
            f"{phase}_all_reduce_share": secs / wall}


def build_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=72, max_position_embeddings=2048, rope_theta=100000.0,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def collective(llm) -> list[dict] | None:
    ex = llm.llm_engine.executor
    return ex.collective_stats() if hasattr(ex, "collective_stats") else None


def run(path: str, tp: int, prompts, out_lens, decode_tokens: int) -> dict:
    if tp == 1:
        torch.set_num_threads(2)  # the engine sets it too (every core)
    t0 = time.perf_counter()
    llm = LLM(model=path, tensor_parallel_size=tp, max_model_len=1024,
              num_gpu_blocks_override=1024)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    res: dict = {"tp": tp, "startup_s": startup}
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], warm, use_tqdm=False)

    # batch-1 decode: one 128-token prompt, `decode_tokens` out; time from the first token on
    prompt = prompts[1][:128]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    before = collective(llm)
    steps0 = engine.step_times.num_steps
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True),
                       use_tqdm=False)
    elapsed = time.perf_counter() - t0
    res["decode_tok_s"] = (decode_tokens - 1) / max(elapsed - ttft, 1e-9)
    res["decode_tokens"] = out[0].outputs[0].token_ids
    after = collective(llm)
    decode_steps = engine.step_times.num_steps - steps0
    if before is not None:
        res.update(_all_reduce_figures("decode", before, after, decode_steps, elapsed + ttft))

    # W1
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    before = collective(llm)
    steps0 = engine.step_times.num_steps
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    res["w1_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    res["w1_tokens"] = [o.outputs[0].token_ids for o in outs]
    after = collective(llm)
    steps = engine.step_times.num_steps - steps0
    if before is not None:
        res.update(_all_reduce_figures("w1", before, after, steps, elapsed))
        s0, s1 = before[0]["stats"], after[0]["stats"]
        res["w1_gather_us_per_step"] = (s1.gather_seconds - s0.gather_seconds) / steps * 1e6
        res["rank_rss_mib"] = [a["rss_bytes"] / 2**20 for a in after]
        res["rank_weights_mib"] = [i.weight_bytes / 2**20 for i in engine.executor.rank_infos]
        res["rank_peak_rss_mib"] = [i.max_rss_bytes / 2**20 for i in engine.executor.rank_infos]
        res["step_msg_bytes"] = engine.executor.sent_bytes / max(engine.executor.num_sent, 1)
    else:
        model = engine.executor.runner.model
        res["rank_weights_mib"] = [sum(model.weight_bytes().values()) / 2**20]
    res["driver_rss_mib"] = rss_bytes() / 2**20
    engine.shutdown()
    return res


def print_traffic() -> None:
    print("\nall-reduce traffic of a real deployment (bf16 activations, from config.json):")
    print("| model | all-reduces/step | all-reduce bytes/token | link bytes/token TP=2 | TP=8 | "
          "logits gather bytes/sampled token | µs/token at 50 GB/s (TP=8, PCIe-class) | "
          "at 450 GB/s (NVLink-class) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ("Llama-3-8B", "Llama-3-70B"):
        with open(os.path.join(DATA, name, "config.json")) as f:
            cfg = json.load(f)
        t = tp_traffic(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], 2)
        link8 = t.link_bytes_per_token(8)
        print(
            f"| {name} | {t.num_all_reduces_per_step} | {t.all_reduce_bytes_per_token / 1024:.0f} "
            f"KiB "
            f"| {t.link_bytes_per_token(2) / 1024:.0f} KiB | {link8 / 1024:.0f} KiB | "
            f"{t.gather_bytes_per_sampled_token / 1024:.0f} KiB | {link8 / 50e9 * 1e6:.1f} | "
            f"{link8 / 450e9 * 1e6:.2f} |"
        )


# ---- the control channel: broadcast over gloo vs a pipe vs pyzmq -----------------------------
def _channel_peer(kind: str, port: int, sizes: list[int], iters: int, conn) -> None:
    torch.set_num_threads(1)
    if kind == "broadcast":
        import torch.distributed as dist

        from tessera.distributed.channel import BroadcastChannel

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                rank=1)
        ch = BroadcastChannel(dist.group.WORLD)
        ack = torch.zeros(1)
        for _ in range(len(sizes) * iters):
            ch.recv_bytes()
            dist.send(ack, dst=0)
        for rows in ALL_REDUCE_ROWS:
            t = torch.zeros(rows, 576)
            for _ in range(iters):
                dist.all_reduce(t)
        dist.destroy_process_group()
    elif kind == "zmq":
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(len(sizes) * iters):
            sock.recv()
            sock.send(b"k")
        sock.close()
        ctx.term()
    else:
        for _ in range(len(sizes) * iters):
            conn.recv_bytes()
            conn.send_bytes(b"k")


def measure_channels(sizes: list[int], iters: int = 200) -> dict[str, list[float]]:
    """Round trip (message there, 1-byte ack back) in µs per size, median of `iters`."""
    import multiprocessing as mp

    from tessera.executor.multiproc_executor import free_loopback_port

    ctx = mp.get_context("spawn")
    results: dict[str, list[float]] = {}
    for kind in ("pipe", "zmq", "broadcast"):
        port = free_loopback_port()
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_channel_peer, args=(kind, port, sizes, iters, child))
        sock = zctx = None
        if kind == "zmq":
            import zmq

            zctx = zmq.Context()
            sock = zctx.socket(zmq.PAIR)
            sock.bind(f"tcp://127.0.0.1:{port}")
        p.start()
        if kind == "broadcast":
            import torch.distributed as dist

            from tessera.distributed.channel import BroadcastChannel

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                    rank=0)
            ch = BroadcastChannel(dist.group.WORLD)
            ack = torch.zeros(1)
        medians = []
        for size in sizes:
            data = os.urandom(size)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                if kind == "pipe":
                    parent.send_bytes(data)
                    parent.recv_bytes()
                elif kind == "zmq":
                    sock.send(data)
                    sock.recv()
                else:
                    ch.send_bytes(data)
                    dist.recv(ack, src=1)
                times.append(time.perf_counter() - t0)
            medians.append(statistics.median(times) * 1e6)
        if kind == "broadcast":
            for rows in ALL_REDUCE_ROWS:  # the bare collective, no model around it
                t = torch.zeros(rows, 576)
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    dist.all_reduce(t)
                    times.append(time.perf_counter() - t0)
                results[f"all_reduce [{rows}, 576] fp32"] = [statistics.median(times) * 1e6]
            dist.destroy_process_group()
        if sock is not None:
            sock.close()
            zctx.term()
        p.join(30)
        results[kind] = medians
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--skip-channels", action="store_true")
    args = ap.parse_args()
    prompts, out_lens = workload(args.num_requests)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = os.path.join(tmp, "llama-8h")
            build_model(path)
        results = [run(path, tp, prompts, out_lens, args.decode_tokens) for tp in (1, 2)]
    one, two = results
    same_decode = one["decode_tokens"] == two["decode_tokens"]
    same_w1 = sum(a == b for a, b in zip(one["w1_tokens"], two["w1_tokens"], strict=True))
    print(
        f"\nmodel: "
        f"{args.model or 'random Llama, 8 heads / 4 KV heads, hidden 576, 30 layers, fp32'}; "
        f"W1 = first {args.num_requests} requests of benchmarks/throughput.py's workload"
    )
    print("| | TP=1, 2 threads | TP=2, 1 thread/rank | TP=2 / TP=1 |")
    print("| --- | ---: | ---: | ---: |")
    for key, label in (("w1_tok_s", "W1 output tok/s"), ("decode_tok_s", "batch-1 decode tok/s")):
        print(f"| {label} | {one[key]:.1f} | {two[key]:.1f} | {two[key] / one[key]:.2f}x |")
    print(
        f"| start-up (LLM(...) to ready), s | {one['startup_s']:.1f} | {two['startup_s']:.1f} | |"
    )
    print(f"| weights held per rank, MiB | {one['rank_weights_mib'][0]:.0f} | "
          f"{' / '.join(f'{w:.0f}' for w in two['rank_weights_mib'])} | |")
    print(f"| resident memory, MiB | {one['driver_rss_mib']:.0f} (one process) | ranks "
          f"{' / '.join(f'{m:.0f}' for m in two['rank_rss_mib'])} (peak while loading "
          f"{' / '.join(f'{m:.0f}' for m in two['rank_peak_rss_mib'])}), driver "
          f"{two['driver_rss_mib']:.0f} | |")
    layers = 30
    for phase in ("decode", "w1"):
        call = two[f"{phase}_all_reduce_us_per_call"]
        print(f"| TP=2 all-reduce, {phase}: µs per call / per layer (2 calls) / per step | | "
              f"{call:.0f} / {2 * call:.0f} / {two[f'{phase}_all_reduce_us_per_step']:.0f} "
              f"({two[f'{phase}_all_reduce_share']:.0%} of the wall time) | |")
    print(f"| TP=2 logits gather, W1, µs per step | | {two['w1_gather_us_per_step']:.0f} | |")
    print(f"| TP=2 step message (pickled SchedulerOutput), mean bytes | | "
          f"{two['step_msg_bytes']:.0f} | |")
    print(f"greedy tokens TP=2 vs TP=1: batch-1 decode {'identical' if same_decode else 'DIFFER'}, "
          f"W1 {same_w1}/{len(one['w1_tokens'])} requests identical (layers: {layers})")
    print_traffic()
    if not args.skip_channels:
        sizes = [512, 4096, 65536, 1 << 20]
        res = measure_channels(sizes)
        bare = {k: res.pop(k)[0] for k in list(res) if k.startswith("all_reduce")}
        print("\ncontrol channel, round trip (message + 1-byte ack), median µs:")
        print("| bytes | " + " | ".join(res) + " |")
        print("| ---: |" + " ---: |" * len(res))
        for i, size in enumerate(sizes):
            print(f"| {size} | " + " | ".join(f"{res[k][i]:.0f}" for k in res) + " |")
        for k, us in bare.items():
            print(f"bare gloo {k} between two idle processes: {us:.0f} µs (median)")


if __name__ == "__main__":
    main()
