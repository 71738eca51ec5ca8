"""What a tensor-parallel step sends, from the model's shapes alone (no torch): the numbers
behind "what would change with N devices and a fast interconnect" (docs/tensor_parallel.md).

Per token and layer, two all-reduces of the hidden state (after o_proj and after down_proj), one
more for the vocab-parallel embedding, and the logits shards gathered for each sampled token. A
ring all-reduce of B bytes moves 2 (N - 1) / N * B through each rank's link.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPTraffic:
    all_reduce_bytes_per_token: int  # the payload summed, per token, all layers + embedding
    gather_bytes_per_sampled_token: int  # float32 logits of the whole vocabulary, to rank 0
    num_all_reduces_per_step: int

    def link_bytes_per_token(self, world_size: int) -> float:
        """Bytes each rank's link carries per token for the all-reduces (ring algorithm)."""
        return 2 * (world_size - 1) / world_size * self.all_reduce_bytes_per_token


def tp_traffic(num_layers: int, hidden_size: int, vocab_size: int, act_bytes: int) -> TPTraffic:
    per_layer = 2 * hidden_size * act_bytes
    return TPTraffic(
        all_reduce_bytes_per_token=num_layers * per_layer + hidden_size * act_bytes,
        gather_bytes_per_sampled_token=vocab_size * 4,
        num_all_reduces_per_step=2 * num_layers + 1,
    )
