"""Batched LoRA on top of the base projections: each adapter's delta is added to the base linear's
output over that adapter's rows only, shrink then expand, as in Punica and S-LoRA:

    y = base(x)                                  dense, GGUF-quantized or TP-sharded: untouched
    for (start, end, adapter) in the step's segments:
        y[start:end] += (x[start:end] @ A^T) @ (B^T * scaling)      shrink [m, R], expand [m, out]

Shrink and expand are `Linear`s (tessera/model/layers.py): on CPU the same packed C++ kernel as the
base projections, which is batch-invariant (a row's result does not depend on the other rows of
its segment, so mixing adapters in a batch changes no bit) and faster than a plain matmul at these
sizes.

A projection the model fuses (q|k|v, gate|up) gets one shrink over its targets' stacked A rows and
one expand through a block-diagonal B, so a fused call costs two matmuls per adapter segment
whatever its number of targets. The segments come from the step's `AttentionMetadata`
(`lora_mapping`, tessera/lora/mapping.py): the runner sorts rows so each adapter's rows are
contiguous, and a segment is a slice, not a gather.

Tensor parallelism: a rank keeps A sharded like its layer's input and B like its output, with the
plan that shards the base weights (tessera/distributed/sharding.py): column-parallel q/k/v and
gate/up keep all of A and their rows of B; row-parallel o and down keep their columns of A and
all of B, and their partial deltas join the base's partial sums in the existing all-reduce.

`attach_lora(model)` wraps the projections of every layer once (the model's own code is not
changed: its layers expose `wqkv`, `wo`, `w13`, `w2`), and wraps `model.forward` to read the
segments from the metadata it is passed. Without a mapping the wrappers return the base output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.lora.peft import LoRAAdapter, target_shapes
from tessera.model.layers import Linear

# a layer's fused projection -> the HF targets stacked along its output features, in order
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w13": ("gate_proj", "up_proj"),
    "w2": ("down_proj",),
}


@dataclass
class LoRAWeights:
    """One adapter ready for one model (its dtype, device and TP shard): per layer, per fused
    projection, (shrink: Linear over A [R, in], expand: Linear over B * scaling [out, R]), absent
    where the adapter skips the projection."""

    lora_int_id: int
    layers: list[dict[str, tuple[Linear, Linear]]]

    @property
    def nbytes(self) -> int:
        return sum(lin.weight_bytes for layer in self.layers for pair in layer.values()
                   for lin in pair)


class _StepState:
    """The mapping of the forward pass under way, shared by one model's wrappers."""

    mapping = None


class LoRALinear:
    """A base projection plus the step's LoRA deltas (see the module docstring)."""

    def __init__(self, base, state: _StepState, layer: int, name: str) -> None:
        self.base = base
        self.state = state
        self.layer = layer
        self.name = name

    def __getattr__(self, attr: str):  # weight_bytes and the like: the base's
        if attr == "base":  # not set yet (copying): no recursion
            raise AttributeError(attr)
        return getattr(self.base, attr)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [n, out]
        mapping = self.state.mapping
        if mapping is None:
            return y
        for start, end, weights in mapping.segments:
            pair = weights.layers[self.layer].get(self.name)
            if pair is None:
                continue
            shrink, expand = pair
            rows = x if end - start == x.shape[0] else x[start:end]
            y[start:end].add_(expand(shrink(rows)))  # [m, R] -> [m, out]
        return y


def attach_lora(model) -> None:
    """Wrap `model`'s projections for LoRA, once (a model shared by several engines is wrapped
    by the first; the wrappers hold no adapter, only the step's mapping while a forward runs)."""
    if getattr(model, "lora_attached", False):
        return
    for layer in model.layers:
        missing = [name for name in FUSED_TARGETS if not hasattr(layer, name)]
        if missing:
            raise ValueError(f"--enable-lora: this model's layers have no {', '.join(missing)} "
                             "projection(s); LoRA serves Llama-family dense layers only")
    state = _StepState()
    for i, layer in enumerate(model.layers):
        for name in FUSED_TARGETS:
            setattr(layer, name, LoRALinear(getattr(layer, name), state, i, name))
    base_forward = model.forward

    def forward(input_ids, positions, kv_caches, meta):
        state.mapping = getattr(meta, "lora_mapping", None) or None
        try:
            return base_forward(input_ids, positions, kv_caches, meta)
        finally:
            state.mapping = None

    model.forward = forward
    model.lora_attached = True


def prepare_weights(adapter: LoRAAdapter, lora_int_id: int, arch, dtype: torch.dtype,
                    device: torch.device, plan=None) -> LoRAWeights:
    """Fuse, shard (for rank `plan`, a ShardPlan, or None), scale and cast an adapter's weights
    into the layout of the model's fused projections."""
    shapes = target_shapes(arch)
    scaling = adapter.config.scaling
    layers: list[dict[str, tuple[Linear, Linear]]] = []
    for i in range(arch.num_hidden_layers):
        fused: dict[str, tuple[Linear, Linear]] = {}
        for name, targets in FUSED_TARGETS.items():
            a_parts, b_parts, out_sizes = [], [], []
            for target in targets:
                out_f, in_f = shapes[target]
                full_name = f"model.layers.{i}.x.{target}.weight"
                local = plan.local_shape(full_name, (out_f, in_f)) if plan else (out_f, in_f)
                out_sizes.append(local[0])
                pair = adapter.weights.get((i, target))
                if pair is None:
                    a_parts.append(None)
                    b_parts.append(None)
                    continue
                a, b = pair  # [r, in], [out, r]
                cut = plan.slice_of(full_name) if plan else None
                if cut is not None and cut[0] == 0:  # column-parallel: B's rows
                    b = b[cut[1] : cut[2]]
                elif cut is not None:  # row-parallel: A's columns
                    a = a[:, cut[1] : cut[2]]
                a_parts.append(a)
                b_parts.append(b * scaling)
            present = [k for k, a in enumerate(a_parts) if a is not None]
            if not present:
                continue
            a_cat = torch.cat([a_parts[k] for k in present])  # [R, in]
            b_blk = torch.zeros(a_cat.shape[0], sum(out_sizes))  # [R, out], block-diagonal
            row = 0
            for k in present:
                r = a_parts[k].shape[0]
                col = sum(out_sizes[:k])
                b_blk[row : row + r, col : col + out_sizes[k]] = b_parts[k].t()
                row += r
            fused[name] = (Linear(a_cat.to(device=device, dtype=dtype)),
                           Linear(b_blk.t().contiguous().to(device=device, dtype=dtype)))
        layers.append(fused)
    return LoRAWeights(lora_int_id, layers)
