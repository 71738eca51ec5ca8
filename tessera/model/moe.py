"""The sparse mixture-of-experts block (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE) that replaces a
layer's MLP.

    x [n, hidden] ──router──▶ softmax (float32) ──top-k──▶ (weights [n, k], expert ids [n, k])
                                                           (renormalised when norm_topk_prob)
    group the n·k assignments by expert (one stable sort), then for each expert that has tokens:
        y_e = down_e(act(gate_up_e(x[tokens_e]))) * weights[tokens_e]     one pass over its rows
        out.index_add_(0, tokens_e, y_e)                                   in expert order

Why this shape: a decode step of B tokens with top-k routing touches about E·(1 − (1 − k/E)^B)
of the E experts, so the weights of the others are never read; each touched expert runs its
matmuls once over all of its tokens (M rows), not once per token. The routing is a function of
one token's hidden state only, and each token's k contributions are summed in the same (expert)
order whatever else is in the batch: the block is batch-invariant when its linears are (ours
are: a row's result does not depend on the number of rows).

Experts are whole units (`ExpertMLP`) in a dict keyed by their global id: a rank under expert
parallelism builds the block with the subset it holds (`expert_ids`), and `experts_forward`
returns only those experts' share of the sum (zero rows for tokens routed elsewhere), which a
reduction over the ranks completes. Quantized (GGUF) experts keep their blocks: each expert's
gate|up and down are `QuantLinear`s on its own slice of llama.cpp's 3-D expert tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tessera.kernels.quant_linear import QuantLinear
from tessera.model.config import ModelArchConfig
from tessera.model.layers import Linear, Weight, make_linear

Act = Callable[[torch.Tensor], torch.Tensor]  # [m, 2I] (gate | up) -> [m, I]


def expert_weight_name(prefix: str, expert: int, proj: str) -> str:
    """HF name of one expert's projection ("gate_proj", "up_proj" or "down_proj") under a
    layer's MoE `prefix` (`model.layers.{i}.mlp`)."""
    return f"{prefix}.experts.{expert}.{proj}.weight"


class ExpertMLP:
    """One expert: gate|up fused into one linear (w13), then down (w2)."""

    def __init__(self, w13: Linear | QuantLinear, w2: Linear | QuantLinear, act: Act):
        self.w13 = w13
        self.w2 = w2
        self.act = act

    @property
    def weight_bytes(self) -> int:
        return self.w13.weight_bytes + self.w2.weight_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [m, hidden] -> [m, hidden]
        return self.w2(self.act(self.w13(x)))


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, E] logits -> (weights [n, top_k] float32, expert ids [n, top_k] int64): softmax in
    float32 over all experts, the k largest, divided by their sum when `renormalize`
    (HF's norm_topk_prob; always for Mixtral). Row by row: no token sees another."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE:
    """Router + experts of one MoE layer. `experts` maps a global expert id to its `ExpertMLP`;
    it may hold a subset of the `num_experts` (expert parallelism), the router always scores
    all of them. Qwen2-MoE adds a `shared_expert` every token runs, scaled by
    sigmoid(`shared_expert_gate`(x)) ([1, hidden] weight)."""

    def __init__(
        self,
        router: Linear | QuantLinear,
        experts: dict[int, ExpertMLP],
        num_experts: int,
        top_k: int,
        renormalize: bool,
        shared_expert: ExpertMLP | None = None,
        shared_expert_gate: Linear | QuantLinear | None = None,
    ):
        assert all(0 <= e < num_experts for e in experts), "expert ids within [0, num_experts)"
        assert 1 <= top_k <= num_experts
        self.router = router
        self.experts = experts
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        assert (shared_expert is None) == (shared_expert_gate is None)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    @property
    def local_expert_ids(self) -> list[int]:
        return sorted(self.experts)

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's routed experts (the router and a shared expert aside)."""
        return sum(e.weight_bytes for e in self.experts.values())

    @property
    def dense_weight_bytes(self) -> int:
        """Bytes every step reads whatever the routing: the router and a shared expert."""
        shared = 0
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert.weight_bytes + self.shared_expert_gate.weight_bytes
        return self.router.weight_bytes + shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] (the post-attention norm's output) -> the block's output [n, hidden]
        (this rank's experts' share under expert parallelism)."""
        weights, ids = self.route(x)
        out = self.experts_forward(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))  # [n, 1]
            out.add_(self.shared_expert(x).mul_(gate))
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, top_k] float32, expert ids [n, top_k]) of each token."""
        return route(self.router(x), self.top_k, self.renormalize)

    def experts_forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's chosen experts (those held here) of weight * expert(x).
        Experts with no token this step are skipped: their weights are not read."""
        n, k = topk_ids.shape
        out = torch.zeros_like(x)
        if n == 0:
            return out
        if n == 1:  # batch-1 decode: no grouping to do; the same sums in the same order
            return self._one_token(x, out, topk_weights[0], topk_ids[0].tolist())
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order kept
        tokens = order // k  # [n * k] the token of each sorted assignment
        weights = topk_weights.reshape(-1)[order].to(x.dtype)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            expert = self.experts.get(e)
            if expert is not None:
                rows = tokens[start:end]
                y = expert(x.index_select(0, rows))  # [count, hidden]
                y.mul_(weights[start:end].unsqueeze(1))
                out.index_add_(0, rows, y)
            start = end
        return out

    def _one_token(
        self, x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, ids: list[int]
    ) -> torch.Tensor:
        """`experts_forward` of one token without the sort and the gathers (each a few us of
        dispatch, in every MoE layer of a batch-1 step): its experts in ascending id order, as
        the grouped path adds them, so a token's result does not depend on its batch."""
        w = weights.to(x.dtype)
        for j in sorted(range(len(ids)), key=ids.__getitem__):
            expert = self.experts.get(ids[j])
            if expert is not None:
                out.add_(expert(x).mul_(w[j]))
        return out

    @classmethod
    def from_weights(
        cls,
        cfg: ModelArchConfig,
        w: dict[str, Weight],
        prefix: str,
        dtype: torch.dtype,
        device: torch.device,
        act: Act,
        expert_ids: Iterable[int] | None = None,
    ) -> FusedMoE:
        """The block of the layer whose MoE weights are under `prefix` (`model.layers.{i}.mlp`):
        the router `{prefix}.gate.weight` [E, hidden] and, per expert e in `expert_ids` (default:
        all), `{prefix}.experts.{e}.{gate,up,down}_proj.weight`."""
        ids = range(cfg.num_experts) if expert_ids is None else sorted(set(expert_ids))
        experts: dict[int, ExpertMLP] = {}
        for e in ids:
            def part(proj: str, e: int = e) -> Weight:
                return w[expert_weight_name(prefix, e, proj)]

            w13 = make_linear([part("gate_proj"), part("up_proj")], None, dtype, device)
            w2 = make_linear([part("down_proj")], None, dtype, device)
            experts[e] = ExpertMLP(w13, w2, act)
        router = make_linear([w[f"{prefix}.gate.weight"]], None, dtype, device)
        shared = shared_gate = None
        if cfg.shared_expert_intermediate_size:
            stem = f"{prefix}.shared_expert"
            shared = ExpertMLP(
                make_linear([w[f"{stem}.gate_proj.weight"], w[f"{stem}.up_proj.weight"]], None,
                            dtype, device),
                make_linear([w[f"{stem}.down_proj.weight"]], None, dtype, device), act)
            shared_gate = make_linear([w[f"{prefix}.shared_expert_gate.weight"]], None, dtype,
                                      device)
        return cls(router, experts, cfg.num_experts, cfg.num_experts_per_tok,
                   cfg.norm_topk_prob, shared, shared_gate)
