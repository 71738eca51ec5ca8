"""The KV cache's config: block size, memory budget, cache dtype, prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float32")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype the KV cache is stored in: "auto" is the compute dtype (`model_dtype`, resolved);
    bfloat16 beside fp32 activations halves KV memory and the bytes attention reads (the kernel
    widens rows on load). ValueError naming the flag for an unknown value."""
    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
            f"got {kv_cache_dtype!r}"
        )
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. The number of device blocks comes from `kv_cache_space` (GiB)
    unless `num_gpu_blocks_override` pins it; the CPU swap pool from `swap_space` (GiB)."""

    block_size: int = 16
    kv_cache_space: float = 1.0
    swap_space: float = 1.0
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True  # vLLM v1's default
    watermark: float = 0.01
    # --kv-cache-dtype (vLLM's CacheConfig.cache_dtype); EngineArgs resolves "auto" to the model
    # dtype, so engine code reads a concrete name (resolve_kv_cache_dtype for direct constructions)
    cache_dtype: str = "auto"
    # the window every layer of the model attends within (Mistral, all-sliding Qwen): blocks a
    # sequence's window has left are released while it runs (core/block_manager.py); None keeps
    # every block (no window, or local and global layers mixed)
    sliding_window: int | None = None
    # each model layer's window (None: full attention) when the model mixes local and global
    # layers (Gemma 2/3): the cache is split into KV cache groups with a block table each
    # (core/kv_cache_groups.py). Empty: one group, every layer in it
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.cache_dtype, "float32")  # validates the name
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.layer_windows and self.sliding_window is not None:
            raise ValueError("CacheConfig: give sliding_window (every layer) or layer_windows "
                             "(mixed layers), not both")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_cache_space <= 0:
            raise ValueError(f"--kv-cache-space must be > 0 GiB, got {self.kv_cache_space}")
        if self.swap_space < 0:
            raise ValueError(f"--swap-space must be >= 0 GiB, got {self.swap_space}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"--num-gpu-blocks-override must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
