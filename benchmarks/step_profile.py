"""Where a whole engine decode step goes, by category, at several batch sizes in one process.

`LLMEngine.step()` on the real model (schedule, runner, sampler, update, output processor), with
greedy requests of `ctx` random prompt tokens that never stop. The batch shrinks from the largest
to the smallest by aborting requests (one prefill for every batch size). For each batch:

1. the step total without instrumentation (median of `steps` steps), then
2. the same number of steps with every building block wrapped in a `perf_counter` timer that
   records *exclusive* time (a wrapper's own time minus that of the wrapped calls inside it), so
   the parts add up to the instrumented step: linears by shape, attention (KV write, attend),
   elementwise (norms, RoPE, SiLU*up, embedding, residual adds), logits, sampling, metadata and the
   engine's bookkeeping (schedule, update_from_output, output processor, Python in between).

`--cpu-time` (benchmarks/runner.py) times everything in this thread's CPU time instead
(`time.thread_time`) with one thread: on cores shared with other jobs the wall clock counts the
time this process waits for a core, the thread's CPU time does not.

`perf_counter` and not `torch.profiler`: CPU ops are synchronous, and the profiler's own per-op
cost distorted small ops here (DESIGN.md). The wrappers cost ~1 us a call (~400 calls a step):
compare the instrumented total with the plain one.

3. the same steps with every C++ kernel call a no-op that only allocates its output
   (`stub_kernels`): what remains is the Python, dispatch and allocation around the kernels, and
   the plain step minus it is the kernels' own time.

    python benchmarks/runner.py --profile 8,16,32,64 [--dtype bfloat16] [--quantization none]
        [--model /tmp/tessera-large-model/llama-1b-random.Q4_0.gguf]
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

import tessera.attention.backend as attn_backend

# the clock of every timer here: time.perf_counter, or time.thread_time (set_clock)
CLOCK = time.perf_counter


def set_clock(clock) -> None:
    global CLOCK
    CLOCK = clock


CATEGORIES = ("linear", "attention", "elementwise", "logits+sampling", "metadata", "bookkeeping")


class ExclusiveTimers:
    """Named timers over wrapped callables; nested wrapped calls are subtracted from their
    parent."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # time spent in children of each open call

    def wrap(self, name: str, fn: Callable) -> Callable:
        seconds, stack, clock = self.seconds, self._stack, CLOCK

        def timed(*args, **kwargs):
            stack.append(0.0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                children = stack.pop()
                seconds[name] += dt - children
                if stack:
                    stack[-1] += dt

        return timed

    def reset(self) -> None:
        self.seconds.clear()


class Patches:
    """setattr with undo."""

    def __init__(self) -> None:
        self._undo: list[tuple[object, str, object, bool]] = []

    def set(self, obj: object, attr: str, value: object) -> None:
        had = attr in getattr(obj, "__dict__", {})
        self._undo.append((obj, attr, obj.__dict__.get(attr) if had else None, had))
        setattr(obj, attr, value)

    def undo(self) -> None:
        for obj, attr, old, had in reversed(self._undo):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
        self._undo.clear()


class _TimedNorm:
    """An RMSNorm whose call is timed (special methods cannot be patched on an instance); its
    add_and_norm is the norm's own (patched there)."""

    def __init__(self, norm, timed_call: Callable) -> None:
        self._norm, self._call = norm, timed_call

    def __call__(self, x):
        return self._call(x)

    def add_and_norm(self, residual, delta):
        return self._norm.add_and_norm(residual, delta)


def _shape(lin) -> str:
    return f"{lin.out_features}x{lin.in_features}"


def instrument(engine, timers: ExclusiveTimers) -> Patches:
    """Wrap the engine's, runner's and model's parts in `timers`, labelled "category: part"."""
    p = Patches()
    w = timers.wrap
    sched, runner = engine.scheduler, engine.executor.runner
    model = runner.model
    p.set(engine, "step", w("bookkeeping: engine step (stats, python)", engine.step))
    p.set(sched, "schedule", w("bookkeeping: schedule", sched.schedule))
    p.set(
        sched, "update_from_output", w("bookkeeping: update_from_output", sched.update_from_output)
    )
    op = engine.output_processor
    p.set(op, "process", w("bookkeeping: output processor", op.process))
    p.set(
        runner, "execute_model", w("bookkeeping: runner (cache ops, python)", runner.execute_model)
    )
    p.set(runner.requests, "update", w("bookkeeping: input batch update", runner.requests.update))
    p.set(runner, "prepare_input", w("metadata: prepare_input (ids, slots)", runner.prepare_input))
    backend = runner.attn_backend
    p.set(backend, "build_metadata", w("metadata: attention tables", backend.build_metadata))
    p.set(runner, "_sample", w("logits+sampling: rows, verify (python)", runner._sample))
    p.set(runner, "sampler", w("logits+sampling: sampler", runner.sampler))
    p.set(model, "compute_logits", w("logits+sampling: gather rows, float", model.compute_logits))
    p.set(model, "forward", w("elementwise: model forward (python)", model.forward))
    p.set(model, "lm_head", w(f"linear: lm_head {_shape(model.lm_head)}", model.lm_head))
    p.set(model, "embed", w("elementwise: embedding", model.embed))
    p.set(model.norm, "add_and_norm", w("elementwise: add+rms_norm", model.norm.add_and_norm))
    p.set(model, "norm", _TimedNorm(model.norm, w("elementwise: rms_norm", model.norm)))
    p.set(model.rope, "lookup", w("elementwise: rope cos/sin lookup", model.rope.lookup))
    p.set(model.rope, "apply_", w("elementwise: rope", model.rope.apply_))
    p.set(attn_backend, "write_kv", w("attention: kv write", attn_backend.write_kv))
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        for attr, role in (("wqkv", "qkv"), ("wo", "o"), ("w13", "gate_up"), ("w2", "down")):
            lin = getattr(layer, attr)
            p.set(layer, attr, w(f"linear: {role} {_shape(lin)}", lin))
        for norm in (layer.input_norm, layer.post_attn_norm):  # the same object may be both
            p.set(norm, "add_and_norm", w("elementwise: add+rms_norm", norm.add_and_norm))
        p.set(layer, "input_norm", _TimedNorm(layer.input_norm, w("elementwise: rms_norm",
                                                                  layer.input_norm)))
        p.set(layer, "act", w("elementwise: silu*up", layer.act))
        timed = w("elementwise: layer (residual add, views, python)", layer)
        timed.window = getattr(layer, "window", None)  # type: ignore[attr-defined]  # forward reads it
        layers[i] = timed
    p.set(model, "layers", layers)
    base = attn_backend.AttentionMetadata
    p.set(base, "forward", w("attention: forward (python, out buffer)", base.forward))
    meta_cls = _metadata_class(backend)
    p.set(meta_cls, "attend", w("attention: attend", meta_cls.attend))
    if "forward" in vars(meta_cls):  # the kernel stores the new K/V in the same call
        p.set(meta_cls, "forward", w("attention: kv write + attend (one call)", meta_cls.forward))
    p.set(base, "forward_qkv", w("attention: forward (python, out buffer)", base.forward_qkv))
    if "forward_qkv" in vars(meta_cls):  # one call on the fused projection's output
        p.set(meta_cls, "forward_qkv",
              w("attention: kv write + attend (one call)", meta_cls.forward_qkv))
    return p


class _NoFusedOps:
    """fused.py's ops as no-ops that only allocate their outputs (see `stub_kernels`)."""

    @staticmethod
    def rms_norm(x, weight, eps):
        return torch.empty_like(x)

    @staticmethod
    def add_rms_norm_(residual, delta, weight, eps):
        return torch.empty_like(residual)

    @staticmethod
    def silu_mul(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @staticmethod
    def rope_(qkv, cos, sin, num_heads, head_dim):
        return None


def stub_kernels(engine) -> Patches:
    """Every C++ kernel call of the model's forward (linears, lm_head, norms, SiLU*up, RoPE,
    attention) replaced by a no-op that allocates its output: what is left of a step is the
    Python, torch dispatch and allocation around the kernels (the engine's bookkeeping and
    metadata included). The tokens are garbage (the logits are zeros), the path is the same."""
    import tessera.attention.paged_kernel as paged_kernel

    def noop(*args, **kwargs):
        return None

    p = Patches()
    model = engine.executor.runner.model
    fake = _NoFusedOps()
    linears = []
    for layer in model.layers:
        linears += [layer.wqkv, layer.wo, layer.w13, layer.w2]
        for norm in {id(n): n for n in (layer.input_norm, layer.post_attn_norm)}.values():
            if norm._fused is not None:
                p.set(norm, "_fused", fake)
        if getattr(layer.act, "_fused", None) is not None:
            p.set(layer.act, "_fused", fake)
    if model.norm._fused is not None:
        p.set(model.norm, "_fused", fake)
    if model.rope._fused is not None:
        p.set(model.rope, "_fused", fake)
    for lin in linears:
        if getattr(lin, "_kernel", None) is not None:  # QuantLinear: writes into its output
            p.set(lin, "_kernel", noop)
            p.set(lin, "_int8_kernel", noop)
        elif getattr(lin, "kernel", None) is not None:  # Linear: the packed dense kernel
            n = lin.out_features
            p.set(lin, "kernel", lambda x, n=n: x.new_empty(x.shape[0], n))
    vocab = model.lm_head.out_features
    p.set(model, "lm_head", lambda h: h.new_zeros(h.shape[0], vocab))

    def no_attention(q, *args, out=None, **kwargs):
        return torch.empty_like(q) if out is None else out

    p.set(paged_kernel, "paged_attention", no_attention)
    backend = engine.executor.runner.attn_backend
    if getattr(backend, "_qkv_kernel", None) is not None:
        def no_qkv_attention(qkv, num_heads, num_kv_heads, k_cache, *args):
            return qkv.new_empty(qkv.shape[0], num_heads * k_cache.shape[3])

        p.set(backend, "_qkv_kernel", no_qkv_attention)
    return p


def _metadata_class(backend) -> type:
    from tessera.attention.paged_kernel import PagedKernelBackend, PagedKernelMetadata
    from tessera.attention.sdpa import SdpaMetadata

    return PagedKernelMetadata if isinstance(backend, PagedKernelBackend) else SdpaMetadata


def _fill(engine, batch: int, ctx: int, seed: int = 0, repeat: bool = False) -> list[str]:
    """`batch` never-stopping greedy requests of `ctx` random prompt tokens (`repeat`: a random
    16-token phrase over and over, which greedy decoding tends to continue, so that n-gram
    drafts get accepted), stepped until every one decodes."""
    from tessera.sampling.params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    ids = []
    for i in range(batch):
        prompt = torch.randint(100, 49000, (16 if repeat else ctx,), generator=gen).tolist()
        prompt = (prompt * (ctx // len(prompt) + 1))[:ctx]
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
        ids.append(f"p{i}")
    # until a step is all decodes (every prompt is in the cache)
    while True:
        before = engine.step_times.num_tokens
        engine.step()
        if (
            engine.step_times.num_tokens - before == batch or repeat
        ) and not engine.scheduler.waiting:
            return ids


def _steps(engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = CLOCK()
        engine.step()
        times.append(CLOCK() - t0)
    return times


def profile_engine(engine, batches: list[int], ctx: int, steps: int) -> list[dict]:
    """One row per batch (largest first): plain and instrumented step ms, ms per part."""
    batches = sorted(batches, reverse=True)
    spec = engine.config.speculative is not None
    running = _fill(engine, batches[0], ctx, repeat=spec)
    rows = []
    for b in batches:
        engine.abort_request(running[b:])
        running = running[:b]
        _steps(engine, 2)  # warm-up at this batch
        plain = statistics.median(_steps(engine, steps))
        timers = ExclusiveTimers()
        patches = instrument(engine, timers)
        try:
            timed = statistics.median(_steps(engine, steps))
            timers.reset()  # the parts of exactly `steps` more steps
            t0 = CLOCK()
            _steps(engine, steps)
            total = (CLOCK() - t0) / steps
        finally:
            patches.undo()
        patches = stub_kernels(engine)
        try:
            _steps(engine, 2)
            stubbed = statistics.median(_steps(engine, steps))
        finally:
            patches.undo()
        sched = engine.scheduler
        context = sum(g.seqs[0].get_len() for g in sched.running) / max(len(sched.running), 1)
        tokens0 = engine.step_times.num_tokens
        _steps(engine, steps)  # tokens per step (verified drafts included)
        tokens = (engine.step_times.num_tokens - tokens0) / steps
        parts = {k: v / steps for k, v in timers.seconds.items()}
        book = sum(
            v
            for k, v in parts.items()
            if k.startswith("bookkeeping: ") and "runner" not in k and "input batch" not in k
        )
        alone, overlapped = overlap_probe(engine, steps, book)
        rows.append(
            {
                "batch": b,
                "plain_ms": plain * 1e3,
                "stub_ms": stubbed * 1e3,
                "instr_ms": timed * 1e3,
                "total_ms": total * 1e3,
                "context": context,
                "parts": parts,
                "tokens": tokens,
                "book_ms": book * 1e3,
                "exec_ms": alone * 1e3,
                "exec_overlap_ms": overlapped * 1e3,
            }
        )
    return rows


def _python_work(seconds: float) -> None:
    """Pure-Python work for about `seconds` (dict and list churn, like the scheduler's)."""
    end = time.perf_counter() + seconds
    d: dict[int, list[int]] = {}
    while time.perf_counter() < end:
        for i in range(200):
            d[i] = [i, i + 1]
        d.clear()


def overlap_probe(engine, steps: int, book_seconds: float) -> tuple[float, float]:
    """Would async scheduling pay? Median execute_model time alone, and with `book_seconds` of
    Python (the step's measured bookkeeping) running on a second thread during it, as the next
    step's scheduling would. Overlap only pays if the second number stays well below the first
    plus `book_seconds`: on two cores the forward's threads already use both."""
    import threading

    executor = engine.executor
    plain_exec = executor.execute_model

    def timed_exec(out, samples, with_thread):
        worker = (
            threading.Thread(target=_python_work, args=(book_seconds,)) if with_thread else None
        )
        t0 = time.perf_counter()
        if worker is not None:
            worker.start()
        res = plain_exec(out)
        t1 = time.perf_counter()
        if worker is not None:
            worker.join()
        samples.append((t1 - t0, time.perf_counter() - t0))
        return res

    results = []
    for with_thread in (False, True):
        samples: list[tuple[float, float]] = []
        executor.execute_model = lambda out, s=samples, w=with_thread: timed_exec(out, s, w)
        try:
            _steps(engine, steps)
        finally:
            del executor.execute_model
        results.append(statistics.median(max(a, b) for a, b in samples))
    return results[0], results[1]


def format_rows(rows: list[dict], title: str) -> str:
    """A markdown table: one column per batch; each part in ms per step and % of the
    instrumented step; category subtotals; the plain step total."""
    parts = sorted({k for r in rows for k in r["parts"]},
                   key=lambda k: (CATEGORIES.index(k.split(":")[0]), k))
    head = "| part | " + " | ".join(f"batch {r['batch']}" for r in rows) + " |"
    lines = [f"### {title}", "", head, "|---" + "|---:" * len(rows) + "|"]

    def cell(ms: float, total: float) -> str:
        return f"{ms:.2f} ({100 * ms / total:.0f}%)"

    for cat in CATEGORIES:
        mine = [k for k in parts if k.split(":")[0] == cat]
        if not mine:
            continue
        subtotal = [sum(r["parts"].get(k, 0.0) for k in mine) * 1e3 for r in rows]
        lines.append(f"| **{cat}** | " + " | ".join(
            f"**{cell(s, r['total_ms'])}**" for s, r in zip(subtotal, rows, strict=True)) + " |")
        for k in mine:
            lines.append(f"| &nbsp; {k.split(': ', 1)[1]} | " + " | ".join(
                cell(r["parts"].get(k, 0.0) * 1e3, r["total_ms"]) for r in rows) + " |")
    summary = [
        ("step, instrumented (sum of parts)", lambda r: f"{r['total_ms']:.2f}"),
        ("**step, plain (median)**", lambda r: f"**{r['plain_ms']:.2f}**"),
        (
            "decode tok/s, plain (requests / step)",
            lambda r: f"{1e3 * r['batch'] / r['plain_ms']:.0f}",
        ),
        (
            "step with every C++ kernel a no-op: Python, dispatch, allocation (median)",
            lambda r: f"{r['stub_ms']:.2f}",
        ),
        (
            "kernels: plain step minus the no-op step",
            lambda r: f"{r['plain_ms'] - r['stub_ms']:.2f}",
        ),
        ("tokens computed per step", lambda r: f"{r['tokens']:.1f}"),
        (
            "async probe: engine-side bookkeeping B (schedule, update, outputs)",
            lambda r: f"{r['book_ms']:.2f}",
        ),
        ("async probe: execute_model alone F", lambda r: f"{r['exec_ms']:.2f}"),
        (
            "async probe: execute_model with B of Python on a 2nd thread",
            lambda r: f"{r['exec_overlap_ms']:.2f}",
        ),
        ("mean context (tokens)", lambda r: f"{r['context']:.0f}"),
    ]
    for label, fmt in summary:
        lines.append(f"| {label} | " + " | ".join(fmt(r) for r in rows) + " |")
    return "\n".join(lines)


def main_profile(batches: list[int], dtype: str, quantization: str, ctx: int, steps: int,
                 speculative_config: dict | None = None, cpu_time: bool = False,
                 model: str | None = None) -> None:
    from tessera.entrypoints.llm import LLM

    t0 = time.perf_counter()
    extra = {} if speculative_config is None else {"speculative_config": speculative_config}
    if cpu_time:  # one thread: its CPU time is the step's
        set_clock(time.thread_time)
        extra["num_threads"] = 1
    if model is not None:
        extra["model"] = model
    llm = LLM(dtype=dtype, quantization=quantization, max_num_seqs=max(batches),
              max_model_len=ctx + 64 * steps, kv_cache_space=1.0, **extra)
    engine = llm.llm_engine
    print(f"engine ready in {time.perf_counter() - t0:.1f} s; threads={torch.get_num_threads()}",
          flush=True)
    rows = profile_engine(engine, batches, ctx, steps)
    what = "" if speculative_config is None else f", speculative {speculative_config}"
    what += ", thread CPU time, 1 thread" if cpu_time else ""
    print(format_rows(rows, f"decode step, {quantization} weights, {dtype}, ctx {ctx}{what}"),
          flush=True)
