"""The load generator's two halves: when each request is sent (`arrival_times`) and what one
streamed request to `/v1/completions` or `/v1/chat/completions` measured (`send_completion`).

Timing follows `vllm bench serve`: the clock starts just before the request is sent; TTFT is the
first chunk that carries text (`choices[0].text`, or `choices[0].delta.content` in a chat stream,
whose opening role-only chunk carries none); each later text chunk adds one inter-token gap (ITL);
E2E ends at the last chunk with choices. The output token count is the server's
`usage.completion_tokens` (asked for with `stream_options.include_usage`); a server that sends no
usage is counted with the tokenizer, or, lacking one, one token per text chunk. A stream that ends
normally without text (EOS first) succeeds with zero tokens, TTFT = E2E; only errors count as
failures.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
import numpy as np

from tessera.bench.datasets import Tokenizer
from tessera.bench.report import RequestResult


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> np.ndarray:
    """Send offsets in seconds from the start, the first at 0.

    Gaps are gamma-distributed with shape `burstiness` and mean 1 / `request_rate` (vLLM's
    semantics): burstiness 1 is a Poisson process, below 1 burstier, above 1 more even. An
    infinite rate sends everything at once.
    """
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)  # scale: shape * scale = 1 / rate
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def parse_sse_line(line: str) -> dict | None | str:
    """The JSON of one `data:` line, "[DONE]" for the end marker, None for anything else."""
    line = line.strip()
    if not line.startswith("data:"):
        return None  # blank separators, comments (": ping"), event: lines
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return "[DONE]"
    return json.loads(data)


def chunk_text(choice: dict) -> str:
    """The new text in one streamed choice: `text` (completions) or `delta.content` (chat)."""
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def send_completion(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                          headers: dict[str, str], prompt_len: int,
                          tokenizer: Tokenizer | None = None) -> RequestResult:
    """POST one streaming (chat) completion and time its chunks; never raises for a failed
    request."""
    result = RequestResult(prompt_len=prompt_len)
    texts: list[str] = []
    usage: dict | None = None
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk is None:
                    continue
                if chunk == "[DONE]":
                    break
                assert isinstance(chunk, dict)
                if chunk.get("error"):
                    result.error = f"error in stream: {json.dumps(chunk['error'])[:500]}"
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue  # the usage-only chunk
                now = time.perf_counter()
                text = chunk_text(choices[0])
                if text:
                    if not texts:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    texts.append(text)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if not texts and last == start and usage is None:
        result.error = "the stream ended without a completion chunk"
        return result
    result.success = True
    if not texts:  # EOS came first: a finished request with no text; its one event ends both
        result.ttft = (last if last > start else time.perf_counter()) - start
        last = start + result.ttft
    result.e2el = last - start
    result.generated_text = "".join(texts)
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
    elif tokenizer is not None:
        result.output_tokens = len(tokenizer.encode(result.generated_text))
    else:
        result.output_tokens = len(texts)
    return result
