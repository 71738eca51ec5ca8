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

import step_instruments as si  # benchmarks/step_instruments.py; si.CLOCK: set_clock rebinds
import torch
from step_instruments import CATEGORIES, ExclusiveTimers, instrument, stub_kernels


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
        t0 = si.CLOCK()
        engine.step()
        times.append(si.CLOCK() - t0)
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
            t0 = si.CLOCK()
            _steps(engine, steps)
            total = (si.CLOCK() - t0) / steps
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
        si.set_clock(time.thread_time)
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
