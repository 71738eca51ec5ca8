"""Hand-written CPU kernels, built just in time, each with a pure-torch fallback."""

from tessera.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_available,
)

__all__ = ["paged_decode_attention", "paged_decode_attention_available"]
