"""Batched LoRA on top of the base projections: each adapter's delta is added to the base linear's
output over that adapter's rows only, shrink then expand, as in Punica and S-LoRA:

    y = base(x)                                  dense, GGUF-quantized or TP-sharded: untouched
    for (start, end, slot) in the step's segments, for each target t of the projection:
        y[start:end, out_t] += (x[start:end] @ A_t^T) @ (B_t^T * scaling)   shrink [m, r], expand

The active adapters live in a `LoRABank`: per layer and projection, the slots' A^T stacked
[max_loras, in, targets * max_rank] and B^T [max_loras, max_rank * out] (vLLM's
`lora_a_stacked` / `lora_b_stacked`; A transposed, ranks along the kernel's vector lanes),
fp32 whatever the compute dtype (an adapter of the default
model is ~20 MB at rank 16). A fused projection (q|k|v, gate|up) holds its targets side by side,
so one call shrinks x once against all of them and expands each into its own output columns.

On CPU one C++ call per projection and layer runs every segment (tessera/kernels/lora.cpp): 120
calls a step for the default model, whatever the number of adapters, where a torch call per
segment was ~2,000 with four adapters. It reads only the slots the step names, computes each
row by the same operations whatever else is in the batch (mixing adapters changes no bit), and
adds in place. Elsewhere `lora_add_reference` runs the same sums as torch ops.

The segments come from the step's `AttentionMetadata` (`lora_mapping`, tessera/lora/mapping.py):
the runner sorts rows so each adapter's rows are contiguous, and the worker builds the segment
table once per step; every layer reuses it.

Tensor parallelism: a rank keeps A sharded like its layer's input and B like its output, with the
plan that shards the base weights (tessera/distributed/sharding.py): column-parallel q/k/v and
gate/up keep all of A and their rows of B; row-parallel o and down keep their columns of A and
all of B, and their partial deltas join the base's partial sums in the existing all-reduce.

`attach_lora(model)` wraps the projections of every layer once (the model's own code is not
changed: its layers expose `wqkv`, `wo`, `w13`, `w2`), and wraps `model.forward` to read the
mapping from the metadata it is passed. Without a mapping the wrappers return the base output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.kernels.lora import lora_add_reference, lora_kernel_for
from tessera.lora.peft import LoRAAdapter, target_shapes

# a layer's fused projection -> the HF targets stacked along its output features, in order
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w13": ("gate_proj", "up_proj"),
    "w2": ("down_proj",),
}


@dataclass(frozen=True)
class LoRAWeights:
    """One active adapter: the bank slot that holds it, and the bytes of weights a step reads
    when all its rows run (its ranks' rows only, not the slot's padding)."""

    lora_int_id: int
    slot: int
    nbytes: int


class ProjectionBank:
    """One projection of one layer, every slot: the tensors of the kernel's layout
    (tessera/kernels/lora.cpp), with the ranks also kept as lists for the torch path."""

    def __init__(self, max_loras: int, max_rank: int, in_features: int,
                 out_sizes: list[int], device: torch.device) -> None:
        num_targets = len(out_sizes)
        offsets = [0]
        for n in out_sizes:
            offsets.append(offsets[-1] + n)
        self.max_rank = max_rank
        self.in_features = in_features
        self.out_offsets_list = offsets
        self.ranks_list = [[0] * num_targets for _ in range(max_loras)]
        # [L, K, T * R] (A^T) and [L, R * N]; columns and rows past a slot's ranks never reach y
        self.a = torch.zeros(max_loras, in_features, num_targets * max_rank, device=device)
        self.bt = torch.zeros(max_loras, max_rank * offsets[-1], device=device)
        self.ranks = torch.zeros(max_loras, num_targets, dtype=torch.long)  # host: the kernel's
        self.out_offsets = torch.tensor(offsets, dtype=torch.long)

    def write(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> int:
        """Put one adapter's (A [r, K], B^T [r, out_t]) per target (None: not targeted) in
        `slot`; returns the bytes a step reads of it."""
        nbytes = 0
        offsets = self.out_offsets_list
        for t, part in enumerate(parts):
            rank = 0 if part is None else part[0].shape[0]
            assert rank <= self.max_rank, "load_adapter checks r against --max-lora-rank"
            if part is not None:
                a, bt = part
                o0, o1 = offsets[t], offsets[t + 1]
                r0 = t * self.max_rank
                self.a[slot, :, r0 : r0 + rank].copy_(a.t())
                self.bt[slot, self.max_rank * o0 : self.max_rank * o1].view(
                    self.max_rank, o1 - o0)[:rank].copy_(bt)
                nbytes += (a.numel() + bt.numel()) * self.a.element_size()
            self.ranks[slot, t] = rank
            self.ranks_list[slot][t] = rank
        return nbytes


class LoRABank:
    """The active adapters of one engine's model: `max_loras` slots per layer and projection.
    Owned by the worker's `LoRAManager` (one per engine, so two engines sharing a model never
    share slots); the step's mapping carries it to the model's wrappers."""

    def __init__(self, arch, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, plan=None) -> None:
        self.arch = arch
        self.max_rank = max_rank
        self.plan = plan
        self._kernel = lora_kernel_for(device, dtype)
        shapes = target_shapes(arch)
        self.layers: list[dict[str, ProjectionBank]] = []
        for i in range(arch.num_hidden_layers):
            banks = {}
            for name, targets in FUSED_TARGETS.items():
                local = [self._local_shape(i, t, shapes[t]) for t in targets]
                banks[name] = ProjectionBank(max_loras, max_rank, local[0][1],
                                             [out for out, _ in local], device)
            self.layers.append(banks)

    def _local_shape(self, layer: int, target: str, shape: tuple[int, int]) -> tuple[int, int]:
        if self.plan is None:
            return shape
        out_f, in_f = self.plan.local_shape(f"model.layers.{layer}.x.{target}.weight", shape)
        return out_f, in_f

    def write(self, slot: int, adapter: LoRAAdapter) -> int:
        """Shard (for this rank's plan), scale and store `adapter` in `slot`; returns the bytes
        a step reads of it."""
        scaling = adapter.config.scaling
        nbytes = 0
        for i, banks in enumerate(self.layers):
            for name, targets in FUSED_TARGETS.items():
                parts: list[tuple[torch.Tensor, torch.Tensor] | None] = []
                for target in targets:
                    pair = adapter.weights.get((i, target))
                    if pair is None:
                        parts.append(None)
                        continue
                    a, b = pair  # [r, in], [out, r]
                    cut = (self.plan.slice_of(f"model.layers.{i}.x.{target}.weight")
                           if self.plan is not None else None)
                    if cut is not None and cut[0] == 0:  # column-parallel: B's rows
                        b = b[cut[1] : cut[2]]
                    elif cut is not None:  # row-parallel: A's columns
                        a = a[:, cut[1] : cut[2]]
                    parts.append((a, (b * scaling).t()))
                nbytes += banks[name].write(slot, parts)
        return nbytes

    def add_(self, y: torch.Tensor, x: torch.Tensor, layer: int, name: str,
             mapping) -> None:
        """y [n, out] += the step's LoRA deltas of projection `name` of `layer` on x [n, in]."""
        bank = self.layers[layer][name]
        if self._kernel is not None and y.dtype == x.dtype:
            self._kernel.lora_add_(y, x, mapping.table, bank.a, bank.bt, bank.ranks,
                                   bank.out_offsets)
        else:
            lora_add_reference(y, x, mapping.segments, bank.a, bank.bt, bank.ranks_list,
                               bank.out_offsets_list)


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
        if mapping is not None:
            mapping.bank.add_(y, x, self.layer, self.name, mapping)
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
