"""The instruments of benchmarks/step_profile.py: exclusive timers wrapped around the engine's
parts (`instrument`), every C++ kernel call as a no-op that only allocates its output
(`stub_kernels`), and the patches that undo both. The clock is `CLOCK` (`set_clock`:
time.perf_counter, or time.thread_time for `--cpu-time`)."""

from __future__ import annotations

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
