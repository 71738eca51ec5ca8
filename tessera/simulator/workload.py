"""The simulated requests of a trace: bench serve's samples at its arrival times, and its probe.

Shared by `tessera simulate` (cli.py) and the fidelity runs against a real server (serving.py).
"""

from __future__ import annotations

from tessera.bench.client import arrival_times
from tessera.simulator.simulator import SimRequest


def sim_requests(samples, request_rate: float, burstiness: float, seed: int):
    """Samples at bench serve's arrival times; synthetic distinct prompt ids when a sample has
    none (then no two prompts share a prefix)."""
    offsets = arrival_times(len(samples), request_rate, burstiness, seed)
    requests = []
    for k, (sample, offset) in enumerate(zip(samples, offsets, strict=True)):
        ids = sample.prompt_token_ids
        prompt = list(ids) if ids is not None else [k + 1] * sample.prompt_len
        requests.append(SimRequest(prompt, sample.max_tokens, float(offset)))
    return requests


def probe_request(requests):
    """bench serve's test request before the trace: the first sample, at most 4 tokens
    (tessera/bench/serve.py)."""
    if not requests:
        return None
    first = requests[0]
    return SimRequest(first.prompt_token_ids, min(first.max_tokens, 4), 0.0)
