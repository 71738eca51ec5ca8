"""The flags of `tessera simulate` and `tessera simulate calibrate`, and their entry points.

`tessera simulate` takes `bench serve`'s dataset and arrival flags (tessera/bench/serve.py) and
every engine flag (generated from `EngineArgs`, as `tessera serve` does) except `--model` and
`--device`: the simulated model is `--profile`'s (profiled) or `--model-config`'s (roofline), on
`--hardware`. `--seed` seeds the dataset and the arrivals.

    tessera simulate --cost-model roofline --hardware H100-SXM --model-config Llama-3-8B \\
        --dtype bfloat16 --kv-cache-space 40 --dataset sharegpt --num-prompts 1000 \\
        --request-rate 8 --result-file sim.json --timeline-file timeline.png
    tessera simulate calibrate --dtype bfloat16 --output profile.json
    tessera simulate --profile profile.json --dtype bfloat16 --sweep --request-rates 1 2 4 \\
        --settings "" " --enable-chunked-prefill" --plot-file sweep.png

`--sweep` runs every (setting, rate) pair (a setting is a string of engine flags laid over the
command's own, written as for `bench sweep`) and writes bench sweep's JSON and figure.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import math
import shlex

from tessera.config import EngineConfig, GiB, resolve_dtype, resolve_kv_cache_dtype
from tessera.core.kv_cache_groups import num_pool_blocks_for_override
from tessera.simulator.serving import TRACE_RATE

# engine flags the simulator replaces or does not model: the model and device are the cost
# model's (--profile / --model-config, --hardware), quantization is in the calibrated profile
# (`simulate calibrate --quantization ...`), logprob limits change no step's cost
# --tensor-parallel-size is simulated (the roofline splits the model and adds the all-reduces,
# --enable-expert-parallel places whole experts)
# but not calibrated (calibration times one in-process runner); where the ranks meet is no cost
_PLACEMENT = ("distributed_init_method", "nnodes", "node_rank")
_PARALLEL = ("tensor_parallel_size", "enable_expert_parallel", *_PLACEMENT)
_NOT_SIMULATED = ("model", "device", "quantization", "max_logprobs", *_PLACEMENT)


def add_simulate_parser(subparsers) -> None:
    from tessera.bench.config import add_arrival_args, add_dataset_args
    from tessera.engine.arg_utils import add_engine_args
    from tessera.simulator.specs import hardware_names, model_config_names

    p = subparsers.add_parser(
        "simulate", help="simulate serving with the real scheduler on a virtual clock",
        description="Drive the real scheduler with a dataset on a virtual clock; a cost model "
                    "prices each step. Reports what `tessera bench serve` reports.")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson (or gamma with --burstiness); inf = all "
                        "at once (default: %(default)s)")
    add_dataset_args(p, seed=False)
    add_arrival_args(p.add_argument_group("arrivals"))
    add_engine_args(p, exclude=_NOT_SIMULATED)
    c = p.add_argument_group("cost model")
    c.add_argument("--cost-model", choices=["profiled", "roofline"], default=None,
                   help="default: profiled with --profile, else roofline")
    c.add_argument("--profile", default=None,
                   help="calibration profile JSON (from `tessera simulate calibrate`)")
    c.add_argument("--hardware", default="H100-SXM", choices=hardware_names(),
                   help="roofline hardware spec (default: %(default)s)")
    c.add_argument("--model-config", default="Llama-3-8B", metavar="NAME|PATH",
                   help="roofline model: a config.json (or its directory) or one of "
                        f"{', '.join(model_config_names())} (default: %(default)s)")
    c.add_argument("--spec-acceptance-rate", type=float, default=None, metavar="RATE",
                   help="with --speculative-config: the fraction of draft tokens accepted, as "
                        "the server counts it (spec_decode_num_accepted_tokens_total / "
                        "spec_decode_num_draft_tokens_total)")
    c.add_argument("--spec-proposal-rate", type=float, default=1.0, metavar="RATE",
                   help="with --speculative-config: the fraction of decode steps for which the "
                        "proposer finds drafts (default: %(default)s)")
    r = p.add_argument_group("replay")
    r.add_argument("--replay", default=None, metavar="FILE",
                   help="replay a step log (`tessera serve --step-log FILE`) through the real "
                        "scheduler with the logged step times; report each request's TTFT, "
                        "TPOT and E2E against the real ones and the first step where the "
                        "schedules diverge (takes only --result-file and --quiet)")
    s = p.add_argument_group("sweep")
    s.add_argument("--sweep", action="store_true",
                   help="run every --settings x --request-rates point; write the sweep JSON "
                        "and figure (to --result-file, --plot-file)")
    s.add_argument("--request-rates", type=float, nargs="+", default=None,
                   help="rates of the sweep (default: --request-rate)")
    s.add_argument("--settings", nargs="+", default=[""], metavar="FLAGS",
                   help='engine flags per setting, e.g. "" " --enable-chunked-prefill" '
                        '(a lone flag needs a leading space)')
    out = p.add_argument_group("output")
    out.add_argument("--result-file", default=None, help="write the result JSON here")
    out.add_argument("--plot-file", default=None,
                     help="latency CDF figure (as bench serve's); with --sweep, the sweep figure")
    out.add_argument("--timeline-file", default=None,
                     help="figure of queue lengths, KV usage and batch size over time")
    out.add_argument("--dashboard-file", default=None, metavar="HTML",
                     help="write the live dashboard's view of the run as one self-contained "
                          "page that replays it (slider, play/pause)")
    out.add_argument("--label", default=None, help="a name stored in the result's config")
    out.add_argument("--quiet", action="store_true", help="do not print the result table")
    p.set_defaults(func=simulate_main, parser=p)

    commands = p.add_subparsers(dest="simulate_command", metavar="{calibrate}")
    cal = commands.add_parser(
        "calibrate", help="time the real runner over a grid of batch shapes and fit a profile",
        description="Time the real model runner here over a grid of batch shapes and fit the "
                    "profiled cost model (tessera/simulator/calibrate.py); save it as JSON.")
    add_engine_args(cal, exclude=_PARALLEL)
    g = cal.add_argument_group("calibration")
    g.add_argument("--output", default="profile.json", help="profile JSON (default: %(default)s)")
    g.add_argument("--grid", default="default", choices=["tiny", "small", "default"],
                   help="batch shapes to time (default: %(default)s)")
    g.add_argument("--repeats", type=int, default=3,
                   help="timed steps per shape (the median is kept) (default: %(default)s)")
    g.add_argument("--rounds", type=int, default=2,
                   help="passes over the grid; a shape's time is the median of its timed steps "
                        "in every pass, so a drift of the machine's speed during one pass does "
                        "not land on the shapes timed then (default: %(default)s)")
    g.add_argument("--serving-requests", type=int, default=0, metavar="N",
                   help="also start the real server (127.0.0.1) on N requests of a calibration "
                        "trace, with its step log on, and fit the serving overhead to its steps "
                        "(0: runner only)")
    g.add_argument("--serving-runs", type=int, default=1, metavar="R",
                   help="real-server runs of the calibration trace, each after a pass over the "
                        "grid (default: %(default)s)")
    g.add_argument("--serving-request-rate", type=float, default=TRACE_RATE, metavar="RPS",
                   help="the calibration trace's request rate; about 70%% of a 2-core AVX-512 "
                        "machine's capacity at its default (default: %(default)s)")
    cal.set_defaults(func=calibrate_main, parser=cal)


# ------------------------------------------------------------------ building a simulation


def make_cost_model(args: argparse.Namespace):
    from tessera.simulator.cost_model import ProfiledCostModel
    from tessera.simulator.roofline import RooflineCostModel
    from tessera.simulator.specs import load_hardware, load_model_config

    kind = args.cost_model or ("profiled" if args.profile else "roofline")
    if kind == "profiled":
        if not args.profile:
            raise ValueError("--cost-model profiled needs --profile PATH (from `tessera simulate "
                             "calibrate`)")
        model = ProfiledCostModel.load(args.profile)
        if args.tensor_parallel_size > 1:
            raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: a profile "
                             "times one in-process runner; simulate tensor parallelism with "
                             "--cost-model roofline (--hardware cpu-zen4-2core for this machine)")
        if args.dtype != "auto" and model.dtype != resolve_dtype(args.dtype, None, "meta"):
            raise ValueError(f"--dtype {args.dtype} differs from the profile's {model.dtype}: "
                             f"pass --dtype {model.dtype} or calibrate with --dtype {args.dtype}")
        return model
    spec = load_model_config(args.model_config)
    # the simulated device is not this CPU: float16 is the GPU's own type here
    dtype = resolve_dtype(args.dtype, spec.torch_dtype, "meta")
    kv_dtype = resolve_kv_cache_dtype(getattr(args, "kv_cache_dtype", "auto"), dtype)
    return RooflineCostModel(spec, load_hardware(args.hardware), dtype, args.tensor_parallel_size,
                             kv_dtype, getattr(args, "enable_expert_parallel", False))


def engine_setup(args: argparse.Namespace, cost_model) -> tuple[EngineConfig, int, int]:
    """The engine config and KV pool sizes the server would have with these flags."""
    from tessera.engine.arg_utils import engine_args_from

    engine_args = dataclasses.replace(engine_args_from(args), dtype=cost_model.dtype, device="meta")
    config = engine_args.create_engine_config(
        cost_model.max_model_len, sliding_window=getattr(cost_model, "sliding_window", None),
        layer_windows=getattr(cost_model, "layer_windows", ()))
    # with KV cache groups a block holds one group's layers, and the override counts blocks of
    # every layer, each `num_groups` pool blocks (tessera/engine/sizing.py)
    block_bytes = cost_model.geometry.pool_block_bytes(config.cache)
    override = config.cache.num_gpu_blocks_override
    num_gpu = (
        num_pool_blocks_for_override(override, config.cache.layer_windows) if override
        else int(config.cache.kv_cache_space * GiB) // block_bytes
    )
    num_cpu = int(config.cache.swap_space * GiB) // block_bytes
    if num_gpu < 1:
        raise ValueError(f"--kv-cache-space {config.cache.kv_cache_space} GiB holds no block of "
                         f"{block_bytes} bytes: raise it")
    check = getattr(cost_model, "check_fits", None)
    if check is not None:
        check(num_gpu * block_bytes / GiB)
    return config, num_gpu, num_cpu


def run_point(args: argparse.Namespace, samples, request_rate: float,
              include_requests: bool = True) -> dict:
    """One simulation with the flags in `args`: the result JSON (bench serve's, plus timeline)."""
    from tessera.bench.report import json_rate, parse_goodput
    from tessera.simulator.report import simulation_json
    from tessera.simulator.simulator import Simulator
    from tessera.simulator.workload import probe_request, sim_requests

    cost_model = make_cost_model(args)
    config, num_gpu, num_cpu = engine_setup(args, cost_model)
    if config.kv_transfer is not None:  # a prefill and a decode instance (disagg.py)
        from tessera.simulator.disagg import DisaggSimulator

        if args.max_concurrency is not None or config.speculative is not None:
            raise ValueError("--kv-transfer-config (a simulated P/D pair) does not take "
                             "--max-concurrency or --speculative-config")
        sim = DisaggSimulator(config, cost_model, num_gpu, num_cpu)
    else:
        sim = Simulator(config, cost_model, num_gpu, num_cpu,
                        max_concurrency=args.max_concurrency,
                        acceptance=acceptance_model(args, config))
    requests = sim_requests(samples, request_rate, args.burstiness, args.seed)
    frames = _dashboard_frames(args, sim, cost_model)
    if isinstance(sim, Simulator):
        outcome = sim.run(requests, probe=probe_request(requests), observer=frames)
    else:
        outcome = sim.run(requests)
    described = {
        **cost_model.describe(), "dataset": args.dataset, "num_prompts": len(samples),
        "request_rate": json_rate(request_rate), "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "label": args.label,
        "num_gpu_blocks": num_gpu, "num_cpu_blocks": num_cpu,
        "engine": _engine_json(config),
    }
    if frames is not None:
        from tessera.simulator.dashboard import write_dashboard

        write_dashboard(args.dashboard_file, frames.finish(), interval_s=frames.interval_s,
                        title=f"{described['cost_model']}: {args.dataset}, rate "
                              f"{described['request_rate']}")
    return simulation_json(outcome, described, parse_goodput(args.goodput), include_requests)


def _dashboard_frames(args: argparse.Namespace, sim, cost_model):
    """The dashboard's frame recorder when --dashboard-file asks for one
    (simulator/dashboard.py)."""
    if not getattr(args, "dashboard_file", None):
        return None
    from tessera.simulator.dashboard import DashboardFrames
    from tessera.simulator.simulator import Simulator

    if not isinstance(sim, Simulator):
        raise ValueError(
            "--dashboard-file shows one engine; a simulated P/D pair (--kv-transfer-config) has two"
        )
    d = cost_model.describe()
    name = d.get("model_config") or d.get("model") or d["cost_model"]
    if d.get("hardware"):
        name = f"{name} on {d['hardware']}"
    return DashboardFrames(sim.scheduler, model_name=str(name))


def acceptance_model(args: argparse.Namespace, config: EngineConfig):
    """The speculative-decoding acceptance model the flags ask for, or None without
    --speculative-config (spec_decode.py)."""
    from tessera.simulator.spec_decode import GeometricAcceptance

    rate = getattr(args, "spec_acceptance_rate", None)
    proposal = getattr(args, "spec_proposal_rate", 1.0)
    spec = config.speculative
    if spec is None:
        if rate is not None or proposal != 1.0:
            raise ValueError(
                "--spec-acceptance-rate and --spec-proposal-rate need --speculative-config"
            )
        return None
    if spec.method != "ngram":
        raise ValueError(
            f"--speculative-config method {spec.method!r}: the simulator does not "
            "price draft-model passes; only ngram (whose proposals cost nothing)"
        )
    if rate is None:
        raise ValueError(
            "--speculative-config needs --spec-acceptance-rate (the server's "
            "tessera:spec_decode_num_accepted_tokens_total / "
            "tessera:spec_decode_num_draft_tokens_total)"
        )
    return GeometricAcceptance(rate, spec.num_speculative_tokens, proposal, args.seed)


def _engine_json(config: EngineConfig) -> dict:
    s, c = config.scheduler, config.cache
    return {
        "max_model_len": s.max_model_len,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "max_num_seqs": s.max_num_seqs,
        "enable_chunked_prefill": s.enable_chunked_prefill,
        "preemption_mode": s.preemption_mode.value if s.preemption_mode else None,
        "scheduling_policy": s.scheduling_policy.value,
        "block_size": c.block_size,
        "enable_prefix_caching": c.enable_prefix_caching,
        "swap_space": c.swap_space,
        "kv_cache_space": c.kv_cache_space,
        "dtype": config.model.dtype,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "speculative_config": (
            dataclasses.asdict(config.speculative) if config.speculative else None
        ),
    }


def setting_args(args: argparse.Namespace, setting: str) -> argparse.Namespace:
    """`args` with the engine flags of one sweep setting laid over them."""
    from tessera.engine.arg_utils import add_engine_args

    parser = argparse.ArgumentParser(prog="--settings", add_help=False, exit_on_error=False)
    add_engine_args(parser, exclude=_NOT_SIMULATED)
    try:
        return parser.parse_args(shlex.split(setting), namespace=copy.copy(args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"--settings {setting!r}: not engine flags ({e})") from None


def run_sweep(args: argparse.Namespace, samples) -> dict:
    from tessera.bench.report import json_rate

    rates = args.request_rates or [args.request_rate]
    points = []
    for setting in args.settings:
        point_args = setting_args(args, setting)
        for rate in rates:
            data = run_point(point_args, samples, rate, include_requests=False)
            label = setting.strip() or "default"
            m = data["metrics"]
            print(
                f"{label:<40} rate {rate:>6g}: {m['request_throughput']:7.2f} req/s, "
                f"p99 TPOT {m['p99_tpot_ms']:8.1f} ms, p99 ITL {m['p99_itl_ms']:8.1f} ms, "
                f"preemptions {m['num_preemptions']}",
                flush=True,
            )
            points.append(
                {
                    "setting": label,
                    "request_rate": json_rate(rate),
                    "metrics": m,
                    "config": data["config"],
                }
            )
    return {"dataset": args.dataset, "num_prompts": len(samples), "points": points}


# ------------------------------------------------------------------ entry points


def load_samples(args: argparse.Namespace):
    from tessera.bench import datasets
    from tessera.bench.serve import load_bench_tokenizer

    return datasets.build_samples(args, load_bench_tokenizer(args.tokenizer))


def simulate_main(args: argparse.Namespace) -> int:
    from tessera.bench.report import format_table, plot_cdfs, save_json

    parser = args.parser
    if args.replay is not None:
        from tessera.simulator.replay import replay_main

        return replay_main(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if not math.isinf(args.request_rate) and args.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
        make_cost_model(args)  # bad cost-model flags fail before the dataset loads
        samples = load_samples(args)
        if not samples:
            raise ValueError("no samples (did the dataset filter drop them all?)")
        if args.sweep:
            from tessera.bench.sweep import plot_sweep

            if args.dashboard_file:
                raise ValueError("--dashboard-file shows one run, not a --sweep")

            data = run_sweep(args, samples)
            if args.result_file:
                save_json(args.result_file, data)
            if args.plot_file:
                plot_sweep(args.plot_file, data)
            return 0
        data = run_point(args, samples, args.request_rate)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    m = data["metrics"]
    if not args.quiet:
        print(format_table(m))
        print(
            f"preemptions: {m['num_preemptions']}, steps: {m['num_steps']}, simulated in "
            f"{m['wall_time_s']:.2f} s ({m['simulated_requests_per_wall_s']:.0f} requests/s)"
        )
    if args.result_file:
        save_json(args.result_file, data)
    if args.plot_file:
        from tessera.simulator.report import request_results_from_json

        plot_cdfs(args.plot_file, request_results_from_json(data), title="simulated")
    if args.timeline_file:
        from tessera.simulator.report import plot_timeline

        c = data["config"]
        plot_timeline(
            args.timeline_file,
            data["timeline"],
            title=f"{c['cost_model']}: {c['dataset']}, rate {c['request_rate']}",
        )
    return 0


def calibrate_main(args: argparse.Namespace) -> int:
    from tessera.engine.arg_utils import engine_args_from
    from tessera.simulator.calibrate import calibrate

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for flag, value, least in (
        ("--repeats", args.repeats, 1),
        ("--rounds", args.rounds, 1),
        ("--serving-requests", args.serving_requests, 0),
        ("--serving-runs", args.serving_runs, 1),
        ("--serving-request-rate", args.serving_request_rate, 1e-9),
    ):
        if value < least:
            args.parser.error(f"{flag} must be >= {least}, got {value}")
    try:
        profile = calibrate(
            engine_args_from(args),
            grid=args.grid,
            repeats=args.repeats,
            output=args.output,
            serving_requests=args.serving_requests,
            rounds=args.rounds,
            serving_runs=args.serving_runs,
            serving_request_rate=args.serving_request_rate,
        )
    except ValueError as e:
        args.parser.error(str(e))
    fit = profile["fit"]
    print(
        f"wrote {args.output}: {len(profile['grid'])} shapes, relative RMS error "
        f"{100 * fit['relative_rms_error']:.1f}%, worst {100 * fit['max_relative_error']:.1f}%"
    )
    return 0
