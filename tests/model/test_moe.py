"""The fused expert path (tessera/model/moe.py) against a dense loop over every expert; that it
reads only the experts a step's tokens chose; that a token's output does not depend on its
batch; and that experts split over holders sum to the whole block (expert parallelism)."""

from __future__ import annotations

import pytest
import torch

from tessera.model.layers import Linear, SiluAndMul
from tessera.model.moe import ExpertMLP, FusedMoE, route

E, K, H, INTER = 8, 2, 64, 32


def _block(expert_ids=None, seed: int = 0, renormalize: bool = True, top_k: int = K) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    act = SiluAndMul(torch.device("cpu"), torch.float32)
    experts = {}
    for e in range(E):
        w13 = torch.randn(2 * INTER, H, generator=g) * 0.1
        w2 = torch.randn(H, INTER, generator=g) * 0.1
        if expert_ids is None or e in expert_ids:
            experts[e] = ExpertMLP(Linear(w13), Linear(w2), act)
    router = Linear(torch.randn(E, H, generator=g))
    return FusedMoE(router, experts, E, top_k, renormalize)


def _dense_reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert over every token, weighted by the routing (zero where not chosen)."""
    weights, ids = moe.route(x)
    dense = torch.zeros(x.shape[0], E)
    dense.scatter_(1, ids, weights)
    return sum(dense[:, e : e + 1] * moe.experts[e](x) for e in range(E))


def test_fused_equals_dense_loop():
    moe = _block()
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), _dense_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_route_softmax_topk_and_renormalisation():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)
    w, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, probs[:, [1, 2]])
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1))
    assert w.dtype == torch.float32


def test_only_chosen_experts_are_read():
    moe = _block()
    called: list[int] = []
    for e, expert in moe.experts.items():
        w13 = expert.w13

        def spy(x, e=e, w13=w13):
            called.append(e)
            return w13(x)

        expert.w13 = spy
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    _, ids = moe.route(x)
    moe(x)
    chosen = sorted(set(ids.flatten().tolist()))
    assert len(chosen) < E  # 3 tokens, top-2 of 8: some experts idle
    assert called == chosen  # each chosen expert once, over all of its tokens; no other


def test_batch_invariant():
    """A token alone (the one-token path) equals its row of a batch (the grouped path) bit for
    bit: top-4, so the order of its sum matters."""
    moe = _block(top_k=4)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(3))
    batched = moe(x)
    for i in (0, 7, 15):
        assert torch.equal(moe(x[i : i + 1])[0], batched[i])


@pytest.mark.parametrize("split", [[0, 1, 2, 3], [1, 4, 6]])
def test_expert_subsets_sum_to_the_block(split):
    whole = _block()
    mine = _block(expert_ids=set(split))
    rest = _block(expert_ids=set(range(E)) - set(split))
    assert mine.local_expert_ids == sorted(split)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(mine(x) + rest(x), whole(x), rtol=1e-5, atol=1e-6)
