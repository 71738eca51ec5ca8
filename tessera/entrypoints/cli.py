"""The `tessera` command. Subcommands register themselves in `SUBCOMMANDS` (`serve`, `bench`,
`simulate`, `proxy`).

Engine flags are generated from `EngineArgs`: each dataclass field becomes `--field-name` with the
field's type, default, `help` and optional `choices` from its metadata; bools become `store_true`
switches. So a new engine knob appears in `tessera serve --help` by being added to `EngineArgs`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable

from tessera.bench import add_bench_parser
from tessera.engine.arg_utils import add_engine_args, engine_args_from
from tessera.entrypoints.openai import DEFAULT_MAX_REQUEST_BODY_BYTES
from tessera.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from tessera.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tessera.entrypoints.proxy import add_proxy_parser
from tessera.simulator import add_simulate_parser


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def _add_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve (the same as --model)")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: %(default)s, loopback only)")
    server.add_argument("--port", type=_port, default=8000, help="TCP port (default: %(default)s)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health, "
                             "/metrics and /version (the OpenAPI docs need it too)")
    server.add_argument("--max-request-body-bytes", type=_positive_int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies are refused with 413 before they are "
                             "parsed (default: %(default)s)")
    server.add_argument("--served-model-name", default=None,
                        help="model id reported by /v1/models and expected in requests "
                             "(default: the engine's model name)")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template's text) replacing "
                             "the model's own")
    levels = ["critical", "error", "warning", "info", "debug", "trace"]
    server.add_argument("--log-level", default="info", choices=levels[:-1])
    server.add_argument("--uvicorn-log-level", default=None, choices=levels,
                        help="uvicorn's own log level (default: --log-level)")
    server.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's id, prompt length and sampling parameters")
    server.add_argument("--disable-log-requests", action="store_true",
                        help="do not log requests (the default; vLLM's older spelling)")
    server.add_argument("--generation-config", default="auto",
                        help="sampling defaults: 'auto' reads the model's generation_config.json "
                             "(HF directories), 'vllm' ignores it, or a directory holding one "
                             "(default: %(default)s)")
    server.add_argument("--allowed-origins", default=None, type=json.loads,
                        help='CORS origins as a JSON list, e.g. \'["*"]\' (default: CORS off)')
    server.add_argument("--root-path", default="",
                        help="path prefix when served behind a reverse proxy")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='allow tool_choice "auto": parse the model\'s own tool calls '
                             "(needs --tool-call-parser)")
    server.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                        help="the model's tool-call format (vLLM's names): hermes (Hermes, "
                             "Qwen2.5, Qwen3), llama3_json (Llama 3.x), mistral, pythonic "
                             "(Llama 3.2/4 pythonic), qwen3_xml (Qwen3-Coder)")
    server.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                        help="split <think>...</think> into reasoning_content: deepseek_r1 "
                             "(DeepSeek-R1 and distills, QwQ) or qwen3")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to serve (with --enable-lora), each name=path or JSON "
                             '{"name": ..., "path": ..., "base_model_name": ...}; a request '
                             "picks one by its model field")
    server.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             "(with --enable-lora)")
    server.add_argument("--step-log", default=None, metavar="FILE",
                        help="write every engine step and request arrival to FILE as JSON "
                             "lines, for `tessera simulate --replay FILE` (docs/simulator.md)")
    server.add_argument("--disable-dashboard", action="store_true",
                        help="do not serve the live view /dashboard (and /dashboard/events)")
    server.add_argument("--dashboard-interval", type=int, default=250, metavar="MS",
                        help="the fastest the dashboard samples the engine, in ms (at least "
                             "10) (default: %(default)s)")
    add_engine_args(p)
    p.set_defaults(func=_serve, parser=p)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a path to a template file, or the template itself (as vLLM takes it)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # neither a file nor Jinja: a mistyped path
        raise ValueError(f"--chat-template: {value!r} is not a file and not a Jinja template")
    return value


def _serve(args: argparse.Namespace) -> int:
    from tessera.engine.async_engine import AsyncLLMEngine
    from tessera.engine.malloc_tuning import limit_malloc_retention
    from tessera.entrypoints.openai.generation_config import load_sampling_defaults
    from tessera.entrypoints.openai.server import bind_socket, run_server
    from tessera.entrypoints.openai.serving_models import parse_lora_module
    from tessera.model.default_model import resolve_model_path

    if args.model_tag is not None and args.model not in (None, args.model_tag):
        args.parser.error(f"the model is given twice: {args.model_tag!r} and --model "
                          f"{args.model!r}")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        args.parser.error("--enable-auto-tool-choice and --tool-call-parser go together")
    if args.enable_log_requests and args.disable_log_requests:
        args.parser.error("--enable-log-requests and --disable-log-requests contradict")
    if args.step_log is not None and not os.path.isdir(os.path.dirname(
            os.path.abspath(args.step_log))):
        args.parser.error(f"--step-log {args.step_log}: its directory does not exist")
    if args.dashboard_interval < 10:
        args.parser.error(f"--dashboard-interval must be >= 10 (ms), got {args.dashboard_interval}")
    origins = args.allowed_origins
    if origins is not None and not (isinstance(origins, list)
                                    and all(isinstance(o, str) for o in origins)):
        args.parser.error("--allowed-origins must be a JSON list of strings")
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        flag = "--lora-modules" if args.lora_modules else "--allow-runtime-lora-updating"
        args.parser.error(f"{flag} needs --enable-lora")
    try:
        lora_modules = [parse_lora_module(m) for m in args.lora_modules or []]
        chat_template = read_chat_template(args.chat_template)
        sampling_defaults = load_sampling_defaults(
            args.generation_config, resolve_model_path(args.model_tag or args.model))
    except (ValueError, OSError) as e:
        args.parser.error(str(e))

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limit_malloc_retention()  # before the engine and server threads exist (resident memory)
    if args.node_rank > 0:  # a worker node of a multi-node tensor-parallel group: no server
        return _serve_worker_node(args)
    # the port first: a busy one fails now, not after the model has loaded
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"tessera serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    # SIGINT/SIGTERM while the model loads: a clean exit too (the server handles them later)
    def interrupted(sig, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args_from(args), step_log=args.step_log)
    except ValueError as e:  # a bad flag combination, named by the config's validation
        sock.close()
        args.parser.error(str(e))
    except KeyboardInterrupt:
        sock.close()
        logging.getLogger(__name__).info("interrupted while loading the model")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:  # the adapters are checked before serving: a bad one stops the start
        names = [m.name for m in lora_modules]
        if len(set(names)) < len(names):
            raise ValueError(f"--lora-modules: a name is given twice ({', '.join(names)})")
        for module in lora_modules:
            engine.engine.loras.check_path(module.path)
    except ValueError as e:
        sock.close()
        engine.engine.shutdown()
        args.parser.error(str(e))
    return run_server(
        engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        log_level=args.log_level,
        chat_template=chat_template,
        uvicorn_log_level=args.uvicorn_log_level,
        sampling_defaults=sampling_defaults,
        log_requests=args.enable_log_requests,
        allowed_origins=origins,
        root_path=args.root_path,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        sock=sock,
        max_request_body_bytes=args.max_request_body_bytes,
        enable_dashboard=not args.disable_dashboard,
        dashboard_interval_ms=args.dashboard_interval,
        lora_modules=lora_modules,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )


def _serve_worker_node(args: argparse.Namespace) -> int:
    from tessera.executor.multiproc_executor import run_worker_node

    try:
        parallel = engine_args_from(args).parallel_config()
    except ValueError as e:
        args.parser.error(str(e))
    logging.getLogger(__name__).info(
        "--node-rank %d: running worker ranks only; the model and engine flags are node 0's "
        "(sent by rank 0)",
        args.node_rank,
    )

    def interrupted(sig, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    return run_worker_node(parallel, args.device)


# each registers one subcommand (a parser with `func`)
SUBCOMMANDS: list[Callable] = [_add_serve, add_bench_parser, add_simulate_parser, add_proxy_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera LLM serving engine")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
