"""Load the draft model of `speculative_config` (method draft_model) and build its proposer: the
same loader as the target (a .gguf file or an HF directory), the same dtype, device and
quantization, and a KV pool with the target's block size: the target's number of blocks (the
draft's cache follows the target's block tables, tessera/worker/spec_decode/draft_model.py), or,
when the target has a sliding window, a pool of its own (`num_draft_gpu_blocks`, sized by
core/admission.py: num_draft_pool_blocks) for the draft's own KV cache group.

A draft must share the target's vocabulary: its token ids are the target's, verified against the
target's logits. Checked here (vocabulary size, and the tokenizers' vocabularies when both have
one), before any memory is spent on its cache."""

from __future__ import annotations

import logging
import os

import torch

from tessera.attention import select_attention_backend
from tessera.config import EngineConfig
from tessera.model.default_model import resolve_model_path
from tessera.model.loader import load_model, weight_quantization
from tessera.model.registry import get_model_class
from tessera.tokenizer import load_tokenizer
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec, kv_cache_torch_dtype
from tessera.worker.spec_decode import DraftModelProposer

logger = logging.getLogger(__name__)


def build_draft_proposer(config: EngineConfig, target_path: str, target_model, target_arch,
                         target_tokenizer, num_gpu_blocks: int, num_cpu_blocks: int,
                         attention_backend: str | None = None,
                         num_draft_gpu_blocks: int = 0) -> DraftModelProposer:
    spec = config.speculative
    assert spec is not None and spec.method == "draft_model" and spec.model is not None
    try:
        path = resolve_model_path(spec.model)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"speculative_config: model {spec.model!r}: {e}") from e
    device = torch.device(config.device.device)
    dtype = getattr(torch, config.model.dtype)
    same = os.path.realpath(path) == os.path.realpath(target_path)
    if same:  # the target drafting for itself: share its weights, keep a KV cache of its own
        arch, model = target_arch, target_model
    else:
        try:
            arch, weights = load_model(path, weight_quantization(
                config.model.quantization, config.model.dtype, config.device.device, path))
        except ValueError as e:
            raise ValueError(f"speculative_config: model {spec.model!r}: {e}") from e
        _check_vocabulary(spec.model, path, arch, target_arch, target_tokenizer)
        model = get_model_class(arch.architecture)(arch, weights, dtype, device,
                                                   config.model.max_model_len)
        del weights
    kv = KVCacheSpec(num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads,
                     head_dim=arch.head_dim, block_size=config.cache.block_size,
                     dtype=kv_cache_torch_dtype(config))
    own = num_draft_gpu_blocks > 0  # its own pool, numbered past the target's blocks
    num_blocks = num_draft_gpu_blocks if own else num_gpu_blocks
    cache = CacheEngine(kv, num_blocks, 0 if own else num_cpu_blocks, device)
    logger.info("draft model %s%s: %d layers, KV cache %d blocks (%.0f MiB)%s",
                os.path.basename(path), " (the target itself)" if same else "",
                arch.num_hidden_layers, num_blocks, num_blocks * kv.block_bytes / 2**20,
                ", a pool of its own (the target's window releases blocks)" if own else "")
    backend = select_attention_backend(device, kv.dtype, config.cache.block_size,
                                       name=attention_backend)
    return DraftModelProposer(model, cache, backend, config.cache.block_size,
                              spec.num_speculative_tokens, config.model.max_model_len, device,
                              own_pool_base=num_gpu_blocks if own else None)


def _check_vocabulary(name: str, path: str, arch, target_arch, target_tokenizer) -> None:
    if arch.vocab_size != target_arch.vocab_size:
        raise ValueError(
            f"speculative_config: model {name!r} has a vocabulary of {arch.vocab_size} tokens, "
            f"the target {target_arch.vocab_size}: a draft model must share the target's "
            "vocabulary (tokenizer)"
        )
    if target_tokenizer is None:
        return
    tokenizer = load_tokenizer(path)
    if tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"speculative_config: model {name!r} has another tokenizer vocabulary than the "
            "target: a draft model must share the target's vocabulary"
        )
