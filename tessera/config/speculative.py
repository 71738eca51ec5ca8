"""Speculative decoding's config (`--speculative-config`)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.common import config_dict

SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = (
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
    "disable_by_batch_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's names): a proposer guesses up to `num_speculative_tokens`
    next tokens of a decoding request, the target model verifies them all in one forward pass, and
    the request advances by the accepted ones.

    `ngram`: prompt lookup, the last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) matched against the request's prompt + output. `draft_model`: a smaller
    model at `model`. `disable_by_batch_size`: no proposals while a step runs at least that many
    requests (a big batch is compute-bound on CPU, so verifying drafts there only costs)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config: {key} must be an integer >= 1, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        dbs = self.disable_by_batch_size
        if dbs is not None and (not isinstance(dbs, int) or isinstance(dbs, bool) or dbs < 1):
            raise ValueError(
                f"speculative_config: disable_by_batch_size must be an integer >= 1, got {dbs!r}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: model (the draft model's path) is required "
                                 "for method draft_model")
        elif self.model is not None:
            raise ValueError(f"speculative_config: model is only for method draft_model, "
                             f"not {self.method}")

    @classmethod
    def from_dict(cls, value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From `LLM(speculative_config={...})` or the JSON of `--speculative-config`."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = config_dict(value, "speculative_config", _SPEC_KEYS)
        if "method" not in value:
            raise ValueError(f"speculative_config: method is required (one of "
                             f"{', '.join(SPECULATIVE_METHODS)})")
        return cls(**value)

    def is_enabled_for(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` requests speculates at all (the one home of the rule)."""
        return self.disable_by_batch_size is None or batch_size < self.disable_by_batch_size
