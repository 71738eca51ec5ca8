"""A ~1B-parameter Llama made here: random weights from transformers, written as
GGUF Q8_0 and Q4_0 with the `gguf` package's writer, then loaded and served by the engine.

The model: hidden 2048, 16 layers, MLP 5632, 32 heads (8 KV heads, head_dim 64), untied
embeddings, and the default model's vocabulary (49,152) and tokenizer (its GGUF tokenizer fields
are copied), so text prompts work too: 0.92 B parameters, 3.7 GB in fp32, 1.8 GB in bf16.

The files go to `--workdir` (default: a directory under the system temp dir, reused by later runs;
nothing is written to the repository). Each measured variant runs in its own process, so its RSS
is its own: load time (`LLM(...)` constructed, weights packed, KV allocated), RSS after load, and
decode tok/s at batch 1 and 16 through the engine (B prompts of 32 tokens; the time of
`max_tokens=1 + N` minus that of `max_tokens=1`, so prefill is not counted), against bf16 weights
(the Q8_0 file dequantized at load, `--quantization none --dtype bfloat16`) in the same run.

    python benchmarks/large_model.py [--types q8_0,q4_0] [--variants q8_0/float32,q4_0/float32,bf16]
    python benchmarks/large_model.py --build-only        # write the GGUF files and stop
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ARCH = dict(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
PROMPT_LEN = 32


def _permute_qk(w, num_heads: int):
    """llama.cpp's converter stores Q/K rows interleaved for its RoPE: row 2j+p of a head is HF
    row j + p*head_dim/2 (our GGUF loader undoes it)."""
    rows, cols = w.shape
    return w.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _copy_tokenizer(writer, source_path: str) -> None:
    """The default model's tokenizer fields, so `load_tokenizer` finds the same tokenizer here."""
    import gguf

    for key, field in gguf.GGUFReader(source_path, "r").fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def build(workdir: str, types: list[str], arch: dict | None = None) -> dict[str, str]:
    """Write (or reuse) one GGUF per type; returns {type: path}. `arch` overrides ARCH's numbers
    (the script's test builds a tiny one)."""
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera.model.default_model import default_model_path

    arch = {**ARCH, **(arch or {})}
    paths = {t: os.path.join(workdir, f"llama-1b-random.{t.upper()}.gguf") for t in types}
    missing = [t for t in types if not os.path.isfile(paths[t])]
    if not missing:
        return paths
    os.makedirs(workdir, exist_ok=True)
    start = time.perf_counter()
    torch.manual_seed(0)
    config = LlamaConfig(**arch)
    model = LlamaForCausalLM(config).eval()
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    del model
    n_params = sum(a.size for a in state.values())
    print(f"built a random Llama with transformers: {n_params / 1e9:.2f} B parameters in "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    layer_names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for t in missing:
        start = time.perf_counter()
        qtype = getattr(gguf.GGMLQuantizationType, t.upper())
        tmp = paths[t] + ".part"
        writer = gguf.GGUFWriter(tmp, "llama")
        writer.add_block_count(arch["num_hidden_layers"])
        writer.add_context_length(arch["max_position_embeddings"])
        writer.add_embedding_length(arch["hidden_size"])
        writer.add_feed_forward_length(arch["intermediate_size"])
        writer.add_head_count(arch["num_attention_heads"])
        writer.add_head_count_kv(arch["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(arch["rms_norm_eps"])
        writer.add_rope_freq_base(arch["rope_theta"])
        writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{t.upper()}"))
        _copy_tokenizer(writer, default_model_path())
        for hf_name, w in state.items():
            if hf_name in names:
                name = names[hf_name]
            else:
                _, _, layer, *rest = hf_name.split(".")
                name = f"blk.{layer}.{layer_names['.'.join(rest[:-1])]}.weight"
            if name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = arch["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
                w = _permute_qk(w, heads)
            if w.ndim == 1:
                writer.add_tensor(name, w)
            else:
                writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, paths[t])
        print(f"wrote {paths[t]} ({os.path.getsize(paths[t]) / 1e9:.2f} GB) in "
              f"{time.perf_counter() - start:.1f}s", flush=True)
    return paths


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def measure(path: str, quantization: str, dtype: str, steps: int) -> dict:
    """One variant, in this (fresh) process."""
    import torch

    from tessera import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=path, quantization=quantization, dtype=dtype, max_model_len=512,
              kv_cache_space=0.25, swap_space=0)
    load_s = time.perf_counter() - start
    rss = rss_mb()
    weights = llm.llm_engine.executor.runner.model.weight_bytes()
    gen = torch.Generator().manual_seed(0)
    result = {"load_s": load_s, "rss_mb": rss, "weight_mb": sum(weights.values()) / 2**20}

    def timed(batch: int, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": torch.randint(100, 49000, (PROMPT_LEN,), generator=gen)
                    .tolist()} for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    timed(1, 4)  # warm-up
    for batch in (1, 16):
        base = timed(batch, 1)
        full = timed(batch, 1 + steps)
        result[f"decode@{batch}"] = batch * steps / (full - base)
    return result


VARIANTS = {  # name -> (file type, --quantization, --dtype)
    "q8_0/float32": ("q8_0", "gguf", "float32"),
    "q4_0/float32": ("q4_0", "gguf", "float32"),
    "q8_0/bfloat16": ("q8_0", "gguf", "bfloat16"),
    "bf16": ("q8_0", "none", "bfloat16"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tessera-large-model"))
    ap.add_argument("--variants", default="q8_0/float32,q4_0/float32,bf16",
                    help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--measure", nargs=3, metavar=("PATH", "QUANTIZATION", "DTYPE"),
                    help=argparse.SUPPRESS)  # the child process of one variant
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.steps)))
        return
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    paths = build(args.workdir, sorted({VARIANTS[v][0] for v in variants}))
    if args.build_only:
        return
    rows = {}
    for v in variants:
        file_type, quantization, dtype = VARIANTS[v]
        out = subprocess.run(
            [sys.executable, __file__, "--measure", paths[file_type], quantization, dtype,
             "--steps", str(args.steps)], capture_output=True, text=True, check=True)
        rows[v] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{v}: {rows[v]}", flush=True)
    base = rows.get("bf16")
    print(
        f"\n{'variant':<16}{'load s':>8}{'RSS MiB':>9}{'weights MiB':>12}"
        f"{'b1 tok/s':>10}{'b16 tok/s':>11}"
        + (f"{'b1 vs bf16':>12}{'b16 vs bf16':>13}" if base else "")
    )
    for v, r in rows.items():
        line = (f"{v:<16}{r['load_s']:>8.1f}{r['rss_mb']:>9.0f}{r['weight_mb']:>12.0f}"
                f"{r['decode@1']:>10.2f}{r['decode@16']:>11.1f}")
        if base:
            line += (f"{r['decode@1'] / base['decode@1']:>11.2f}x"
                     f"{r['decode@16'] / base['decode@16']:>12.2f}x")
        print(line)


if __name__ == "__main__":
    main()
