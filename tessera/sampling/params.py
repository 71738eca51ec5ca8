"""`SamplingParams`: how one request wants its tokens chosen and when it stops.

Names, defaults and validation follow vLLM so that users feel at home. Every bad value raises
`ValueError` whose message starts with the field's name ("temperature must be >= 0, got -1").

Every field has a range (the limits below), so that no value a client can send (a 70-bit integer,
NaN, 1e308, a million stop strings) reaches a tensor or a loop it could break or stall. The HTTP
schema (tessera/entrypoints/openai/protocol.py) states the same limits; what needs the model is
checked by the engine when the request is added (`LLMEngine.add_request`): `top_k` above the
vocabulary clamps to it (off, as vLLM does), `logprobs` and `prompt_logprobs` are capped by
`--max-logprobs` (default 20), and the prompt by `max_model_len`.

Seeds: any 64-bit value, signed or unsigned (-2**63 ... 2**64 - 1). Stream k of a request (k > 0
for the children of n > 1) is seeded `(seed + k) mod 2**64` (`tessera/core/runner_view.py`,
`stream_seed`), which every torch generator accepts; a negative seed s is the same as s + 2**64.
The sampler (`tessera/sampling/sampler.py`) reads the sampling fields; the scheduler's stop rules
(`tessera/core/stop_conditions.py`) read `stop_token_ids`, `ignore_eos`, `max_tokens`,
`min_tokens`, and the engine's output processor reads `stop` and `output_kind`.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from tessera.sampling.structured_outputs import StructuredOutputsParams

# Below this temperature a request is greedy: dividing logits by ~0 only overflows.
_GREEDY_EPS = 1e-5
# the default of --max-logprobs (vLLM's): most alternatives per token a request may ask for
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries per request (OpenAI documents no limit; vLLM's is the vocab)

# ranges of the fields (the HTTP schema imports these)
MAX_N = 256  # sequences per request (the engine also needs n <= --max-num-seqs, default 256)
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform to float32 anyway
MAX_ABS_PENALTY = 2.0  # presence_penalty, frequency_penalty (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0  # (0, 10]: 10 already all but forbids every seen token
MAX_STOP_STRINGS = 16
MAX_STOP_STR_LEN = 1024  # characters; the detokenizer holds back up to this much text
MAX_STOP_TOKEN_IDS = 1024
INT32_MAX = 2**31 - 1  # max_tokens, min_tokens, top_k, logprobs: counts, never wider
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_key(key: Any) -> Any:
    """OpenAI sends logit_bias keys as strings of token ids (JSON objects have string keys)."""
    if isinstance(key, str) and key.isdigit() and len(key) <= 19:
        return int(key)
    return key


def _is_real(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _short(value: Any) -> str:
    """repr for an error message, cut short: a client's 10 MB string is not echoed back."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off; above the vocabulary: off (the engine clamps it)
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
    # disaggregated prefill/decode (vLLM's request field): {"do_remote_decode": true} asks a
    # producer to keep the prompt's KV for a peer; the producer's response holds the params a
    # consumer pulls with (tessera/core/kv_connector.py checks the keys)
    kv_transfer_params: dict[str, Any] | None = None

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
                raise ValueError(f"{name} must be {rule}, got {_short(getattr(self, name))}")

        def count(name: str, lo: int, hi: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            need(_is_int(value), name, "an int or None" if optional else "an int")
            need(lo <= value <= hi, name, f"in [{lo}, {hi}]")

        count("n", 1, MAX_N)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            need(_is_real(getattr(self, name)), name, "a finite number")
        need(self.temperature >= 0, "temperature", ">= 0")
        need(self.temperature <= MAX_TEMPERATURE, "temperature", f"<= {MAX_TEMPERATURE:g}")
        need(0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(_is_int(self.top_k), "top_k", "an int")
        need(self.top_k >= -1, "top_k", "-1 or 0 (off) or >= 1")
        need(self.top_k <= INT32_MAX, "top_k", f"<= {INT32_MAX} (above the vocabulary it is off)")
        need(0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(self.seed is None or _is_int(self.seed), "seed", "an int or None")
        need(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",
             "a 64-bit value, in [-2**63, 2**64 - 1]")
        m = MAX_ABS_PENALTY
        need(-m <= self.presence_penalty <= m, "presence_penalty", f"in [-{m:g}, {m:g}]")
        need(-m <= self.frequency_penalty <= m, "frequency_penalty", f"in [-{m:g}, {m:g}]")
        need(0 < self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
             f"in (0, {MAX_REPETITION_PENALTY:g}]")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop", "a string or a list of non-empty strings")
        need(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        need(all(len(s) <= MAX_STOP_STR_LEN for s in self.stop), "stop",
             f"strings of at most {MAX_STOP_STR_LEN} characters")
        need(isinstance(self.stop_token_ids, list)
             and all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
             "stop_token_ids", "a list of non-negative ints")
        need(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"at most {MAX_STOP_TOKEN_IDS} ids")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            need(isinstance(getattr(self, name), bool), name, "a bool")
        count("max_tokens", 1, INT32_MAX, optional=True)
        count("min_tokens", 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        need(isinstance(self.output_kind, RequestOutputKind), "output_kind",
             "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        # the engine caps these further by --max-logprobs
        count("logprobs", 0, INT32_MAX, optional=True)
        count("prompt_logprobs", 0, INT32_MAX, optional=True)
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
        need(self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict),
             "kv_transfer_params", "an object (dict) or None")

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
        """An independent copy (its lists are not shared): also what the scheduler sends the
        runner, so that neither side can change the other's parameters. Not re-validated (the
        values were checked when this one was built): ~10x cheaper than building anew."""
        new = copy.copy(self)
        new.stop = list(self.stop)
        new.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            new.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            new.allowed_token_ids = list(self.allowed_token_ids)
        if self.kv_transfer_params is not None:
            new.kv_transfer_params = copy.deepcopy(self.kv_transfer_params)
        return new


class RequestOutputKind(enum.Enum):
    """vLLM's names. CUMULATIVE: each output holds all text and tokens so far (copying grows with
    the length); DELTA: only what is new since the previous output (what a stream sends);
    FINAL_ONLY: one output, when the request finishes (what `LLM.generate` needs)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2
