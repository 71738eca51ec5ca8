"""Mixture-of-experts on CPU: the fused expert path (tessera/model/moe.py) against the naive
loop over every expert, against a dense MLP of the same active size, and a ~1B-total / ~0.3B-active
Qwen3-MoE GGUF (Q4_0) against llama.cpp and against the dense model of the same active size.

    flock -x /work/cpu.lock python benchmarks/moe.py                 # one layer, in process
    flock -x /work/cpu.lock python benchmarks/moe.py --model-1b     # the GGUF models, engine

One layer (default): hidden 1024, 32 experts of width 512, top-6 (the 1B model's layer), weights
fp32 or Q4_0 (the quantized kernels), a random router. Per token count T (decode batch sizes and
a prefill chunk), the median time of: "fused" (tokens grouped by expert, each chosen expert run
once over its tokens), "naive" (every expert over every token, weighted by the routing, zero
where not chosen: dense masked compute) and "dense" (one MLP of width 6 x 512 = 3072: the same
multiply-adds per token as the fused path). Printed: times and the ratios naive / fused and
fused / dense.

The models (--model-1b): written to --workdir with random weights (numpy, std 0.02) and the
default model's tokenizer (vocabulary 49,152): Qwen3-MoE, 16 layers of the layer above, 16 heads
(4 KV heads) of 64: 0.95 B parameters, 0.29 B active a token (embeddings and lm_head counted);
and a dense Qwen3 with MLP width 3072 and otherwise the same shapes (0.29 B). Both Q4_0 (norms and
the router f32). Each engine variant runs in its own process: decode tok/s at batch 1 and 16 (B
prompts of 32 tokens; the time of max_tokens=1+N minus that of max_tokens=1), and the expert
bytes the batch-1 decode read a token (counted at each expert call) against the active expert
parameters' Q4_0 bytes. llama.cpp: `llama-bench -n 64 -p 0` (tg, batch 1) on the same files.
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
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

HIDDEN, EXPERTS, WIDTH, TOP_K = 1024, 32, 512, 6
MODEL = dict(vocab_size=49152, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)
PROMPT_LEN = 32


# ---- one layer ----------------------------------------------------------------------------------
def _weight(rows: int, cols: int, qtype, gen):
    """A random [rows, cols] weight: float32, or GGUF blocks of `qtype` (a QuantizedTensor)."""
    import gguf
    import numpy as np
    import torch

    from tessera.model.gguf_quant import QuantizedTensor

    w = gen.standard_normal((rows, cols), dtype=np.float32) * 0.02
    if qtype is None:
        return torch.from_numpy(w)
    blocks = gguf.quants.quantize(w, qtype)
    return QuantizedTensor(qtype, blocks, torch.Size([rows, cols]))


def layer_bench(repeats: int) -> None:
    import gguf
    import numpy as np
    import torch

    from tessera.model.layers import SiluAndMul, make_linear
    from tessera.model.moe import ExpertMLP, FusedMoE

    cpu, dtype = torch.device("cpu"), torch.float32
    act = SiluAndMul(cpu, dtype)
    print(f"one MoE layer: hidden {HIDDEN}, {EXPERTS} experts of width {WIDTH}, top-{TOP_K}; "
          f"dense MLP width {TOP_K * WIDTH}; {torch.get_num_threads()} threads", flush=True)
    print(f"{'weights':<8}{'T':>5}{'fused ms':>10}{'naive ms':>10}{'dense ms':>10}"
          f"{'naive/fused':>13}{'fused/dense':>13}")
    for label, qtype in (("fp32", None), ("Q4_0", gguf.GGMLQuantizationType.Q4_0)):
        gen = np.random.default_rng(0)

        def linear(parts):
            return make_linear(parts, None, dtype, cpu)

        experts = {
            e: ExpertMLP(linear([_weight(WIDTH, HIDDEN, qtype, gen),
                                 _weight(WIDTH, HIDDEN, qtype, gen)]),
                         linear([_weight(HIDDEN, WIDTH, qtype, gen)]), act)
            for e in range(EXPERTS)
        }
        router = linear([torch.from_numpy(gen.standard_normal((EXPERTS, HIDDEN),
                                                              dtype=np.float32))])
        moe = FusedMoE(router, experts, EXPERTS, TOP_K, renormalize=True)
        dense = ExpertMLP(linear([_weight(TOP_K * WIDTH, HIDDEN, qtype, gen),
                                  _weight(TOP_K * WIDTH, HIDDEN, qtype, gen)]),
                          linear([_weight(HIDDEN, TOP_K * WIDTH, qtype, gen)]), act)

        for tokens in (1, 4, 16, 64, 256):
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
            torch.testing.assert_close(moe(x), naive(moe, x), rtol=1e-4, atol=1e-5)
            times = [_median_ms(f, x, repeats) for f in (moe, partial(naive, moe), dense)]
            print(f"{label:<8}{tokens:>5}{times[0]:>10.3f}{times[1]:>10.3f}{times[2]:>10.3f}"
                  f"{times[1] / times[0]:>12.2f}x{times[0] / times[2]:>12.2f}x", flush=True)


def naive(moe, x):
    """Every expert over every token, weighted by the routing (zero where not chosen)."""
    import torch

    weights, ids = moe.route(x)
    gate = torch.zeros(x.shape[0], moe.num_experts).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        out.addcmul_(gate[:, e : e + 1], moe.experts[e](x))
    return out


def _median_ms(fn, x, repeats: int) -> float:
    import torch

    with torch.inference_mode():
        for _ in range(2):
            fn(x)
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(x)
            samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


# ---- the ~1B GGUF models ------------------------------------------------------------------------
def build_models(workdir: str) -> dict[str, str]:
    """Write (or reuse) the MoE and the dense Q4_0 GGUF; returns {"moe": path, "dense": path}."""
    import gguf
    import numpy as np

    from benchmarks.large_model import _copy_tokenizer
    from tessera.model.default_model import default_model_path

    os.makedirs(workdir, exist_ok=True)
    paths = {"moe": os.path.join(workdir, "qwen3moe-1b-a0.3b-random.Q4_0.gguf"),
             "dense": os.path.join(workdir, "qwen3-0.3b-random.Q4_0.gguf")}
    q4 = gguf.GGMLQuantizationType.Q4_0
    m = MODEL
    q, kv = m["num_attention_heads"] * m["head_dim"], m["num_key_value_heads"] * m["head_dim"]
    for kind, path in paths.items():
        if os.path.isfile(path):
            continue
        start = time.perf_counter()
        gen = np.random.default_rng(0)
        arch = "qwen3moe" if kind == "moe" else "qwen3"
        writer = gguf.GGUFWriter(path + ".part", arch)
        writer.add_block_count(m["num_hidden_layers"])
        writer.add_context_length(m["max_position_embeddings"])
        writer.add_embedding_length(HIDDEN)
        writer.add_feed_forward_length(TOP_K * WIDTH)
        writer.add_head_count(m["num_attention_heads"])
        writer.add_head_count_kv(m["num_key_value_heads"])
        writer.add_key_length(m["head_dim"])
        writer.add_value_length(m["head_dim"])
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(1e6)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        if kind == "moe":
            writer.add_expert_count(EXPERTS)
            writer.add_expert_used_count(TOP_K)
            writer.add_expert_feed_forward_length(WIDTH)
        _copy_tokenizer(writer, default_model_path())
        sizes: list[int] = []

        def add(name: str, *shape: int, quantize: bool = True, writer=writer, gen=gen,
                sizes=sizes) -> None:
            w = gen.standard_normal(shape, dtype=np.float32) * 0.02
            if not quantize:  # norms near 1, the router f32
                writer.add_tensor(name, w if len(shape) > 1 else w + 1.0)
            else:
                writer.add_tensor(name, gguf.quants.quantize(w, q4), raw_dtype=q4)
            sizes.append(w.size)

        add("token_embd.weight", m["vocab_size"], HIDDEN)
        add("output.weight", m["vocab_size"], HIDDEN)
        add("output_norm.weight", HIDDEN, quantize=False)
        for i in range(m["num_hidden_layers"]):
            b = f"blk.{i}."
            add(b + "attn_q.weight", q, HIDDEN)
            add(b + "attn_k.weight", kv, HIDDEN)
            add(b + "attn_v.weight", kv, HIDDEN)
            add(b + "attn_output.weight", HIDDEN, q)
            for norm in ("attn_norm", "ffn_norm"):
                add(b + norm + ".weight", HIDDEN, quantize=False)
            for norm in ("attn_q_norm", "attn_k_norm"):
                add(b + norm + ".weight", m["head_dim"], quantize=False)
            if kind == "moe":
                add(b + "ffn_gate_inp.weight", EXPERTS, HIDDEN, quantize=False)
                add(b + "ffn_gate_exps.weight", EXPERTS, WIDTH, HIDDEN)
                add(b + "ffn_up_exps.weight", EXPERTS, WIDTH, HIDDEN)
                add(b + "ffn_down_exps.weight", EXPERTS, HIDDEN, WIDTH)
            else:
                add(b + "ffn_gate.weight", TOP_K * WIDTH, HIDDEN)
                add(b + "ffn_up.weight", TOP_K * WIDTH, HIDDEN)
                add(b + "ffn_down.weight", HIDDEN, TOP_K * WIDTH)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(path + ".part", path)
        print(f"wrote {path}: {sum(sizes) / 1e9:.2f} B parameters, "
              f"{os.path.getsize(path) / 1e9:.2f} GB, in {time.perf_counter() - start:.0f}s",
              flush=True)
    return paths


def measure(path: str, steps: int) -> dict:
    """Decode tok/s at batch 1 and 16, and expert bytes read a token at batch 1 (this process)."""
    import torch

    from tessera import LLM, SamplingParams
    from tessera.model import moe

    llm = LLM(model=path, max_model_len=256, kv_cache_space=0.25, swap_space=0)
    gen = torch.Generator().manual_seed(0)
    read = [0]
    call = moe.FusedMoE.experts_forward

    def counted(self, x, topk_weights, topk_ids):
        if x.shape[0] == 1:  # a batch-1 decode step: the experts its token chose
            read[0] += sum(self.experts[e].weight_bytes for e in set(topk_ids[0].tolist()))
        return call(self, x, topk_weights, topk_ids)

    def timed(batch: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": torch.randint(100, 49000, (PROMPT_LEN,), generator=gen)
                    .tolist()} for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    timed(1, 4)  # warm-up
    result: dict = {"weights": llm.llm_engine.executor.runner.model.weight_bytes()}
    for batch in (1, 16):
        base = timed(batch, 1)
        full = timed(batch, 1 + steps)
        result[f"decode@{batch}"] = batch * steps / (full - base)
    if result["weights"].get("experts"):
        moe.FusedMoE.experts_forward = counted  # one untimed batch-1 run, counting reads
        timed(1, 1 + steps)
        moe.FusedMoE.experts_forward = call
        result["expert_bytes_per_token"] = read[0] / steps
    return result


def model_bench(workdir: str, steps: int, threads: int) -> None:
    from benchmarks.llamacpp_build import llama_bench_path

    paths = build_models(workdir)
    rows = {}
    for kind, path in paths.items():
        out = subprocess.run([sys.executable, __file__, "--measure", path, "--steps", str(steps)],
                             capture_output=True, text=True, check=True)
        rows[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"tessera {kind}: {rows[kind]}", flush=True)
    bench = llama_bench_path("/work/peers/llama.cpp-build")
    peer = {}
    if os.path.exists(bench):
        for kind, path in paths.items():
            cmd = [bench, "-m", path, "-p", "0", "-n", "64", "-t", str(threads), "-r", "2",
                   "-o", "json"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:  # its AMX repack dies under some hypervisors
                done = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True)
            peer[kind] = (float(json.loads(done.stdout)[0]["avg_ts"])
                          if done.returncode == 0 else float("nan"))
            print(f"llama.cpp {kind}: tg64 {peer[kind]:.1f} tok/s", flush=True)
    # Q4_0: 18 bytes a block of 32
    active_expert_bytes = MODEL["num_hidden_layers"] * TOP_K * 3 * WIDTH * HIDDEN * 18 / 32
    moe_row, dense_row = rows["moe"], rows["dense"]
    print(f"\n{'model':<8}{'b1 tok/s':>10}{'b16 tok/s':>11}{'llama.cpp b1':>14}"
          f"{'b1 vs llama.cpp':>17}")
    for kind, r in rows.items():
        lc = peer.get(kind, float("nan"))
        print(f"{kind:<8}{r['decode@1']:>10.1f}{r['decode@16']:>11.1f}{lc:>14.1f}"
              f"{r['decode@1'] / lc:>16.2f}x")
    print(f"batch-16 decode, MoE / dense of the same active size: "
          f"{moe_row['decode@16'] / dense_row['decode@16']:.2f}x; batch 1: "
          f"{moe_row['decode@1'] / dense_row['decode@1']:.2f}x")
    print(f"expert bytes read a token at batch 1: {moe_row['expert_bytes_per_token'] / 1e6:.1f} "
          f"MB; the active experts' Q4_0 bytes: {active_expert_bytes / 1e6:.1f} MB "
          f"(all experts: {moe_row['weights']['experts'] / 1e6:.1f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-1b", action="store_true", help="the GGUF models through the engine")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tessera-moe"))
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per layer figure")
    ap.add_argument("--measure", metavar="PATH", help=argparse.SUPPRESS)  # one engine's child
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.steps)))
    elif args.model_1b:
        model_bench(args.workdir, args.steps, args.threads)
    else:
        layer_bench(args.repeats)


if __name__ == "__main__":
    main()
