"""Expert parallelism against slicing every expert, on this machine: decode tok/s of a random
Qwen3-MoE at TP=1, TP=2 (each expert sliced in two) and EP=2 (`-tp 2 --enable-expert-parallel`:
whole experts, 8 per rank), at batch 1 and 16, in one run; and each rank's weight bytes.

    flock -x /work/cpu.lock python benchmarks/expert_parallel.py [--decode-tokens 64]

The model (fp32 safetensors, written to a temporary directory): hidden 512, 8 layers, 8 heads
(4 KV heads) of 64, 16 experts of width 512 with top-2 on every layer, vocabulary 4096: 110 M
parameters, 22 M active a token. A decode time is the time of max_tokens = 1 + N minus that of
max_tokens = 1 (the prefill), over B prompts of 32 tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from tessera import LLM, SamplingParams


def build_model(path: str) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                            moe_intermediate_size=512, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).eval().save_pretrained(path)


def decode_tok_s(llm: LLM, batch: int, n: int) -> float:
    prompts = [{"prompt_token_ids": [(7 * i + j) % 4000 + 10 for j in range(32)]}
               for i in range(batch)]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    timed(1 + n)  # warm-up: kernels, packing, first-touch pages
    return batch * n / (timed(1 + n) - timed(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    variants = {"tp1": {}, "tp2-sliced": {"tensor_parallel_size": 2},
                "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as path:
        build_model(path)
        for name, kw in variants.items():
            llm = LLM(model=path, max_model_len=512, **kw)
            try:
                ex = llm.llm_engine.executor
                infos = getattr(ex, "rank_infos", None)
                weights = ([i.weight_bytes for i in infos] if infos
                           else [sum(ex.runner.model.weight_bytes().values())])
                results[name] = {"weight_mib_per_rank": [round(w / 2**20, 1) for w in weights]}
                for batch in (1, 16):
                    results[name][f"decode_tok_s_b{batch}"] = round(
                        decode_tok_s(llm, batch, args.decode_tokens), 1)
            finally:
                llm.llm_engine.shutdown()
            print(name, results[name], flush=True)
    print(f"{'variant':<12} {'MiB/rank':>16} {'b1 tok/s':>9} {'b16 tok/s':>10}")
    for name, r in results.items():
        print(f"{name:<12} {str(r['weight_mib_per_rank']):>16} {r['decode_tok_s_b1']:>9} "
              f"{r['decode_tok_s_b16']:>10}")
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
