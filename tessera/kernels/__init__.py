"""Hand-written CPU kernels, built just in time (tessera/kernels/build.py), each with a torch
fallback: paged attention, linear layers, fused elementwise ops.

Paged attention is imported from its module (`from tessera.kernels.paged_attention import
paged_attention`), not re-exported here: a package attribute `paged_attention` would be the function
and hide the submodule of the same name from `from tessera.kernels import paged_attention`.
"""

from tessera.kernels.fused import fused_ops_for
from tessera.kernels.linear import PackedLinearWeight, linear_kernel_supported

__all__ = ["PackedLinearWeight", "fused_ops_for", "linear_kernel_supported"]
