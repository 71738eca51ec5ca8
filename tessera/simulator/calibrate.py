"""`tessera simulate calibrate`: time the real model runner on this machine over a grid of batch
shapes and fit the profiled cost model (tessera/simulator/fit.py says which model and why).

A shape is (decode sequences D, their context C, prefill tokens P after Pc cached ones, and S
tokens at the start of every context held in blocks they all share, as prefix caching shares a
common prompt prefix). Each is timed with hand-built `SchedulerOutput`s through the real
`ModelRunner.execute_model` (the same persistent batch, attention backend, kernels and sampler
the server runs):

    warm-up steps  D decode requests sent whole with num_computed_tokens = C (their KV is zeros:
                   the timing of attention does not depend on the values), and the prefill;
                   then one step of the steps below (`WARMUP_STEPS`)
    timed steps    the D decodes as diffs (one new token each, as the scheduler sends them), the
                   prefill as a fresh request each time (a prefill always is new)

The median of the timed steps is kept. Swap is timed apart (the cache engine moving blocks out
and in) as seconds per byte. The profile also records the KV geometry and dtype, so the simulator
sizes the KV pools from --kv-cache-space exactly as the server does.
"""

from __future__ import annotations

import itertools
import json
import logging
import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np

from tessera.config import EngineArgs
from tessera.core.context_sharing import num_shared_context_tokens
from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.simulator.batch import BatchShape, batch_shape
from tessera.simulator.cost_model import FEATURES, features
from tessera.simulator.fit import fit_step_times
from tessera.simulator.specs import load_hardware
from tessera.utils import cdiv

logger = logging.getLogger(__name__)

MACHINE_SPEC = "cpu-zen4-2core"  # the hardware spec of the machine calibrated here
# Untimed steps of a shape before its timed ones: the requests sent whole, then one step of diffs.
# The first diff step after a shape's first step ran 1-4 ms slower than the steady decode steps
# a server runs (on this machine, the default model: 16-21 ms against 15-16 for one decode), and
# with two timed steps a shape it bent the fit's per-step cost up by ~15%.
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Shape:
    num_decodes: int
    decode_context: int
    num_prefill_tokens: int
    prefill_context: int = 0
    # the first shared_prefix tokens of every decode's context and of the prefill's cached one
    # (whole blocks of it) are the same blocks: a prefix-cache hit's
    shared_prefix: int = 0


def grid_shapes(name: str) -> list[Shape]:
    """The shapes of a named grid: decodes over contexts, mixed with prefills, prefills alone,
    prefill chunks after a cached context (chunked prefill, prefix hits), and decodes over a
    shared prefix, alone and beside a chunk after the same prefix (prefix caching)."""
    if name == "tiny":  # for tests on a tiny model
        return [Shape(d, c, p) for d in (1, 3) for c in (4, 12) for p in (0, 8)] + [
            Shape(0, 0, 16), Shape(0, 0, 24, 8), Shape(3, 40, 0, 0, 32),
            Shape(3, 40, 8, 32, 32)]
    if name == "small":
        decodes, contexts, prefills = (1, 8, 32, 64), (128, 512), (0, 256)
        alone, chunks = (32, 256, 1024), ((256, 512), (32, 512), (64, 1024))
        mixed = ((8, 128, 256), (8, 248, 128), (32, 32, 512))
        shared = ((2, 576, 0), (8, 576, 0), (32, 576, 0), (8, 576, 32))
    elif name == "default":
        decodes, contexts, prefills = (1, 4, 16, 32, 64), (64, 256, 768), (0, 128, 512)
        alone, chunks = (32, 256, 1024, 2048), ((512, 512), (256, 1536), (32, 512), (64, 1024))
        mixed = ((8, 128, 256), (8, 248, 128), (32, 32, 512), (32, 480, 256))
        shared = ((4, 768, 0), (16, 768, 0), (64, 768, 0), (16, 768, 64))
    else:
        raise ValueError(f"--grid must be tiny, small or default, got {name!r}")
    shapes = [Shape(d, c, p) for d in decodes for c in contexts for p in prefills]
    shapes += [Shape(0, 0, p) for p in alone]
    shapes += [Shape(0, 0, p, pc) for p, pc in chunks]
    # decodes beside a chunk that continues a cached context: every prefill step of chunked
    # prefill, and the cached-prefix steps of prefix caching, look like this
    shapes += [Shape(d, 256, p, pc) for d, p, pc in mixed]
    # the steps of prefix caching: decodes over one shared 512-token prefix, alone and beside
    # a request's first chunk after it (a prefix hit); without them the fit prices the shared
    # blocks as private ones
    shapes += [Shape(d, c, p, 512 if p else 0, 512) for d, c, p in shared]
    return shapes


class _Driver:
    """Builds the messages for one shape and times the runner on them."""

    def __init__(self, runner, block_size: int, vocab_size: int, num_blocks: int) -> None:
        self.runner, self.block_size, self.num_blocks = runner, block_size, num_blocks
        self.rng = np.random.default_rng(0)
        self.vocab_size = vocab_size
        self.params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        self.next_id = 0

    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(3, self.vocab_size - 1, size=n).tolist()

    def _new(self, n_tokens: int, n_computed: int, blocks: list[int]) -> NewRequestData:
        self.next_id += 1
        return NewRequestData(f"cal{self.next_id}", self._tokens(n_tokens), [], self.params,
                              blocks, n_computed)

    def _tables(self, shape: Shape, repeats: int) -> tuple[list[list[int]], list[int], int]:
        """The decodes' block tables and the prefill's, the shared blocks first in each (as a
        prefix-cache hit hands them out), and how many blocks they hold in all."""
        bs = self.block_size
        free = itertools.count()
        shared = [next(free) for _ in range(shape.shared_prefix // bs)]

        def table(num_tokens: int, prefix: list[int]) -> list[int]:
            return prefix + [next(free) for _ in range(cdiv(num_tokens, bs) - len(prefix))]

        decodes = [table(shape.decode_context + repeats + WARMUP_STEPS + 1, shared)
                   for _ in range(shape.num_decodes)]
        pc = shape.prefill_context
        prefill = table(pc + shape.num_prefill_tokens, shared[:pc // bs])
        return decodes, prefill, next(free)

    def fits(self, shape: Shape, repeats: int) -> bool:
        return self._tables(shape, repeats)[2] <= self.num_blocks

    def time_shape(self, shape: Shape, repeats: int) -> tuple[BatchShape, list[float]]:
        c = shape.decode_context
        decode_blocks, prefill_blocks, _ = self._tables(shape, repeats)
        decodes = [self._new(c + 1, c, blocks) for blocks in decode_blocks]
        times = []
        prefill_id = None
        batch = BatchShape()
        for step in range(repeats + WARMUP_STEPS):
            out = SchedulerOutput()
            if step == 0:
                out.scheduled_new_reqs = list(decodes)
            else:
                out.scheduled_cached_reqs = [
                    CachedRequestData(d.req_id, [1], [], False, c + step) for d in decodes]
            for d in decodes:
                out.num_scheduled_tokens[d.req_id] = 1
            if prefill_id is not None:
                out.finished_req_ids.append(prefill_id)
            if shape.num_prefill_tokens:
                pre = self._new(shape.prefill_context + shape.num_prefill_tokens,
                                shape.prefill_context, prefill_blocks)
                out.scheduled_new_reqs.append(pre)
                out.num_scheduled_tokens[pre.req_id] = shape.num_prefill_tokens
                prefill_id = pre.req_id
            out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
            t0 = time.perf_counter()
            self.runner.execute_model(out)
            elapsed = time.perf_counter() - t0
            if step >= WARMUP_STEPS:
                times.append(elapsed)
                ctx = c + step  # the decodes' context before this step
                p, pc = shape.num_prefill_tokens, shape.prefill_context
                reads = [(blocks, ctx + 1) for blocks in decode_blocks]
                reqs = [(1, ctx)] * shape.num_decodes
                if p:
                    reads.append((prefill_blocks, pc + p))
                    reqs.append((p, pc))
                batch = batch_shape(reqs, 0, num_shared_context_tokens(reads, self.block_size))
        done = SchedulerOutput(finished_req_ids=[d.req_id for d in decodes] +
                               ([prefill_id] if prefill_id else []))
        self.runner.execute_model(done)
        return batch, times


def time_swap(cache_engine, num_blocks: int, repeats: int) -> float:
    """Seconds per byte to move `num_blocks` blocks out to swap space and back."""
    n = min(num_blocks, cache_engine.num_gpu_blocks, cache_engine.num_cpu_blocks)
    if n < 1:
        raise ValueError("calibrating swap needs --swap-space > 0 and KV blocks")
    mapping = {i: i for i in range(n)}
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        cache_engine.swap_out(mapping)
        cache_engine.swap_in(mapping)
        best = min(best, time.perf_counter() - t0)
    return best / (2 * n * cache_engine.spec.block_bytes)


class GridProbe:
    """The real runner, loaded once, timed over a grid of shapes in passes, and the profile fitted
    to any set of passes. `calibrate` fits one to all of its passes; the fidelity benchmark
    (benchmarks/simulator_fidelity.py) times a pass between real runs and prices each run with
    the passes on either side of it."""

    def __init__(self, args: EngineArgs, grid: str = "default", repeats: int = 3,
                 bundle=None) -> None:
        from tessera.engine.llm_engine import LLMEngine
        from tessera.engine.loading import build_engine, load_bundle

        self.grid, self.repeats = grid, repeats
        shapes = grid_shapes(grid)
        self.bundle = bundle or load_bundle(args)
        self.engine = build_engine(LLMEngine, args, self.bundle)
        self.runner = self.engine.executor.runner
        self.spec = self.runner.cache_engine.spec
        self.driver = _Driver(self.runner, self.spec.block_size, self.bundle.arch.vocab_size,
                              self.runner.cache_engine.num_gpu_blocks)
        self.shapes = [s for s in shapes if self.driver.fits(s, repeats)]
        for shape in shapes:
            if shape not in self.shapes:
                logger.info("skipping %s: more KV than --kv-cache-space holds", shape)
        self.batches: dict[Shape, BatchShape] = {}

    def time_pass(self) -> dict[Shape, list[float]]:
        """One pass over the grid: each shape's timed steps (seconds)."""
        times = {}
        for shape in self.shapes:
            self.batches[shape], times[shape] = self.driver.time_shape(shape, self.repeats)
        return times

    def profile(self, passes: list[dict[Shape, list[float]]]) -> dict:
        """The profile fitted to `passes` (a shape's time: the median of its timed steps in all
        of them), with the swap rate timed now."""
        import torch

        rows, measured, points = [], [], []
        for shape in self.shapes:
            batch = self.batches[shape]
            seconds = statistics.median(t for p in passes for t in p[shape])
            rows.append(features(batch))
            measured.append(seconds)
            points.append({"shape": shape.__dict__, "batch": {
                k: getattr(batch, k) for k in BatchShape.__dataclass_fields__},
                "seconds": seconds})
            logger.debug("%s: %.1f ms", shape, seconds * 1e3)
        coefs, fit = fit_step_times(rows, measured)
        for point, row in zip(points, rows, strict=True):
            point["fitted_seconds"] = float(np.dot(coefs, row))
        spec, config = self.spec, self.engine.config
        elem = torch.tensor([], dtype=spec.dtype).element_size()
        return {
            "kind": "tessera-simulator-profile",
            "model": self.bundle.path,
            "dtype": config.model.dtype,
            "device": config.device.device,
            "block_size": spec.block_size,
            "max_position_embeddings": self.bundle.arch.max_position_embeddings,
            "kv_geometry": {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
                            "head_dim": spec.head_dim, "elem_size": elem},
            "features": [name for name, _ in FEATURES],
            "coefficients": {name: float(c) for (name, _), c in zip(FEATURES, coefs,
                                                                     strict=True)},
            "swap_s_per_byte": time_swap(self.runner.cache_engine, 256, self.repeats),
            "fit": {**fit, "grid": self.grid, "repeats": self.repeats, "rounds": len(passes)},
            "machine": {"platform": platform.platform(), "processor": platform.processor()},
            # the link a disaggregated consumer pulls KV over, measured on this machine
            # (benchmarks/disagg.py; its source is in the spec)
            "kv_link": load_hardware(MACHINE_SPEC).kv_link,
            "grid": points,
        }

    def close(self) -> None:
        self.engine.shutdown()
        del self.engine, self.runner, self.driver


def calibrate(args: EngineArgs, grid: str = "default", repeats: int = 3,
              output: str | None = None, bundle=None, serving_requests: int = 0,
              rounds: int = 2, serving_runs: int = 1,
              serving_request_rate: float | None = None) -> dict:
    """Load the model as the server would, time every shape of `grid` in `rounds` passes (a
    shape's time: the median of its `repeats` timed steps of every pass), fit, and save the
    profile JSON at `output`. With `serving_requests` > 0, also run the real server
    `serving_runs` times on that many requests of the calibration trace (at
    `serving_request_rate`, serving.TRACE_RATE if None), one run after each pass, and fit the
    serving overhead to their logged steps (serving.py). Returns the profile.

    Why passes, and why interleaved: this machine's speed drifts by 10-20% over minutes (other
    tenants of the host). Shapes timed one after the other in a single pass each saw one moment
    of it, and one slow moment bent the fit. Interleaving the serving runs with the passes makes
    the grid and the server sample the same minutes."""
    from tessera.simulator.serving import ServingRuns

    start = time.perf_counter()
    probe = GridProbe(args, grid, repeats, bundle)
    serving = (ServingRuns(args, serving_requests, serving_request_rate)
               if serving_requests > 0 else None)
    passes = []
    # each round: a pass over the grid, then one real-server run of the calibration trace, so
    # the grid's medians and the serving runs' median see the machine over the same minutes
    for r in range(max(rounds, serving_runs if serving else 0)):
        if r < rounds:
            passes.append(probe.time_pass())
        if serving is not None and r < serving_runs:
            serving.run()
    profile = probe.profile(passes)
    profile["fit"]["calibration_seconds"] = time.perf_counter() - start
    probe.close()
    if serving is not None:
        profile.update(serving.fit(profile))
    if output:
        with open(output, "w", encoding="utf-8") as f:
            json.dump(profile, f, indent=2)
            f.write("\n")
    return profile
