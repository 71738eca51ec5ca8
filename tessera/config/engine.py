"""The per-part configs of one engine, built once by `EngineArgs.create_engine_config()`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.config.cache import CacheConfig
from tessera.config.kv_transfer import KVTransferConfig
from tessera.config.lora import LoRAConfig
from tessera.config.model import DeviceConfig, ModelConfig
from tessera.config.parallel import ParallelConfig
from tessera.config.pooler import PoolerConfig
from tessera.config.scheduler import SchedulerConfig
from tessera.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None
    pooler: PoolerConfig = field(default_factory=PoolerConfig)
    lora: LoRAConfig | None = None  # None: --enable-lora is off

    def __post_init__(self) -> None:
        # tensor-parallel ranks build their runners without a draft model: refuse rather than
        # run the target alone under a config that asked for drafts
        if (self.parallel.tensor_parallel_size > 1 and self.speculative is not None
                and self.speculative.method == "draft_model"):
            raise ValueError("speculative_config: method draft_model does not run with "
                             f"--tensor-parallel-size {self.parallel.tensor_parallel_size} "
                             "(ngram does)")
        if self.lora is not None and self.kv_transfer is not None:
            # a request whose KV a peer computed joins the running batch outside admission,
            # where the --max-loras limit is kept
            raise ValueError("--enable-lora does not run with --kv-transfer-config yet")
        if self.parallel.tensor_parallel_size > 1 and self.kv_transfer is not None:
            # the connector's worker half lives beside one runner; ranks would each hold a shard
            raise ValueError("kv_transfer_config does not run with --tensor-parallel-size "
                             f"{self.parallel.tensor_parallel_size} yet: disaggregate TP=1 engines")
