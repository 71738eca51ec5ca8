"""Small helpers shared across layers. Torch-free, so `tessera/core` may import it."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Integer ceiling division: how many blocks of `b` hold `a` items (blocks for a sequence's
    tokens, for example). Exact for any int size, unlike `math.ceil(a / b)`, which rounds through a
    float; and one named home instead of the unreadable `-(-a // b)` idiom at every call site."""
    return -(-a // b)
