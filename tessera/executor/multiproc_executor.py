"""`MultiprocExecutor`: one worker process per tensor-parallel rank (tessera/worker/tp_worker.py),
spawned by the driver, which keeps the engine, the scheduler and the API server.

Each step's `SchedulerOutput` goes, pickled once, down a pipe to rank 0, which broadcasts it to
the others over torch.distributed (tessera/distributed/channel.py); the `ModelRunnerOutput`
comes back up the same pipe from rank 0 alone.

A dead worker never hangs the driver: every wait is on the pipe *and* on each local worker's
process sentinel (`multiprocessing.connection.wait`), so a rank that is killed, crashes, or
reports an error ends the wait at once; the executor then stops every rank it started and raises
`ExecutorDeadError`, which the engine does not try to recover from (its requests fail with the
message, and the server exits non-zero). Ranks on other nodes are watched through rank 0: its
collectives fail when a peer is gone.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import socket
import time
import weakref
from multiprocessing.connection import wait

from tessera.config import ParallelConfig
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.distributed.group import resolve_init_method
from tessera.executor.abstract import Executor, ExecutorDeadError
from tessera.worker.tp_worker import RankInfo, WorkerInit, WorkerLaunch, run_worker

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # seconds a rank gets to exit after "stop" before it is killed


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_method_for(parallel: ParallelConfig) -> str:
    """--distributed-init-method, MASTER_ADDR/MASTER_PORT, or (one node) a free loopback port."""
    if parallel.distributed_init_method is None and not os.environ.get("MASTER_ADDR"):
        return f"tcp://127.0.0.1:{free_loopback_port()}"
    return resolve_init_method(parallel.distributed_init_method)


def spawn_ranks(parallel: ParallelConfig, device: str, init_method: str):
    """Start this node's ranks; returns (processes, the driver's end of rank 0's pipe or None)."""
    ctx = mp.get_context("spawn")
    num_threads = max(1, parallel.threads_per_node // parallel.ranks_per_node)
    conn = child = None
    if 0 in parallel.local_ranks:
        conn, child = ctx.Pipe()
    procs = []
    for local_rank, rank in enumerate(parallel.local_ranks):
        launch = WorkerLaunch(rank, parallel.tensor_parallel_size, init_method, device,
                              num_threads, os.getpid(), local_rank)
        p = ctx.Process(target=run_worker, args=(launch, child if rank == 0 else None),
                        name=f"tessera-tp{rank}", daemon=True)
        p.start()
        procs.append(p)
    if child is not None:
        child.close()
    return procs, conn


def stop_ranks(procs, conn, timeout: float = STOP_TIMEOUT) -> None:
    """Ask politely (rank 0 forwards "stop"), then terminate, then kill: every started process is
    reaped before this returns."""
    if conn is not None:
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(pickle.dumps(("stop", None)))
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()
    if conn is not None:
        conn.close()


class MultiprocExecutor(Executor):
    def __init__(self, parallel: ParallelConfig, init: WorkerInit, device: str) -> None:
        t0 = time.perf_counter()
        self.parallel = parallel
        self.num_gpu_blocks = init.num_gpu_blocks
        self.num_cpu_blocks = init.num_cpu_blocks
        self._dead: ExecutorDeadError | None = None
        self.num_sent = 0  # messages and bytes down the pipe (the benchmark reports the mean)
        self.sent_bytes = 0
        self._procs, self._conn = spawn_ranks(parallel, device, init_method_for(parallel))
        self._finalizer = weakref.finalize(self, stop_ranks, self._procs, self._conn)
        self._send(pickle.dumps(init))
        self.rank_infos: list[RankInfo] = self._receive("ready")
        self.startup_seconds = time.perf_counter() - t0
        for info in self.rank_infos:
            logger.info("tensor-parallel rank %d (pid %d): %.0f MiB resident, %.0f MiB of "
                        "weights, loaded in %.1fs", info.rank, info.pid, info.rss_bytes / 2**20,
                        info.weight_bytes / 2**20, info.load_seconds)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send(pickle.dumps(("step", scheduler_output), protocol=pickle.HIGHEST_PROTOCOL))
        return self._receive("ok")

    def collective_stats(self) -> list[dict]:
        """Per rank: resident bytes now and its `CollectiveStats` (benchmarks read them)."""
        self._send(pickle.dumps(("stats", None)))
        return self._receive("ok")

    def check_health(self) -> None:
        """Between steps: a local rank that died (killed, crashed) is found without a step."""
        if self._dead is not None:
            raise self._dead
        dead = [p for p in self._procs if not p.is_alive()]
        if dead:
            self._fail(self._death_report(dead))

    def shutdown(self) -> None:
        self._finalizer()

    # ---- the pipe, watched together with every rank's life -----------------------------------
    def _send(self, data: bytes) -> None:
        if self._dead is not None:
            raise self._dead
        self.num_sent += 1
        self.sent_bytes += len(data)
        try:
            self._conn.send_bytes(data)
        except (OSError, ValueError) as e:
            self._fail(f"cannot reach tensor-parallel rank 0 ({type(e).__name__}: {e})")

    def _receive(self, expected: str):
        sentinels = {p.sentinel: p for p in self._procs}
        while True:
            ready = wait([self._conn, *sentinels])
            if self._conn in ready:
                try:
                    kind, payload = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death_report() or "tensor-parallel rank 0 closed its pipe")
                if kind == expected:
                    return payload
                self._fail(f"tensor-parallel worker failed: {payload}")
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:
                # a result may still be in the pipe: take it before declaring the death
                if self._conn.poll(0):
                    continue
                self._fail(self._death_report(dead))

    def _death_report(self, dead=()) -> str:
        for p in dead:  # its sentinel fired: the exit status follows within moments
            p.join(1.0)
        gone = [p for p in self._procs if not p.is_alive()]
        if not gone:
            return ""
        return "; ".join(f"tensor-parallel worker {p.name} (pid {p.pid}) died with exit code "
                         f"{p.exitcode}" for p in gone)

    def _fail(self, message: str):
        logger.error("%s: stopping every rank", message)
        self._dead = ExecutorDeadError(message)
        self._finalizer()
        raise self._dead


def run_worker_node(parallel: ParallelConfig, device: str) -> int:
    """`tessera serve --node-rank K` (K > 0): run this node's ranks and wait for them. They take
    the model and engine settings from rank 0 (node 0's flags), so a launch here needs only the
    distributed flags and --device. Exit status: 0 when node 0 stopped them, else non-zero."""
    init_method = resolve_init_method(parallel.distributed_init_method)
    procs, _ = spawn_ranks(parallel, device, init_method)
    logger.info("node %d of %d: ranks %s (pids %s) joining %s", parallel.node_rank,
                parallel.nnodes, list(parallel.local_ranks), [p.pid for p in procs], init_method)
    try:
        sentinels = {p.sentinel: p for p in procs}
        while sentinels:
            for s in wait(list(sentinels)):
                p = sentinels.pop(s)
                p.join()
                if p.exitcode != 0:  # a peer failed: the group is broken, stop the rest
                    logger.error("rank process %s exited with %s", p.name, p.exitcode)
                    stop_ranks(procs, None, timeout=2.0)
                    return 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        stop_ranks(procs, None, timeout=2.0)
