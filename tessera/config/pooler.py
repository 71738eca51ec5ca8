"""Embedding and pooling models' config (`--override-pooler-config`)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.common import config_dict

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_POOLER_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """How `/v1/embeddings` and `LLM.embed` turn a prompt's final (normed) hidden states into one
    vector (vLLM's names and defaults for a decoder LM): LAST takes the last token's state (the
    only one that has seen the whole prompt under causal attention), MEAN averages every
    position, CLS takes the first; `normalize` scales the result to unit L2 norm."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config: normalize must be true or false, "
                             f"got {self.normalize!r}")

    @classmethod
    def from_dict(cls, value: dict | str | PoolerConfig | None) -> PoolerConfig:
        """From `LLM(pooler_config={...})` or the JSON of `--pooler-config`; None: the defaults."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        value = config_dict(value, "pooler_config", _POOLER_KEYS)
        if isinstance(value.get("pooling_type"), str):  # vLLM spells them in capitals
            value = {**value, "pooling_type": value["pooling_type"].upper()}
        return cls(**value)
