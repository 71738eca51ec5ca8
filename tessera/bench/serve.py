"""`tessera bench serve`: load any OpenAI-compatible `/v1/completions` (or, with `--endpoint
/v1/chat/completions`, chat) endpoint (ours, llama.cpp's `llama-server`, vLLM) with a dataset at a
request rate and report what `vllm bench serve` reports. A chat request sends the sample's prompt
as one user message, with `max_completion_tokens` (as vLLM's openai-chat backend).

    python -m tessera.bench.serve --base-url http://127.0.0.1:8000 --dataset sharegpt \\
        --num-prompts 200 --request-rate 4 --goodput ttft:500 tpot:100 \\
        --result-file result.json --plot-file cdf.png

Flow: build samples (tessera.bench.datasets) -> one short test request -> send each sample at its
arrival time (tessera.bench.client), under an optional concurrency cap -> summarize
(tessera.bench.report) -> print the table, write the JSON and the CDF figure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time

import httpx

from tessera.bench import datasets
from tessera.bench.client import arrival_times, send_completion
from tessera.bench.config import BenchConfig, add_serve_args, config_from_args, result_path
from tessera.bench.datasets import SampleRequest, Tokenizer
from tessera.bench.report import (
    RequestResult,
    compute_metrics,
    format_table,
    plot_cdfs,
    result_json,
    save_json,
)

logger = logging.getLogger(__name__)


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def _served_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    response = await client.get(cfg.base_url.rstrip("/") + "/v1/models", headers=_headers(cfg))
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _payload(cfg: BenchConfig, model: str, sample: SampleRequest) -> dict:
    payload: dict = {"model": model}
    if cfg.chat:
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
        payload["max_completion_tokens"] = sample.max_tokens
    else:
        payload["prompt"] = sample.prompt
        payload["max_tokens"] = sample.max_tokens
    payload.update(temperature=cfg.temperature, stream=True,
                   stream_options={"include_usage": True})
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(cfg.extra_body)
    return payload


async def benchmark(cfg: BenchConfig, samples: list[SampleRequest],
                    tokenizer: Tokenizer | None = None) -> dict:
    """Send every sample at its arrival time; the result JSON (config, metrics, requests)."""
    if not samples:
        raise ValueError("no samples to send (did the dataset filter drop them all?)")
    from tqdm.asyncio import tqdm

    url = cfg.base_url.rstrip("/") + cfg.endpoint
    # httpx caps a pool at 100 connections by default: that would silently be a concurrency cap
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = cfg.model or await _served_model(client, cfg)
        # One short request first: a wrong URL or model fails here, not as N failures.
        first = dataclasses.replace(samples[0], max_tokens=min(samples[0].max_tokens, 4))
        probe = await send_completion(client, url, _payload(cfg, model, first), _headers(cfg),
                                      first.prompt_len, tokenizer)
        if not probe.success:
            raise RuntimeError(f"the test request to {url} failed: {probe.error}")

        offsets = arrival_times(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
        cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        progress = tqdm(total=len(samples), disable=cfg.disable_tqdm)
        start = time.perf_counter()

        async def one(sample: SampleRequest, offset: float) -> RequestResult:
            # absolute schedule: a slow send never delays the arrivals after it
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            payload = _payload(cfg, model, sample)
            if cap is None:
                result = await send_completion(client, url, payload, _headers(cfg),
                                               sample.prompt_len, tokenizer)
            else:
                async with cap:
                    result = await send_completion(client, url, payload, _headers(cfg),
                                                   sample.prompt_len, tokenizer)
            progress.update(1)
            return result

        results = await asyncio.gather(*(one(s, float(o)) for s, o in
                                         zip(samples, offsets, strict=True)))
        duration = time.perf_counter() - start
        progress.close()
    metrics = compute_metrics(results, duration, cfg.slos)
    config = {**cfg.to_json(), "model": model, "url": url, "num_prompts": len(samples)}
    return result_json(metrics, results, config)


def run_bench(cfg: BenchConfig, samples: list[SampleRequest], tokenizer: Tokenizer | None = None,
              result_file: str | None = None, plot_file: str | None = None,
              extra_config: dict | None = None, quiet: bool = False) -> dict:
    """`benchmark` from synchronous code, then the table, JSON and figure where asked."""
    data = asyncio.run(benchmark(cfg, samples, tokenizer))
    data["config"].update(extra_config or {})
    failures = [r for r in data["requests"] if not r["success"]]
    for r in failures[:3]:
        logger.warning("failed request: %s", r["error"])
    if not quiet:
        print(format_table(data["metrics"]))
    if result_file:
        save_json(result_file, data)
    if plot_file:
        c = data["config"]
        plot_cdfs(plot_file, [RequestResult(**{k: v for k, v in r.items() if k != "tpot"})
                              for r in data["requests"]],
                  title=f"{c['model']}  rate={c['request_rate']}  n={c['num_prompts']}")
    return data


def load_bench_tokenizer(path: str | None) -> Tokenizer:
    """`--tokenizer PATH`, else the default model's tokenizer."""
    from tessera.model.default_model import resolve_model_path
    from tessera.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(path))


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request



def prepare(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None):
    """(BenchConfig, tokenizer, samples) from the flags; bad flags are a usage error."""
    try:
        cfg = config_from_args(args)
        tokenizer = load_bench_tokenizer(args.tokenizer)
        return cfg, tokenizer, datasets.build_samples(args, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        if parser is not None:
            parser.error(str(e))
        raise

def serve_main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Entry of `tessera bench serve` (the CLI calls func(args, parser))."""
    _setup_logging()
    cfg, tokenizer, samples = prepare(args, parser)
    run_bench(cfg, samples, tokenizer, result_path(args), args.plot_file,
              extra_config={"dataset": args.dataset, "label": args.label})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.bench.serve",
                                     description=__doc__.split("\n\n")[0])
    add_serve_args(parser)
    args = parser.parse_args(argv)
    return serve_main(args, parser)


if __name__ == "__main__":
    sys.exit(main())
