"""Attention backends: how a step's queries attend to the paged KV cache.

The runner chooses a backend once (`select_attention_backend`) and asks it, once per step, for the
step's `AttentionMetadata` (`build_metadata`); the model's attention layer calls
`meta.forward(q, k, v, k_cache, v_cache, scale)`. backend.py holds the seam and its ordering
contract, selector.py the choice; paged_kernel.py (the C++ kernel, CPU) and sdpa.py (torch SDPA:
CUDA and the fallback) the
two implementations. Imports neither tessera.worker nor tessera.core: the model and the worker both
import it.
"""

from tessera.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    SeqSpan,
    is_decode,
    write_kv,
)
from tessera.attention.selector import select_attention_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "SeqSpan",
    "is_decode",
    "select_attention_backend",
    "write_kv",
]
