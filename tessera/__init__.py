"""Tessera: an LLM serving engine with continuous batching over a paged KV cache."""

from tessera.entrypoints.llm import LLM
from tessera.outputs import CompletionOutput, RequestOutput
from tessera.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
