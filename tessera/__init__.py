"""Tessera: an LLM serving engine with continuous batching over a paged KV cache."""

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput",
           "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # lazy, so that `import tessera.core.scheduler` does not load torch and the model stack
    if name == "LLM":
        from tessera.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutputKind"):
        from tessera.sampling import params

        return getattr(params, name)
    if name == "PoolingParams":
        from tessera.pooling_params import PoolingParams

        return PoolingParams
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput"):
        from tessera import outputs

        return getattr(outputs, name)
    if name == "LoRARequest":
        from tessera.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
