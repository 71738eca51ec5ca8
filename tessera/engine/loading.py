"""Assemble an engine from `EngineArgs`: resolve and load the model, size the KV pools, build the
runner. Kept apart from `LLMEngine` so the engine itself can be built from parts in tests."""

from __future__ import annotations

import logging
import os
import time

import torch

from tessera.config import EngineArgs, default_num_threads
from tessera.model.default_model import resolve_model_path
from tessera.model.loader import load_model
from tessera.model.registry import get_model_class
from tessera.tokenizer import load_tokenizer
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
from tessera.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def build_engine(engine_cls, args: EngineArgs):
    start = time.perf_counter()
    path = resolve_model_path(args.model)
    arch, weights = load_model(path)
    config = args.create_engine_config(arch.max_position_embeddings)
    torch.set_num_threads(default_num_threads())
    torch.manual_seed(config.model.seed)
    device = torch.device(config.device.device)
    dtype = getattr(torch, config.model.dtype)
    model_cls = get_model_class(arch.architecture)
    model = model_cls(arch, weights, dtype, device, config.model.max_model_len)
    del weights

    spec = KVCacheSpec(
        num_layers=arch.num_hidden_layers,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        block_size=config.cache.block_size,
        dtype=dtype,
    )
    num_gpu_blocks = config.cache.num_gpu_blocks_override or spec.num_blocks_for(config.cache.kv_cache_space)
    if num_gpu_blocks < 1:
        raise ValueError(
            f"--kv-cache-space {config.cache.kv_cache_space} GiB holds no block of "
            f"{spec.block_bytes} bytes: raise it"
        )
    num_cpu_blocks = spec.num_blocks_for(config.cache.swap_space)
    cache_engine = CacheEngine(spec, num_gpu_blocks, num_cpu_blocks, device)
    tokenizer = load_tokenizer(path)
    eos = tuple(arch.eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    runner = ModelRunner(model, cache_engine, config.cache.block_size, device, eos_token_ids=eos)
    logger.info(
        "engine ready in %.1fs: %s, %s, %d device blocks (%d tokens), %d swap blocks",
        time.perf_counter() - start, os.path.basename(path), config.model.dtype,
        num_gpu_blocks, num_gpu_blocks * config.cache.block_size, num_cpu_blocks,
    )
    return engine_cls(
        config,
        runner,
        tokenizer,
        eos_token_ids=eos,
        vocab_size=arch.vocab_size,
        model_name=os.path.basename(path.rstrip("/")),
    )
