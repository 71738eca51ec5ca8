"""A word-level tokenizer: the bench code only needs encode, decode and vocab_size."""

from __future__ import annotations


class WordTokenizer:
    """Token i is the word "w<i>"; any other word encodes as 1. Id 0 is special."""

    all_special_ids = [0]

    def __init__(self, vocab_size: int = 500):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            ok = word.startswith("w") and word[1:].isdigit() and int(word[1:]) < self.vocab_size
            ids.append(int(word[1:]) if ok else 1)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)
