"""Disaggregated prefill/decode on this machine: the transport, then serving.

    .venv/bin/python benchmarks/disagg.py transfer   # TcpConnector GB/s on loopback vs memcpy
    .venv/bin/python benchmarks/disagg.py serve      # P/D behind the proxy vs colocated, Poisson
    .venv/bin/python benchmarks/disagg.py plot       # docs/disaggregation.png from the results

`transfer`: the default model's KV geometry (30 layers, 3 KV heads of 64, block 16, fp32). One
pull of N blocks through two TcpConnector worker halves in one process (zmq over 127.0.0.1: the
producer copies the blocks out, zmq moves them, the consumer copies them into its cache), against
a plain in-process copy of the same blocks (index_select + index_copy_, what a shared-memory
transport would cost at best). Median of repeats, GB/s of KV moved.

`serve`: the same Poisson load (`tessera bench serve`, random dataset) against
  - disagg:   a kv_producer pinned to core 0 and a kv_consumer pinned to core 1 (taskset, one
              thread each), behind `tessera proxy`;
  - colocated: one server on both cores (two threads), without and with chunked prefill.
Results go to docs/results/disagg_*.json; run it under `flock -x /work/cpu.lock` (nothing else
may load the two cores: any other process shows in every latency).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "docs", "results")
PYTHON = os.environ.get("TESSERA_PYTHON", sys.executable)
WORKLOAD = os.environ.get(
    "DISAGG_WORKLOAD",
    "--dataset random --random-input-len 512 --random-output-len 64 --random-range-ratio 0.5 "
    "--ignore-eos --num-prompts 32")
RATE = os.environ.get("DISAGG_RATE", "0.6")
SERVER = "--dtype bfloat16 --max-model-len 1024 --kv-cache-space 0.5 --swap-space 0.1"
SETTINGS = {
    "disagg": None,
    "colocated": "",
    "colocated_chunked": "--enable-chunked-prefill --max-num-batched-tokens 256",
}


# -- transfer ----------------------------------------------------------------------------------

def transfer(repeats: int = 15) -> dict:
    import importlib.util

    connectors = ["TcpConnector"]
    if any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13")):
        connectors.append("NixlConnector")
    data = {"geometry": "30 layers x 2 x 16 tokens x 3 heads x 64, fp32 (the default model)"}
    for name in connectors:
        print(f"== {name}")
        data["rows" if name == "TcpConnector" else "nixl_rows"] = _transfer(name, repeats)
    return data


def _transfer(connector: str, repeats: int) -> list[dict]:
    import torch

    from tessera.config import KVTransferConfig
    from tessera.core.kv_connector import KVConnectorMetadata, RemotePrefill
    from tessera.distributed.kv_transfer import create_kv_connector_worker
    from tessera.worker.cache_engine import CacheEngine, KVCacheSpec

    torch.set_num_threads(1)
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.float32)
    num_blocks = 512
    p_cache = CacheEngine(spec, num_blocks, 0, torch.device("cpu"))
    d_cache = CacheEngine(spec, num_blocks, 0, torch.device("cpu"))
    p_cache.gpu_cache.copy_(torch.randn_like(p_cache.gpu_cache))
    producer = create_kv_connector_worker(
        KVTransferConfig(kv_connector=connector, kv_role="kv_producer", kv_port=0), p_cache, "P")
    consumer = create_kv_connector_worker(
        KVTransferConfig(kv_connector=connector, kv_role="kv_consumer"), d_cache, "D")
    rows = []
    try:
        for n in (8, 32, 128):  # 128 .. 2048 tokens
            src = list(range(0, 2 * n, 2))  # scattered, as a real table is
            dst = list(range(num_blocks - 1, num_blocks - 1 - n, -1))
            pulls, copies = [], []
            for i in range(repeats):
                req = f"r{n}-{i}"
                producer.bind_connector_metadata(KVConnectorMetadata(reqs_to_send={req: src}))
                t0 = time.perf_counter()
                consumer.bind_connector_metadata(KVConnectorMetadata(reqs_to_recv={
                    req: RemotePrefill(dst, src, "127.0.0.1", producer.port, "P", req)}))
                while True:
                    _, recv, failed, _ = consumer.get_finished()
                    if recv or failed:
                        break
                    time.sleep(0.0002)  # the engine thread's own work between steps
                pulls.append(time.perf_counter() - t0)
                assert recv == [req], failed
                producer.get_finished()
                t0 = time.perf_counter()
                ids_src = torch.tensor(src)
                ids_dst = torch.tensor(dst)
                d_cache.gpu_cache.index_copy_(
                    2, ids_dst, p_cache.gpu_cache.index_select(2, ids_src)
                )
                copies.append(time.perf_counter() - t0)
            assert torch.equal(d_cache.gpu_cache[:, :, dst], p_cache.gpu_cache[:, :, src])
            nbytes = n * spec.block_bytes
            pull_s, copy_s = statistics.median(pulls), statistics.median(copies)
            rows.append({"num_blocks": n, "num_tokens": n * spec.block_size, "bytes": nbytes,
                         "pull_ms": pull_s * 1e3, "memcpy_ms": copy_s * 1e3,
                         "pull_gbps": nbytes / pull_s / 1e9, "memcpy_gbps": nbytes / copy_s / 1e9})
    finally:
        producer.shutdown()
        consumer.shutdown()
    print(f"{'blocks':>6} {'tokens':>6} {'MB':>7} {'pull ms':>8} {'GB/s':>6} {'memcpy ms':>9} "
          f"{'GB/s':>6} {'memcpy/pull':>11}")
    for r in rows:
        print(f"{r['num_blocks']:>6} {r['num_tokens']:>6} {r['bytes'] / 1e6:>7.1f} "
              f"{r['pull_ms']:>8.2f} {r['pull_gbps']:>6.2f} {r['memcpy_ms']:>9.2f} "
              f"{r['memcpy_gbps']:>6.2f} {r['pull_ms'] / r['memcpy_ms']:>10.1f}x")
    return rows


# -- serve -------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: str, log: str) -> subprocess.Popen:
    f = open(log, "w")  # noqa: SIM115  (lives as long as the process)
    return subprocess.Popen(shlex.split(cmd), stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)


def _wait(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a server exited during start-up (see its log)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def serve_one(name: str, work: str) -> dict:
    serve = f"{PYTHON} -m tessera.entrypoints.cli serve {SERVER} --log-level warning"
    procs: list[subprocess.Popen] = []
    try:
        if SETTINGS[name] is None:
            p_port, d_port, x_port, kv = (_free_port() for _ in range(4))
            producer = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_producer",
                                   "kv_port": kv})
            consumer = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_consumer"})
            procs.append(_start(f"taskset -c 0 {serve} --port {p_port} --kv-transfer-config "
                                f"{shlex.quote(producer)}", f"{work}/{name}_prefill.log"))
            procs.append(_start(f"taskset -c 1 {serve} --port {d_port} --kv-transfer-config "
                                f"{shlex.quote(consumer)}", f"{work}/{name}_decode.log"))
            for port in (p_port, d_port):
                _wait(f"http://127.0.0.1:{port}", procs)
            procs.append(_start(f"{PYTHON} -m tessera.entrypoints.cli proxy --prefill "
                                f"http://127.0.0.1:{p_port} --decode http://127.0.0.1:{d_port} "
                                f"--port {x_port} --log-level warning", f"{work}/{name}_proxy.log"))
            url = f"http://127.0.0.1:{x_port}"
        else:
            port = _free_port()
            procs.append(_start(f"{serve} --port {port} {SETTINGS[name]}", f"{work}/{name}.log"))
            url = f"http://127.0.0.1:{port}"
        _wait(url, procs)
        result = f"{work}/{name}.json"
        bench = (f"{PYTHON} -m tessera.entrypoints.cli bench serve --base-url {url} {WORKLOAD} "
                 f"--request-rate {RATE} --result-file {result} --disable-tqdm --label {name}")
        print(f"== {name}: {bench}", flush=True)
        subprocess.run(shlex.split(bench), cwd=REPO, check=True)
    finally:
        _stop(procs)
    with open(result) as f:
        return json.load(f)["metrics"]


KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_itl_ms", "p99_itl_ms",
        "output_throughput", "request_throughput")


def serve(names: list[str]) -> None:
    work = os.environ.get("DISAGG_WORK", "/tmp/tessera-disagg")
    os.makedirs(work, exist_ok=True)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "disagg_serve.json")
    summary = {}
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
    summary["workload"] = f"{WORKLOAD} --request-rate {RATE}"
    summary["server"] = SERVER
    for name in names:
        m = serve_one(name, work)
        summary.setdefault("runs", {})[name] = {k: m[k] for k in KEYS}
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    print(f"\n{'setting':<20}" + "".join(f"{k:>20}" for k in KEYS))
    for name, m in summary["runs"].items():
        print(f"{name:<20}" + "".join(f"{m[k]:>20.2f}" for k in KEYS))


# -- plot --------------------------------------------------------------------------------------

def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(RESULTS, "disagg_serve.json")) as f:
        serve_data = json.load(f)
    with open(os.path.join(RESULTS, "disagg_transfer.json")) as f:
        transfer_data = json.load(f)
    runs = serve_data["runs"]
    names = [n for n in SETTINGS if n in runs]
    labels = {"disagg": "P core 0 / D core 1\n(proxy)", "colocated": "colocated\n2 cores",
              "colocated_chunked": "colocated, chunked\nprefill (256)"}
    fig, axes = plt.subplots(1, 5, figsize=(19, 4.2))
    panels = [("TTFT (ms)", ("mean_ttft_ms", "p99_ttft_ms")),
              ("TPOT (ms)", ("mean_tpot_ms",)),
              ("ITL (ms)", ("median_itl_ms", "p99_itl_ms")),
              ("output tok/s", ("output_throughput",))]
    colors = ["#4c72b0", "#dd8452"]
    for ax, (title, keys) in zip(axes, panels, strict=False):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(names))]
            vals = [runs[n][key] for n in names]
            ax.bar(xs, vals, width, label=key.split("_")[0] if len(keys) > 1 else None,
                   color=colors[j])
            for x, v in zip(xs, vals, strict=True):
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), [labels[n] for n in names], fontsize=8)
        ax.set_title(title)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    rows = transfer_data["rows"]
    ax = axes[4]
    ax.plot([r["num_tokens"] for r in rows], [r["pull_gbps"] for r in rows], "o-",
            label="TcpConnector pull")
    ax.plot([r["num_tokens"] for r in rows], [r["memcpy_gbps"] for r in rows], "s--",
            label="in-process memcpy")
    nixl = transfer_data.get("nixl_rows")
    if nixl:
        ax.plot([r["num_tokens"] for r in nixl], [r["pull_gbps"] for r in nixl], "^-",
                label="NixlConnector pull (UCX)")
    ax.set_xscale("log")
    ax.set_xticks([r["num_tokens"] for r in rows], [str(r["num_tokens"]) for r in rows])
    ax.minorticks_off()
    ax.set_xlabel("tokens per request (blocks of 16)")
    ax.set_title("KV transfer GB/s (loopback)")
    ax.legend(fontsize=8)
    fig.suptitle(f"Disaggregated prefill/decode on 2 cores: {serve_data['workload']}",
                 fontsize=9)
    fig.tight_layout()
    out = os.path.join(REPO, "docs", "disaggregation.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "transfer"
    if what == "transfer":
        data = transfer()
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "disagg_transfer.json"), "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    elif what == "serve":
        serve(argv[1:] or list(SETTINGS))
    elif what == "plot":
        plot()
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
