"""Logits at every prompt position of a model file, through the engine's own loader, model and
paged runner (one sequence, fp32, a small CPU cache): what the tiny-file tests hold against HF."""

from __future__ import annotations

import torch

from tessera.model.loader import load_model
from tessera.model.registry import get_model_class
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
from tessera.worker.model_runner import ModelRunner
from tessera.worker.static_batch import StaticBatch


def model_logits(path: str, prompt: list[int], quantization: str = "none",
                 weights_check=None) -> torch.Tensor:
    """[len(prompt), vocab] float32. `weights_check(weights)`, if given, sees the loaded
    weights first (whether a tensor stayed quantized, say)."""
    cfg, weights = load_model(path, quantization)
    if weights_check is not None:
        weights_check(weights)
    cpu, bs = torch.device("cpu"), 8
    ours = get_model_class(cfg.architecture)(cfg, weights, torch.float32, cpu, 256)
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs,
                       torch.float32)
    batch = StaticBatch(ModelRunner(ours, CacheEngine(spec, 16, 0, cpu), bs, cpu), bs)
    return batch.logits([batch.new_seq(prompt, len(prompt))], all_positions=True).float()
