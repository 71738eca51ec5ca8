"""What crosses a link, priced: the all-reduces of a tensor-parallel step and the KV a
disaggregated prefill ships to its decode peer.

Both use one link model, latency plus bytes over bandwidth, with the numbers of the hardware spec
(data/hardware.json: `tp_link` between the devices of one node, `kv_link` between a prefill and a
decode instance), each with its source:

    ring all-reduce of B bytes over N ranks   2 (N - 1) * latency + 2 (N - 1) / N * B / bandwidth
    one step of a TP=N engine                 (2 layers + 1) all-reduces of tokens x hidden
                                              activations (tessera/distributed/traffic.py), plus
                                              the logits of each sampled token gathered to rank 0
    a request's KV pull                       latency + prompt KV bytes / bandwidth

Why a ring: NCCL's and gloo's default for the payloads of a step (hundreds of KiB), and the
formula the TP docs use (docs/tensor_parallel.md). The step's all-reduces are charged as
blocking, as our runner does them (no overlap with compute). A KV pull is asynchronous (the
consumer's step loop never waits, tessera/core/kv_connector.py): it delays the request's first
decode, not anybody's step.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.distributed.traffic import TPTraffic, tp_traffic
from tessera.simulator.batch import BatchShape


@dataclass(frozen=True)
class LinkSpec:
    """One link: `latency_s` per message (per ring step), `bandwidth` bytes/s one way."""

    latency_s: float
    bandwidth: float
    source: str = ""

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth <= 0:
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {self}")

    def transfer_time(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth


def ring_all_reduce_time(num_bytes: float, world_size: int, link: LinkSpec) -> float:
    """Seconds for a ring all-reduce of `num_bytes` over `world_size` ranks (0 for one rank)."""
    n = world_size
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * num_bytes / link.bandwidth


@dataclass(frozen=True)
class TensorParallelCost:
    """The communication of one step of a `world_size`-rank engine over `link`."""

    world_size: int
    traffic: TPTraffic
    hidden_bytes_per_token: int  # one all-reduce's payload per token (hidden x activation bytes)
    link: LinkSpec

    @classmethod
    def for_model(cls, world_size: int, num_layers: int, hidden_size: int, vocab_size: int,
                  act_bytes: int, link: LinkSpec) -> TensorParallelCost:
        return cls(world_size, tp_traffic(num_layers, hidden_size, vocab_size, act_bytes),
                   hidden_size * act_bytes, link)

    def all_reduce_time(self, batch: BatchShape) -> float:
        n = self.world_size
        if n <= 1 or batch.num_tokens == 0:
            return 0.0
        payload = batch.num_tokens * self.hidden_bytes_per_token
        reduces = self.traffic.num_all_reduces_per_step * ring_all_reduce_time(payload, n,
                                                                                self.link)
        # rank 0 gathers the other ranks' logits shards of every sampled token
        gathered = batch.num_seqs * self.traffic.gather_bytes_per_sampled_token * (n - 1) / n
        return reduces + self.link.transfer_time(gathered)


def parse_link(spec: dict | None, what: str) -> LinkSpec | None:
    if spec is None:
        return None
    try:
        return LinkSpec(float(spec["latency_s"]), float(spec["bandwidth"]),
                        str(spec.get("source", "")))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{what}: a link needs latency_s and bandwidth ({e})") from None
