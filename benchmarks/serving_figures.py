"""Reproduce the serving figures of docs/performance.md on this machine.

    .venv/bin/python benchmarks/serving_figures.py run all      # every measurement, one at a time
    .venv/bin/python benchmarks/serving_figures.py run fig2     # one figure's measurements
    .venv/bin/python benchmarks/serving_figures.py plot         # PNGs + small JSONs from the
    results
    .venv/bin/python benchmarks/serving_figures.py print        # just print the exact commands
    .venv/bin/python benchmarks/serving_figures.py tables       # docs/performance.md's tables
    LLAMA_SERVER_URL=http://127.0.0.1:8080 ... run fig4          # also bench a running llama-server

Each measurement is a plain `tessera bench sweep` (which starts `tessera serve` per setting with
its defaults: the GGUF's quantized weights on the quantized kernels, `--dtype auto`, i.e. float32
activations for the default Q4_1 file), benches it, SIGINTs it, and records the /metrics counter
deltas) or
`benchmarks/hf_static.py`. Sweep summaries go to docs/results/figN_*.json; the per-request
results and server logs to $TESSERA_FIG_WORK (default /tmp/tessera-figs), from which `plot`
writes slimmed per-request JSONs next to the figures. Nothing else may load the CPU meanwhile:
on 2 cores any other process shows up in every latency.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
RESULTS = os.path.join(DOCS, "results")
WORK = os.environ.get("TESSERA_FIG_WORK", "/tmp/tessera-figs")
# another checkout's environment, e.g. TESSERA_BIN="/path/.venv/bin/python -m
# tessera.entrypoints.cli"
TESSERA = os.environ.get("TESSERA_BIN", ".venv/bin/tessera")
PYTHON = os.environ.get("PYTHON_BIN", ".venv/bin/python")
SERVER = ""  # the server's defaults (quantized GGUF weights, --dtype auto)

# Figure 1 runs at this rate: about 90% of the saturated request throughput that the probe
# (`run probe`, the default server at --request-rate inf on the same workload) measured: 0.33
# req/s with today's defaults on 2026-12-01 (0.84 with bf16 dequantized weights, first version).
FIG1_RATE = float(os.environ.get("FIG1_RATE", "0.3"))
FIG1_WORKLOAD = ("--dataset random --random-input-len 768 --random-output-len 128 "
                 "--random-range-ratio 0.5 --ignore-eos --num-prompts 48")
FIG1_SETTINGS = ["", " --enable-chunked-prefill --max-num-batched-tokens 256"]
FIG2_WORKLOAD = ("--dataset random --random-input-len 256 --random-output-len 256 --ignore-eos "
                 "--num-prompts 32")
FIG2_BLOCKS = 384
FIG2_SETTINGS = [f" --num-gpu-blocks-override {FIG2_BLOCKS} --preemption-mode recompute",
                 f" --num-gpu-blocks-override {FIG2_BLOCKS} --preemption-mode swap",
                 ""]
FIG3_WORKLOAD = ("--dataset prefix --prefix-len 512 --suffix-len 32 --random-output-len 32 "
                 "--ignore-eos --num-prompts 40")
FIG3_RATES = "1 3"
FIG3_SETTINGS = ["", " --enable-prefix-caching"]
FIG4_WORKLOAD = "--dataset sharegpt --sharegpt-output-len 128 --num-prompts 48 --ignore-eos"
FIG4_HF_BATCH = 16
# a running llama.cpp `llama-server` to add to figure 4, e.g. http://127.0.0.1:8080 (none here)
LLAMA_SERVER_URL = os.environ.get("LLAMA_SERVER_URL", "")


def _settings(settings: list[str]) -> str:
    return " ".join(shlex.quote(s) for s in settings)


def _sweep(name: str, workload: str, rates: str, settings: list[str], server: str = SERVER) -> str:
    return (f"{TESSERA} bench sweep {workload} --request-rates {rates} "
            f"--server-args {shlex.quote(server)} --settings {_settings(settings)} "
            f"--result-file docs/results/{name}.json --plot-file {WORK}/{name}_sweep.png "
            f"--result-dir {WORK}/{name} --disable-tqdm")


def commands() -> dict[str, list[str]]:
    return {
        "probe": [_sweep("fig1_probe", FIG1_WORKLOAD, "inf", [""])],
        "fig1": [_sweep("fig1_chunked_prefill", FIG1_WORKLOAD, f"{FIG1_RATE:g}", FIG1_SETTINGS)],
        # a third point added after the first two: the default budget of chunked prefill (512)
        "fig1b": [_sweep("fig1b_chunked_prefill_512", FIG1_WORKLOAD, f"{FIG1_RATE:g}",
                         [" --enable-chunked-prefill --max-num-batched-tokens 512"])],
        "fig2": [_sweep("fig2_preemption", FIG2_WORKLOAD, "inf", FIG2_SETTINGS,
                        server=f"{SERVER} --max-num-seqs 64")],
        "fig3": [_sweep("fig3_prefix_caching", FIG3_WORKLOAD, FIG3_RATES, FIG3_SETTINGS)],
        "fig4": [_sweep("fig4_tessera", FIG4_WORKLOAD, "inf", [""]),
                 f"{PYTHON} benchmarks/hf_static.py {FIG4_WORKLOAD} --batch-size {FIG4_HF_BATCH} "
                 f"--dtype bfloat16 --result-file docs/results/fig4_hf_static.json"]
        + ([f"{TESSERA} bench serve --base-url {shlex.quote(LLAMA_SERVER_URL)} {FIG4_WORKLOAD} "
            f"--request-rate inf --result-file docs/results/fig4_llamacpp.json"]
           if LLAMA_SERVER_URL else []),
    }


def run(which: str) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    cmds = commands()
    for name in (list(cmds) if which == "all" else [which]):
        for cmd in cmds[name]:
            print(f"\n$ {cmd}", flush=True)
            subprocess.run(cmd, shell=True, check=True, cwd=REPO)


# ------------------------------------------------------------------ plots


def _load(path: str) -> dict:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return json.load(f)


def _per_request(name: str) -> dict[str, dict]:
    """The sweep's per-request result files of one figure: {"setting{i}-rate{r}": data}."""
    out = {}
    for path in sorted(glob.glob(os.path.join(WORK, name, "setting*-rate*.json"))):
        with open(path, encoding="utf-8") as f:
            out[os.path.basename(path)[:-5]] = json.load(f)
    return out


def _slim(name: str, keep_itl: bool = False) -> None:
    """docs/results/{name}_requests.json: config, metrics and per-request latencies (ms, 0.1)."""
    points = _per_request(name)
    if not points:
        return
    slim = {}
    for key, data in points.items():
        reqs = []
        for r in data["requests"]:
            rec = {"ok": r["success"], "prompt_len": r["prompt_len"], "out": r["output_tokens"],
                   "ttft_ms": round(1000 * r["ttft"], 1), "e2el_ms": round(1000 * r["e2el"], 1),
                   "tpot_ms": None if r["tpot"] is None else round(1000 * r["tpot"], 2)}
            if keep_itl:
                rec["itl_ms"] = [round(1000 * x, 1) for x in r["itl"]]
            reqs.append(rec)
        slim[key] = {"config": data["config"], "metrics": data["metrics"], "requests": reqs}
    with open(os.path.join(RESULTS, f"{name}_requests.json"), "w", encoding="utf-8") as f:
        json.dump(slim, f, separators=(",", ":"))
        f.write("\n")


def _label(setting: str) -> str:
    s = setting.strip()
    names = {"default": "default", "--enable-chunked-prefill --max-num-batched-tokens 256":
             "chunked prefill\nbudget 256",
             "--enable-chunked-prefill --max-num-batched-tokens 512": "chunked prefill\nbudget 512",
             "--enable-prefix-caching": "prefix caching"}
    if s in names:
        return names[s]
    if "--preemption-mode" in s:
        return s.split("--preemption-mode")[1].strip() + f" ({FIG2_BLOCKS} blocks)"
    return s


def _cdf(ax, values_ms, label, color=None) -> None:
    import numpy as np

    v = np.sort(np.asarray(values_ms, dtype=float))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label, color=color)


def _bars(ax, labels, values, title, fmt="{:.0f}") -> None:
    bars = ax.bar(range(len(values)), values, color=[f"C{i}" for i in range(len(values))])
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    for b, v in zip(bars, values, strict=True):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _cdf_panel(ax, xlabel: str, title: str, log_x: bool = False) -> None:
    """Axis labels, legend and grid of a CDF panel."""
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)


def _save(plt, fig, title: str, png: str) -> None:
    """Title, layout, docs/<png>, and the figure closed."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, png), dpi=110)
    plt.close(fig)


def plot_fig1(plt) -> None:
    data = _load("docs/results/fig1_chunked_prefill.json")
    pts = list(data["points"])
    extra = os.path.join(RESULTS, "fig1b_chunked_prefill_512.json")
    if os.path.exists(extra):
        pts += _load(extra)["points"]
    labels = [_label(p["setting"]) for p in pts]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    _bars(axes[0], labels, [p["metrics"]["output_throughput"] for p in pts], "output tok/s")
    for ax, key in ((axes[1], "itl"), (axes[2], "tpot")):
        import numpy as np

        x = np.arange(len(pts))
        for j, stat in enumerate(("median", "p99")):
            vals = [p["metrics"][f"{stat}_{key}_ms"] for p in pts]
            bars = ax.bar(x + (j - 0.5) * 0.38, vals, 0.38, label=stat,
                          color="C7" if stat == "median" else "C3")
            for b, v in zip(bars, vals, strict=True):
                ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_title(f"{key.upper()} (ms)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    per = _per_request("fig1_chunked_prefill")
    per.update({f"b-{k}": v for k, v in _per_request("fig1b_chunked_prefill_512").items()})
    by_setting = {(d["config"].get("setting") or "").strip() or "default": d for d in per.values()}
    for i, p in enumerate(pts):
        d = by_setting.get(p["setting"])
        if d is not None:
            itl = [1000 * g for r in d["requests"] if r["success"] for g in r["itl"]]
            _cdf(axes[3], itl, _label(p["setting"]).replace("\n", ", "), color=f"C{i}")
    _cdf_panel(axes[3], "ms (log)", "ITL CDF", log_x=True)
    rate = pts[0]["request_rate"]
    _save(plt, fig, f"Fig. 1  chunked prefill off/on, random 768±50% in / 128 out, "
                    f"{data['num_prompts']} prompts at {rate} req/s (Poisson), 2-core CPU",
          "fig1_chunked_prefill.png")
    _slim("fig1_chunked_prefill", keep_itl=True)
    _slim("fig1b_chunked_prefill_512", keep_itl=True)


def plot_fig2(plt) -> None:
    data = _load("docs/results/fig2_preemption.json")
    pts = data["points"]
    labels = [_label(p["setting"]) if p["setting"] != "default" else "no pressure\n(default cache)"
              for p in pts]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    _bars(axes[0], labels, [p["metrics"]["output_throughput"] for p in pts], "output tok/s")
    _bars(axes[1], labels,
          [p["server_counters"].get("tessera:num_preemptions_total", 0.0) for p in pts],
          "preemptions (tessera:num_preemptions_total delta)")
    _bars(axes[2], labels, [p["metrics"]["median_e2el_ms"] / 1000 for p in pts],
          "median E2E (s)", "{:.1f}")
    _bars(axes[3], labels, [p["metrics"]["p99_tpot_ms"] for p in pts], "p99 TPOT (ms)")
    _save(
        plt,
        fig,
        f"Fig. 2  swap vs recompute under a small KV cache ({FIG2_BLOCKS} blocks of 16), "
        f"random 256 in / 256 out, {data['num_prompts']} prompts at once, "
        "max-num-seqs 64",
        "fig2_preemption.png",
    )
    _slim("fig2_preemption")


def plot_fig3(plt) -> None:
    import numpy as np

    data = _load("docs/results/fig3_prefix_caching.json")
    pts = data["points"]
    settings = list(dict.fromkeys(p["setting"] for p in pts))
    rates = sorted({float(p["request_rate"]) for p in pts})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = np.arange(len(rates))
    w = 0.8 / len(settings)
    for ax, stat in ((axes[0], "median"), (axes[1], "p99")):
        for j, s in enumerate(settings):
            vals = [next(p["metrics"][f"{stat}_ttft_ms"] for p in pts
                         if p["setting"] == s and float(p["request_rate"]) == r) for r in rates]
            bars = ax.bar(x + (j - (len(settings) - 1) / 2) * w, vals, w, label=_label(s))
            for b, v in zip(bars, vals, strict=True):
                ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [f"{r:g} req/s" for r in rates])
        ax.set_title(f"{stat} TTFT (ms)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    per = _per_request("fig3_prefix_caching")
    top = max(rates)
    for key in sorted(per):
        d = per[key]
        if float(d["config"]["request_rate"]) != top:
            continue
        _cdf(axes[2], [1000 * r["ttft"] for r in d["requests"] if r["success"]],
             _label(d["config"].get("setting") or "default"))
    _cdf_panel(axes[2], "ms (log)", f"TTFT CDF at {top:g} req/s", log_x=True)
    _save(plt, fig, f"Fig. 3  prefix caching, `prefix` dataset (512 shared + 32 distinct tokens, "
                    f"32 out), {data['num_prompts']} prompts per rate", "fig3_prefix_caching.png")
    _slim("fig3_prefix_caching")


def plot_fig4(plt) -> None:
    ours = _load("docs/results/fig4_tessera.json")["points"][0]["metrics"]
    hf = _load("docs/results/fig4_hf_static.json")
    per = _per_request("fig4_tessera")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    b = hf["config"]["batch_size"]
    useful, generated = (
        hf["metrics"]["output_throughput"],
        hf["metrics"]["generated_throughput_incl_waste"],
    )
    labels = ["Tessera\n(serve, rate inf)", f"HF static\n(batch {b})"]
    values = [ours["output_throughput"], useful]
    if generated > useful * 1.005:  # with fixed-length outputs (ignore-eos) nothing is wasted
        labels.append(f"HF static\n(batch {b}, incl. waste)")
        values.append(generated)
    _bars(axes[0], labels, values, "output tok/s" + (
        "" if len(values) == 3 else "\n(HF wastes no decode steps: every output is 128 tokens)"))
    for key in sorted(per):
        _cdf(axes[1], [r["e2el"] for r in per[key]["requests"] if r["success"]],
             "Tessera (serve, rate inf)")
    _cdf(axes[1], [r["e2el"] for r in hf["requests"]], f"HF static batching (batch {b})")
    llamacpp_path = os.path.join(RESULTS, "fig4_llamacpp.json")
    if os.path.exists(llamacpp_path):  # only when LLAMA_SERVER_URL was given to `run fig4`
        llamacpp = _load("docs/results/fig4_llamacpp.json")
        axes[0].bar(["llama.cpp\n(llama-server)"], [llamacpp["metrics"]["output_throughput"]])
        _cdf(axes[1], [r["e2el"] for r in llamacpp["requests"] if r.get("success", True)],
             "llama.cpp llama-server")
    _cdf_panel(axes[1], "E2E latency (s), all requests sent at t=0", "E2E latency CDF")
    _save(plt, fig, f"Fig. 4  Tessera vs HF transformers static batching, ShareGPT prompts, "
                    f"{hf['config']['num_prompts']} requests x 128 output tokens (ignore-eos)",
          "fig4_vs_hf.png")
    _slim("fig4_tessera")


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for fn, needs in ((plot_fig1, "fig1_chunked_prefill"), (plot_fig2, "fig2_preemption"),
                      (plot_fig3, "fig3_prefix_caching"), (plot_fig4, "fig4_hf_static")):
        if os.path.exists(os.path.join(RESULTS, f"{needs}.json")):
            fn(plt)
            print(f"plotted {fn.__name__}")
        else:
            print(f"skipped {fn.__name__}: no docs/results/{needs}.json")


def tables() -> None:
    """The markdown tables of docs/performance.md, from docs/results/ (no transcription by hand)."""
    def pts(name):
        path = os.path.join(RESULTS, f"{name}.json")
        return _load(f"docs/results/{name}.json")["points"] if os.path.exists(path) else []

    def ms(m, key):
        return f"{m[f'median_{key}_ms']:.0f} / {m[f'p99_{key}_ms']:.0f}"

    print(
        "| setting | output tok/s | req/s | median / p99 ITL (ms) | median / p99 TPOT (ms) | "
        "median / p99 TTFT (ms) | duration (s) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for name in ("fig1_chunked_prefill", "fig1b_chunked_prefill_512", "fig1_probe"):
        for p in pts(name):
            m = p["metrics"]
            label = _label(p["setting"]).replace("\n", ", ") + (
                ", rate inf (probe)" if name == "fig1_probe" else "")
            print(f"| {label} | {m['output_throughput']:.1f} | {m['request_throughput']:.2f} | "
                  f"{ms(m, 'itl')} | {ms(m, 'tpot')} | {ms(m, 'ttft')} | {m['duration_s']:.1f} |")
    print(
        "\n| setting | output tok/s | duration (s) | preemptions | median / p99 E2E (s) | "
        "median / p99 TPOT (ms) | p99 ITL (ms) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for p in pts("fig2_preemption"):
        m, c = p["metrics"], p["server_counters"]
        label = _label(p["setting"]) if p["setting"] != "default" else "default cache (no pressure)"
        print(
            f"| {label} | {m['output_throughput']:.1f} | {m['duration_s']:.1f} | "
            f"{c.get('tessera:num_preemptions_total', 0):.0f} | {m['median_e2el_ms'] / 1e3:.1f} / "
            f"{m['p99_e2el_ms'] / 1e3:.1f} | {ms(m, 'tpot')} | {m['p99_itl_ms']:.0f} |"
        )
    print(
        "\n| setting | rate | median / p90 / p99 TTFT (ms) | req/s achieved | cache hits / queries "
        "(tokens) |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for p in pts("fig3_prefix_caching"):
        m, c = p["metrics"], p["server_counters"]
        q = c.get("tessera:prefix_cache_queries_total", 0)
        hits = (f"{c.get('tessera:prefix_cache_hits_total', 0):.0f} / {q:.0f} "
                f"({100 * c.get('tessera:prefix_cache_hits_total', 0) / q:.1f}%)") if q else "–"
        print(f"| {_label(p['setting'])} | {p['request_rate']} | {m['median_ttft_ms']:.0f} / "
              f"{m['p90_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} | {m['request_throughput']:.2f} | "
              f"{hits} |")
    ours = pts("fig4_tessera")
    if ours and os.path.exists(os.path.join(RESULTS, "fig4_hf_static.json")):
        m, hf = ours[0]["metrics"], _load("docs/results/fig4_hf_static.json")
        print(
            "\n| engine | output tok/s | req/s | median / p99 E2E (s) |\n| --- | ---: | ---: | "
            "---: |"
        )
        for name, mm in (
            ("Tessera (`tessera serve`, rate inf)", m),
            ("HF static batching", hf["metrics"]),
        ):
            print(f"| {name} | {mm['output_throughput']:.1f} | {mm['request_throughput']:.2f} | "
                  f"{mm['median_e2el_ms'] / 1e3:.1f} / {mm['p99_e2el_ms'] / 1e3:.1f} |")
        print(f"Tessera median TTFT {m['median_ttft_ms'] / 1e3:.1f} s (p99 "
              f"{m['p99_ttft_ms'] / 1e3:.1f}), median TPOT {m['median_tpot_ms']:.0f} ms; HF "
              "batches: " + ", ".join(f"{b['seconds']:.1f} s (padded to {b['padded_prompt_len']})"
                                    for b in hf.get("batches", [])))


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "print":
        for name, cmds in commands().items():
            print(f"# {name}")
            for c in cmds:
                print(c)
        return 0
    if len(argv) == 2 and argv[0] == "run" and argv[1] in ("all", *commands()):
        run(argv[1])
        return 0
    if argv == ["plot"]:
        plot()
        return 0
    if argv == ["tables"]:
        tables()
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    assert not math.isnan(FIG1_RATE)
    sys.exit(main(sys.argv[1:]))
