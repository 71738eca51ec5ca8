"""`PoolingParams`: what an embedding request asks for instead of `SamplingParams` (vLLM's name).

A request that carries these is prefill-only: the scheduler runs its prompt like any other (token
budget, chunked prefill, prefix caching, preemption), the runner pools the final hidden states of
its prompt instead of sampling, and the request finishes in the step that completes the prompt,
so it never holds a decode seat. Torch-free: it travels in `NewRequestData` to the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config import POOLING_TYPES, PoolerConfig


@dataclass(frozen=True)
class PoolingParams:
    """`normalize` None: the server's `--pooler-config` decides. `dimensions` is OpenAI's
    truncation of the vector (Matryoshka models only): no model served here is trained for it,
    so any value is refused rather than silently cutting an embedding that was not made for it.
    `pooling_type` is filled in by the engine from its `PoolerConfig` (`resolve`)."""

    normalize: bool | None = None
    dimensions: int | None = None
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None:
            raise ValueError(f"dimensions ({self.dimensions}) is not supported: this model's "
                             "embeddings cannot be shortened (it is not a Matryoshka model); "
                             "leave dimensions out")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")

    def clone(self) -> PoolingParams:
        """Frozen: one object serves every prompt of a request (SamplingParams' interface)."""
        return self

    def resolve(self, config: PoolerConfig) -> PoolingParams:
        """These params with the engine's defaults filled in (what the runner reads)."""
        return PoolingParams(
            normalize=config.normalize if self.normalize is None else self.normalize,
            pooling_type=self.pooling_type or config.pooling_type,
        )

    @property
    def needs_every_position(self) -> bool:
        """MEAN reads every prompt position's hidden state and CLS the first: neither can start
        from a prefix-cache hit (those positions are never computed). LAST reads only the last,
        which a hit never covers."""
        return self.pooling_type != "LAST"
