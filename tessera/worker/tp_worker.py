"""One tensor-parallel rank: a process that joins the torch.distributed group, loads its shard
of the model, owns its shard of the KV cache and runs every step it is sent.

    driver ──pipe──▶ rank 0 ──BroadcastChannel (gloo)──▶ ranks 1..N-1
    driver ◀──pipe── rank 0   (ModelRunnerOutput: rank 0 is the only one that samples)

Rank 0 lives on the driver's node and relays each message; ranks on other nodes need nothing
but the group (their launch, `tessera serve --node-rank K`, knows no model flags: rank 0
broadcasts the `WorkerInit`). Every message is ("step", SchedulerOutput) | ("stats", None) |
("stop", None).

No orphans: a rank dies with its parent (PR_SET_PDEATHSIG on Linux, and a thread that watches the
parent pid elsewhere), rank 0 exits on EOF of the driver's pipe, and the other ranks exit when a
collective fails because a peer is gone. Any exception in a step ends the rank with a non-zero
status (rank 0 reports it to the driver first): the ranks are in lock-step, so one that fails
leaves the others waiting in a collective that will never complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.config import EngineArgs
from tessera.distributed.channel import BroadcastChannel
from tessera.distributed.group import TensorParallelGroup, backend_for
from tessera.distributed.sharding import ShardPlan

logger = logging.getLogger(__name__)

INIT_TIMEOUT = datetime.timedelta(seconds=600)  # ranks of other nodes may start minutes later


@dataclass
class WorkerInit:
    """What every rank needs to build its runner; sent by the driver to rank 0, broadcast on."""

    engine_args: EngineArgs
    model_path: str
    num_gpu_blocks: int
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...]


@dataclass
class WorkerLaunch:
    """The process arguments of one rank (picklable for the spawn start method)."""

    rank: int
    world_size: int
    init_method: str
    device: str
    num_threads: int
    parent_pid: int
    local_rank: int = 0  # index among this node's ranks: its GPU on CUDA


@dataclass
class RankInfo:
    rank: int
    pid: int
    rss_bytes: int  # resident now
    max_rss_bytes: int  # peak since start (loading included)
    weight_bytes: int
    load_seconds: float


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tessera-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """VmHWM: this process image's peak (getrusage's ru_maxrss would carry over the forked
    parent's peak across the spawn's exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run_worker(launch: WorkerLaunch, conn) -> None:
    """Process entry point of one rank (`conn`: the driver's pipe, rank 0 only)."""
    _die_with_parent(launch.parent_pid)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp{launch.rank} %(name)s: %(message)s")
    torch.set_num_threads(launch.num_threads)
    try:
        code = _serve(launch, conn)
    except BaseException as e:  # noqa: BLE001 (report anything, then exit non-zero)
        logger.error("rank %d failed: %s", launch.rank, e, exc_info=True)
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("error", f"rank {launch.rank}: {type(e).__name__}: {e}\n"
                                    + traceback.format_exc()))
        code = 1
    os._exit(code)  # skip atexit: the group's peers may be gone, and a clean teardown would wait


def _serve(launch: WorkerLaunch, conn) -> int:
    device = torch.device(launch.device)
    backend = backend_for(device)
    if device.type == "cuda":  # one GPU per rank: --device cuda means this node's GPU local_rank
        if device.index is None:
            device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=launch.init_method,
                            world_size=launch.world_size, rank=launch.rank, timeout=INIT_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    channel = BroadcastChannel(cpu_group)
    if launch.rank == 0:
        data = conn.recv_bytes()
        channel.send_bytes(data)
    else:
        data = channel.recv_bytes()
    init: WorkerInit = pickle.loads(data)
    t0 = time.perf_counter()
    runner, tp = build_rank_runner(init, launch.rank, launch.world_size, device)
    info = RankInfo(launch.rank, os.getpid(), rss_bytes(),
                    peak_rss_bytes(),
                    sum(runner.model.weight_bytes().values()), time.perf_counter() - t0)
    infos: list = [None] * launch.world_size
    dist.all_gather_object(infos, info, group=cpu_group)
    if conn is not None:
        conn.send(("ready", infos))
    while True:
        if launch.rank == 0:
            try:
                data = conn.recv_bytes()
            except EOFError:  # the driver is gone: stop the others too
                data = pickle.dumps(("stop", None))
            channel.send_bytes(data)
        else:
            data = channel.recv_bytes()
        kind, payload = pickle.loads(data)
        if kind == "stop":
            return 0
        if kind == "step":
            out = runner.execute_model(payload)
            if conn is not None:
                conn.send_bytes(pickle.dumps(("ok", out), protocol=pickle.HIGHEST_PROTOCOL))
        elif kind == "stats":
            mine = {"rss_bytes": rss_bytes(), "stats": tp.stats, "rank": launch.rank}
            gathered: list = [None] * launch.world_size
            dist.all_gather_object(gathered, mine, group=cpu_group)
            if conn is not None:
                conn.send(("ok", gathered))
        else:
            raise RuntimeError(f"unknown message {kind!r}")


def build_rank_runner(init: WorkerInit, rank: int, world_size: int, device: torch.device):
    """Load this rank's shard (each tensor cut while it is read) and build its runner over its
    shard of the KV cache."""
    from tessera.model.loader import load_model, read_model_config, weight_quantization
    from tessera.model.registry import get_model_class
    from tessera.sampling.grammar import GrammarBackend
    from tessera.worker.cache_engine import CacheEngine, kv_cache_spec
    from tessera.worker.model_runner import ModelRunner

    args = init.engine_args
    arch = read_model_config(init.model_path)
    config = args.create_engine_config(arch.max_position_embeddings, None, arch.uniform_window,
                                       arch.layer_windows)
    plan = ShardPlan.for_arch(arch, rank, world_size, config.parallel.enable_expert_parallel)
    tp = TensorParallelGroup(plan, device)
    quantization = weight_quantization(config.model.quantization, config.model.dtype,
                                       config.device.device, init.model_path)
    _, weights = load_model(init.model_path, quantization, plan)
    dtype = getattr(torch, config.model.dtype)
    torch.manual_seed(config.model.seed)
    model = get_model_class(arch.architecture)(arch, weights, dtype, device,
                                               config.model.max_model_len, tp=tp)
    del weights
    spec = kv_cache_spec(arch, config, plan.num_local_kv_heads)
    cache_engine = CacheEngine(spec, init.num_gpu_blocks, init.num_cpu_blocks, device)
    grammar_backend = None
    if rank == 0:  # the only rank that samples: structured outputs need the tokenizer there
        from tessera.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(init.model_path, arch.architecture)
        grammar_backend = GrammarBackend(tokenizer, arch.vocab_size, init.eos_token_ids)
    runner = ModelRunner(model, cache_engine, config.cache.block_size, device,
                         eos_token_ids=init.eos_token_ids, speculative_config=config.speculative,
                         grammar_backend=grammar_backend, is_driver=rank == 0,
                         lora_config=config.lora)
    return runner, tp
