"""Hand-written CPU kernels, built just in time (tessera/kernels/build.py), each with a torch
fallback: paged attention, linear layers, fused elementwise ops."""

from tessera.kernels.fused import fused_ops_for
from tessera.kernels.linear import PackedLinearWeight, linear_kernel_supported
from tessera.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_available,
)

__all__ = [
    "PackedLinearWeight",
    "fused_ops_for",
    "linear_kernel_supported",
    "paged_decode_attention",
    "paged_decode_attention_available",
]
