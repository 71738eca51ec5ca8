"""`SamplingParams`: how one request wants its tokens chosen and when it stops.

Names, defaults and validation follow vLLM so that users feel at home. Every bad value raises
`ValueError` whose message starts with the field's name ("temperature must be >= 0, got -1").
The sampler (`tessera/sampling/sampler.py`) reads the sampling fields; the scheduler's stop rules
(`tessera/core/stop_conditions.py`) read `stop_token_ids`, `ignore_eos`, `max_tokens`,
`min_tokens`, and the engine's output processor reads `stop` and `output_kind`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from tessera.sampling.structured_outputs import StructuredOutputsParams

# Below this temperature a request is greedy: dividing logits by ~0 only overflows.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries per request (OpenAI documents no limit; vLLM's is the vocab)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_key(key: Any) -> Any:
    """OpenAI sends logit_bias keys as strings of token ids (JSON objects have string keys)."""
    if isinstance(key, str) and key.isdigit() and len(key) <= 19:
        return int(key)
    return key


def _is_real(x: Any) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool)) and math.isfinite(x)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)  # also accepts a str or None
    stop_token_ids: list[int] = field(default_factory=list)  # also accepts None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per generated token (the chosen one always)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # what each RequestOutput carries: everything so far, only what is new, or only the final one
    output_kind: RequestOutputKind = field(default_factory=lambda: RequestOutputKind.CUMULATIVE)
    # a JSON schema, regex, choice or grammar the output must match (also accepts a dict)
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> added to its logit before sampling (OpenAI: [-100, 100]); also accepts str keys
    logit_bias: dict[int, float] | None = None
    # only these token ids may be sampled (vLLM's extra)
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        # normalise the forms vLLM accepts before validating
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop) if isinstance(self.stop, list | tuple) else self.stop
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        need(_is_int(self.n), "n", "an int")
        need(self.n >= 1, "n", ">= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            need(_is_real(getattr(self, name)), name, "a finite number")
        need(self.temperature >= 0, "temperature", ">= 0")
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(_is_int(self.top_k), "top_k", "an int")
        need(self.top_k == -1 or self.top_k >= 0, "top_k", "-1 or 0 (off) or >= 1")
        need(0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(self.seed is None or _is_int(self.seed), "seed", "an int or None")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        need(self.repetition_penalty > 0, "repetition_penalty", "> 0")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop", "a string or a list of non-empty strings")
        need(isinstance(self.stop_token_ids, list)
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "a list of non-negative ints")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            need(isinstance(getattr(self, name), bool), name, "a bool")
        need(self.max_tokens is None or _is_int(self.max_tokens), "max_tokens", "an int or None")
        need(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1 or None")
        need(_is_int(self.min_tokens), "min_tokens", "an int")
        need(self.min_tokens >= 0, "min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        need(isinstance(self.output_kind, RequestOutputKind), "output_kind",
             "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(value is None or _is_int(value), name, "an int or None")
            need(value is None or 0 <= value <= MAX_LOGPROBS, name, f"in [0, {MAX_LOGPROBS}]")
        need(self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "a StructuredOutputsParams or a dict")
        need(self.logit_bias is None or (
            isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
            and all(_is_int(k) and k >= 0 and _is_real(v) and -100 <= v <= 100
                    for k, v in self.logit_bias.items())),
            "logit_bias", f"a map of at most {MAX_LOGIT_BIAS} token ids (>= 0) to biases in "
                          "[-100, 100]")
        need(self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
            and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids", "a non-empty list of non-negative token ids")

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids this request names exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} holds token id {bad[0]}, outside the vocabulary "
                                 f"[0, {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @property
    def has_token_mask(self) -> bool:
        """Whether the sampler edits this row's logits beyond penalties (bias, allow-list)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> SamplingParams:
        """An independent copy (its lists are not shared)."""
        return SamplingParams(**{
            **self.__dict__, "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids),
            "logit_bias": None if self.logit_bias is None else dict(self.logit_bias),
            "allowed_token_ids": (None if self.allowed_token_ids is None
                                  else list(self.allowed_token_ids))})


class RequestOutputKind(enum.Enum):
    """vLLM's names. CUMULATIVE: each output holds all text and tokens so far (copying grows with
    the length); DELTA: only what is new since the previous output (what a stream sends);
    FINAL_ONLY: one output, when the request finishes (what `LLM.generate` needs)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2
