"""Small helpers shared across layers. Torch-free, so `tessera/core` may import it."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Integer ceiling division: how many blocks of `b` hold `a` items (blocks for a sequence's
    tokens, for example). Exact for any int size, unlike `math.ceil(a / b)`, which rounds through a
    float; and one named home instead of the unreadable `-(-a // b)` idiom at every call site."""
    return -(-a // b)


def token_range(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] without concatenating the two (a per-step path: a decode
    reads one token of a long sequence)."""
    num_prompt = len(prompt)
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    if end <= num_prompt:
        return prompt[start:end]
    return prompt[start:] + output[: end - num_prompt]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, elem_size: int) -> int:
    """KV cache bytes one token takes across all layers, K and V. The one home of this rule: the
    cache engine sizes its pools with it and the simulator (tessera/simulator) counts blocks and
    KV traffic with it."""
    return 2 * num_layers * num_kv_heads * head_dim * elem_size
