"""Engine configuration: frozen dataclasses, validated on construction.

`EngineArgs` is the flat set of user-facing knobs (the same names for `LLM(**kwargs)` and for
`tessera serve --flag`); `EngineArgs.create_engine_config()` turns it into the per-part configs once
the model's own limits are known. Nothing here reads files or touches tensors.

One module a part: model (weights, dtype, quantization, device), cache, scheduler, speculative,
kv_transfer, parallel, pooler, lora; engine holds them together; engine_args builds them. Import
from `tessera.config`, which re-exports them all.
"""

from tessera.config.cache import KV_CACHE_DTYPE_CHOICES, CacheConfig, resolve_kv_cache_dtype
from tessera.config.common import GiB, config_dict, flag_name
from tessera.config.engine import EngineConfig
from tessera.config.engine_args import DEFAULT_CHUNKED_PREFILL_BUDGET, EngineArgs
from tessera.config.kv_transfer import KV_CONNECTORS, KV_ROLES, KVTransferConfig
from tessera.config.lora import LoRAConfig
from tessera.config.model import (
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_DEFAULT,
    RESOLVED_DTYPES,
    DeviceConfig,
    ModelConfig,
    resolve_dtype,
)
from tessera.config.parallel import ParallelConfig, default_num_threads
from tessera.config.pooler import POOLING_TYPES, PoolerConfig
from tessera.config.scheduler import PreemptionMode, SchedulerConfig, SchedulingPolicy
from tessera.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig

__all__ = [
    "DEFAULT_CHUNKED_PREFILL_BUDGET",
    "DTYPE_CHOICES",
    "KV_CACHE_DTYPE_CHOICES",
    "KV_CONNECTORS",
    "KV_ROLES",
    "POOLING_TYPES",
    "QUANTIZATION_CHOICES",
    "QUANTIZATION_DEFAULT",
    "RESOLVED_DTYPES",
    "SPECULATIVE_METHODS",
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "GiB",
    "KVTransferConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "PoolerConfig",
    "PreemptionMode",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SpeculativeConfig",
    "config_dict",
    "default_num_threads",
    "flag_name",
    "resolve_dtype",
    "resolve_kv_cache_dtype",
]
