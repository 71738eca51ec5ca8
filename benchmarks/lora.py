"""Multi-LoRA throughput: workload W1 (benchmarks/throughput.py) on the default model with 4 LoRA
adapters of rank 16 (all seven projections, every layer) spread round-robin over the requests,
against the base model alone, in one run and one engine (the same weights, cache and threads).

    python benchmarks/lora.py [--num-requests 64] [--rank 16] [--num-adapters 4] [--rounds 1]
                              [--dtype auto] [--max-loras 4]

Prints useful output tok/s of both runs (per round, then the best of each) and their ratio
(target: >= 0.8 at rank 16). The adapters are random, written in PEFT's format to a temporary
directory, so no model hub is needed. Time it under `flock -x /work/cpu.lock` on a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from throughput import workload  # noqa: E402

from tessera import LLM, LoRARequest, SamplingParams  # noqa: E402
from tessera.lora.peft import target_shapes  # noqa: E402


def write_adapter(path: str, arch, rank: int, seed: int) -> None:
    """A random PEFT adapter of `rank` on every target of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(arch.num_hidden_layers):
        for target, (out_f, in_f) in target_shapes(arch).items():
            kind = "self_attn" if target[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{i}.{kind}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": sorted(target_shapes(arch))}, f)


def run(llm: LLM, prompts, params, loras) -> float:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--max-loras", type=int, default=None, help="default: --num-adapters")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    max_loras = args.max_loras or args.num_adapters
    llm = LLM(enable_lora=True, max_loras=max_loras, max_lora_rank=max(args.rank, 16),
              max_cpu_loras=max(max_loras, args.num_adapters), dtype=args.dtype)
    arch = llm.llm_engine.model_arch
    tmp = tempfile.mkdtemp(prefix="tessera-lora-bench-")
    adapters = []
    for k in range(args.num_adapters):
        path = os.path.join(tmp, f"adapter{k}")
        write_adapter(path, arch, args.rank, seed=k)
        adapters.append(LoRARequest(f"adapter{k}", k + 1, path))
    prompts, out_lens = workload(args.num_requests)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
    # warm-up: kernels, adapters loaded and packed
    run(llm, prompts[:4], params[:4], spread[:4])

    base_runs, lora_runs = [], []
    for r in range(args.rounds):
        # LoRA first in even rounds: whatever a first pass pays (the cache's pages, new batch
        # shapes) counts against the adapters, not for them
        if r % 2 == 0:
            lora_runs.append(run(llm, prompts, params, spread))
            base_runs.append(run(llm, prompts, params, None))
        else:
            base_runs.append(run(llm, prompts, params, None))
            lora_runs.append(run(llm, prompts, params, spread))
        print(f"round {r}: base {base_runs[-1]:.1f} tok/s, {args.num_adapters} adapters "
              f"(rank {args.rank}) {lora_runs[-1]:.1f} tok/s")
    base, lora = max(base_runs), max(lora_runs)
    print(f"W1 ({len(prompts)} requests, {sum(out_lens)} output tokens), "
          f"{llm.llm_engine.config.model.dtype}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads")
    print(f"base alone: {base:.1f} tok/s; {args.num_adapters} adapters of rank {args.rank} "
          f"(--max-loras {max_loras}): {lora:.1f} tok/s; ratio {lora / base:.2f}x")


if __name__ == "__main__":
    main()
