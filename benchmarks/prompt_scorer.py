"""All-position logits of one sequence at a time, the way benchmarks/perplexity.py and
benchmarks/int8_agreement.py score text: the model loaded as `--quantization` and `--dtype` would
load it (tessera/model/loader.py's weight_quantization), one prefill a sequence on a KV cache
sized for the longest."""

from __future__ import annotations

import torch


class PromptScorer:
    def __init__(self, path: str, quantization: str, dtype: str, max_len: int,
                 block_size: int = 16):
        from tessera.model.llama import LlamaForCausalLM
        from tessera.model.loader import load_model, weight_quantization
        from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
        from tessera.worker.model_runner import ModelRunner

        cpu, torch_dtype = torch.device("cpu"), getattr(torch, dtype)
        cfg, weights = load_model(path, weight_quantization(quantization, dtype, "cpu", path))
        model = LlamaForCausalLM(cfg, weights, torch_dtype, cpu, max_len + block_size)
        del weights
        spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                           block_size, torch_dtype)
        cache = CacheEngine(spec, -(-max_len // block_size) + 1, 0, cpu)
        self.runner = ModelRunner(model, cache, block_size, cpu)
        self.block_size = block_size

    @torch.inference_mode()
    def __call__(self, ids: list[int]) -> torch.Tensor:
        """float32 logits [len(ids), vocab]: position i's prediction of token i + 1."""
        from tessera.worker.static_batch import StaticBatch

        batch = StaticBatch(self.runner, self.block_size)  # fresh blocks for each sequence
        return batch.logits([batch.new_seq(ids, len(ids))], all_positions=True).float()
