"""Cost models: how long one engine step takes, as a function of its batch (`BatchShape`).

    step_time = compute_time + swap_time + all_reduce_time

`compute_time` and `swap_time` are each model's own: `ProfiledCostModel` (a fit to timings of the
real runner on this machine, `tessera simulate calibrate`) or `RooflineCostModel`
(tessera/simulator/roofline.py: FLOPs and bytes against a hardware spec).

`all_reduce_time` is tensor parallelism's: the ring all-reduces of a TP group over the hardware's
`tp_link` (tessera/simulator/parallel.py), 0 for one rank. `kv_transfer_time` is disaggregated
prefill's, and is no part of a step: a consumer's KV pull runs beside the step loop and delays
only its own request's first decode (tessera/simulator/disagg.py). Speculative decoding's seam is
the runner's acceptance model (tessera/simulator/spec_decode.py).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass

from tessera.config import CacheConfig
from tessera.core.kv_cache_groups import kv_cache_groups
from tessera.simulator.batch import BatchShape
from tessera.simulator.parallel import LinkSpec, TensorParallelCost, parse_link
from tessera.utils import kv_bytes_per_token

# the features of the profiled model, in order: (name, BatchShape attribute or None for 1). A
# context token is priced once per distinct block it lives in; a shared one (a block another
# sequence of the step also reads, a cached prefix) at its own, lower rate: the second reader
# finds the block in the CPU's cache (tessera/core/context_sharing.py)
FEATURES: tuple[tuple[str, str | None], ...] = (
    ("step", None),
    ("prefill_token", "num_prefill_tokens"),
    ("decode_token", "num_decode_tokens"),
    ("context_token", "num_distinct_context_tokens"),
    ("seq", "num_seqs"),
    ("attention_pair", "num_attention_pairs"),
    ("shared_context_token", "num_shared_context_tokens"),
)


# the serving overhead's rates (tessera/simulator/serving.py), in the same form: profile key,
# BatchShape attribute it multiplies or None for one per step
SERVING_FEATURES: tuple[tuple[str, str | None], ...] = (
    ("serving_s_per_step", None),
    ("serving_s_per_seq", "num_seqs"),
    ("serving_s_per_prefill_token", "num_prefill_tokens"),
)


def features(batch: BatchShape, spec: tuple[tuple[str, str | None], ...] = FEATURES) -> list[float]:
    return [1.0 if attr is None else float(getattr(batch, attr)) for _, attr in spec]


@dataclass(frozen=True)
class KVGeometry:
    """What sizing the KV pools needs, as the engine does it (tessera/engine/loading.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    elem_size: int

    def block_bytes(self, block_size: int) -> int:
        return block_size * kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                               self.elem_size)

    def pool_block_bytes(self, cache: CacheConfig) -> int:
        """Bytes of one pool block under `cache`: every layer's, or, with KV cache groups (a
        model mixing local and global layers, `cache.layer_windows`), one group's layers."""
        if not cache.layer_windows:
            return self.block_bytes(cache.block_size)
        group_size = len(kv_cache_groups(cache.layer_windows)[0].layers)
        return cache.block_size * kv_bytes_per_token(group_size, self.num_kv_heads,
                                                     self.head_dim, self.elem_size)


class CostModel(ABC):
    """Step time of a batch; `geometry` and `max_model_len` describe the model it prices."""

    name: str
    geometry: KVGeometry
    max_model_len: int  # the model's own limit (the default of --max-model-len, capped at 2048)
    # seconds between a client's send and the engine's arrival of its request that no step
    # explains (HTTP, tokenizer, streaming back: serving.py measures it); the simulator hands
    # each request to the scheduler this long after its send
    request_latency_s: float = 0.0
    tp: TensorParallelCost | None = None  # the TP group's communication, None for one rank
    kv_link: LinkSpec | None = None  # where a disaggregated consumer pulls KV from

    def step_time(self, batch: BatchShape) -> float:
        return self.compute_time(batch) + self.swap_time(batch) + self.all_reduce_time(batch)

    @abstractmethod
    def compute_time(self, batch: BatchShape) -> float:
        """The forward pass, sampling and the engine's own per-step work."""

    @abstractmethod
    def swap_time(self, batch: BatchShape) -> float:
        """Moving `batch.swap_bytes` of KV between the device and swap space."""

    def all_reduce_time(self, batch: BatchShape) -> float:
        """Tensor parallelism's collectives in this step (blocking, as the runner does them)."""
        return 0.0 if self.tp is None else self.tp.all_reduce_time(batch)

    def kv_transfer_time(self, num_tokens: int) -> float:
        """Seconds to pull `num_tokens` tokens of KV (every layer, K and V, this rank's heads)
        from a prefill instance over `kv_link`."""
        if self.kv_link is None:
            raise ValueError("this cost model has no kv_link to price a KV transfer over")
        return self.kv_link.transfer_time(num_tokens * self.geometry.block_bytes(1))

    def describe(self) -> dict:
        return {"cost_model": self.name}


class ProfiledCostModel(CostModel):
    """A linear model over `FEATURES`, fitted by `tessera simulate calibrate` (see fit.py for the
    fit and why), a per-byte swap cost measured on the same machine, and optionally the serving
    overhead measured and fitted from real server runs (serving.py)."""

    name = "profiled"

    def __init__(self, profile: dict, path: str | None = None) -> None:
        try:
            coefs = dict(profile["coefficients"])
            # a profile whose grid had no shared blocks (calibrated before shared-prefix shapes
            # were in it) knows one rate for every context token
            coefs.setdefault("shared_context_token", coefs["context_token"])
            self.coefficients = [float(coefs[name]) for name, _ in FEATURES]
            self.swap_s_per_byte = float(profile["swap_s_per_byte"])
            # time around the runner behind the server (tessera/simulator/serving.py): per
            # step, per sequence and per prefill token, and the latency outside the engine; all
            # 0 if the profile was calibrated on the runner alone
            self.serving_rates = [float(profile.get(name, 0.0)) for name, _ in SERVING_FEATURES]
            self.request_latency_s = float(profile.get("request_latency_s", 0.0))
            # this machine's link between a prefill and a decode instance (calibrate copies it
            # from the hardware spec of the machine, cpu-zen4-2core here)
            self.kv_link = parse_link(profile.get("kv_link"), f"--profile {path or ''} kv_link")
            g = profile["kv_geometry"]
            self.geometry = KVGeometry(g["num_layers"], g["num_kv_heads"], g["head_dim"],
                                       g["elem_size"])
            self.dtype = profile["dtype"]
            self.max_model_len = int(profile["max_position_embeddings"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"--profile {path or ''}: not a calibration profile ({e})") from None
        self.profile = profile
        self.path = path

    @classmethod
    def load(cls, path: str) -> ProfiledCostModel:
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f), path)

    def compute_time(self, batch: BatchShape) -> float:
        if batch.num_tokens == 0:
            return 0.0
        runner = sum(c * x for c, x in zip(self.coefficients, features(batch), strict=True))
        serving = sum(r * x for r, x in zip(self.serving_rates,
                                             features(batch, SERVING_FEATURES), strict=True))
        return runner + serving

    def swap_time(self, batch: BatchShape) -> float:
        return batch.swap_bytes * self.swap_s_per_byte

    def describe(self) -> dict:
        return {"cost_model": self.name, "profile": self.path, "model": self.profile.get("model"),
                "dtype": self.dtype, "fit": self.profile.get("fit"),
                **{name: r for (name, _), r in zip(SERVING_FEATURES, self.serving_rates,
                                                    strict=True)},
                "request_latency_s": self.request_latency_s}
