"""The shard plan, without processes: every rank's slices put back together are the whole tensor
(dense, and GGUF blocks bit for bit), KV heads split or replicated as docs/tensor_parallel.md says,
and an unshardable size is refused before any weight is read, naming the numbers."""

from __future__ import annotations

import gguf
import pytest
import torch
from quant_weights import random_weight

from tessera.config import EngineArgs, ParallelConfig
from tessera.distributed.sharding import ShardPlan, check_shardable, expert_of, expert_placement
from tessera.entrypoints.cli import build_parser, engine_args_from
from tessera.model.config import ModelArchConfig
from tessera.model.gguf_quant import QuantizedTensor


def _arch(num_heads=4, num_kv_heads=2, vocab=321) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=64, intermediate_size=192,
        num_hidden_layers=1, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=False, attention_bias=True,
        bos_token_id=None, eos_token_ids=(),
    )


@pytest.mark.parametrize("num_heads, num_kv_heads, n", [(4, 2, 2), (4, 4, 2), (4, 1, 2),
                                                        (8, 2, 4), (9, 3, 3), (4, 2, 1)])
def test_shards_reassemble_the_whole(num_heads, num_kv_heads, n):
    arch = _arch(num_heads, num_kv_heads)
    g = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=g) for name, shape in arch.weight_shapes().items()}
    plans = [ShardPlan.for_arch(arch, r, n) for r in range(n)]
    shards = [{name: p.shard(name, t) for name, t in full.items()} for p in plans]
    d = arch.head_dim
    for name, t in full.items():
        parts = [s[name] for s in shards]
        for p, part in zip(plans, parts, strict=True):
            assert tuple(part.shape) == p.local_shape(name, tuple(t.shape)), name
        leaf = name.rsplit(".", 2)[-2]
        if leaf in ("k_proj", "v_proj") and plans[0].kv_replicated:
            # each rank keeps the KV head its query heads read: head r // (n / kv)
            for r, part in enumerate(parts):
                head = r // (n // num_kv_heads)
                assert torch.equal(part, t[head * d : (head + 1) * d]), name
            assert plans[0].num_local_kv_heads == 1
        elif leaf in ("o_proj", "down_proj") and t.dim() == 2:
            assert torch.equal(torch.cat(parts, dim=1), t), name
        elif plans[0].slice_of(name) is None:
            assert all(part is t for part in parts), name  # replicated: norms
        else:
            assert torch.equal(torch.cat(parts, dim=0), t), name
    # query heads per rank, and which KV head each reads, agree with the unsharded grouping
    group = num_heads // num_kv_heads
    for p in plans:
        first_q = p.rank * p.num_local_heads
        kv_of_q = {(first_q + h) // group for h in range(p.num_local_heads)}
        assert kv_of_q <= set(range(p.first_kv_head, p.first_kv_head + p.num_local_kv_heads))


def test_vocab_shards_of_an_uneven_vocabulary():
    plans = [ShardPlan.for_arch(_arch(vocab=321), r, 2) for r in range(2)]
    assert [p.vocab_range for p in plans] == [(0, 161), (161, 321)]
    assert plans[1].vocab_shard_size == 161  # the short last shard is padded for the gather


@pytest.mark.parametrize(
    "qtype",
    [
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q4_K,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q6_K,
    ],
)
def test_quantized_shards_are_whole_blocks_bit_for_bit(qtype):
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    w = random_weight(qtype, 96, 4 * 256)
    dense = w.dequantize()
    for dim, start, stop in [(0, 48, 96), (1, 256, 512), (1, 0, 512)]:
        part = w.shard(dim, start, stop)
        assert isinstance(part, QuantizedTensor)  # whole blocks: still quantized
        ref = dense[start:stop] if dim == 0 else dense[:, start:stop]
        assert torch.equal(part.dequantize(), ref)
    if block == 32:  # off the 256-value grid but on the 32 one: still blocks
        assert isinstance(w.shard(1, 32, 96), QuantizedTensor)
    off = w.shard(1, 16, 80)  # off the grid: dequantized, same values
    assert isinstance(off, torch.Tensor) and torch.equal(off, dense[:, 16:80])


@pytest.mark.parametrize(
    "qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q5_K,
              gguf.GGMLQuantizationType.Q5_1], ids=lambda t: t.name
)
def test_integer_path_shards_stay_on_the_integer_path(qtype):
    """A `--quantization gguf_int8` weight's shards pack for the integer kernel too, not in the
    exact path's panels, with the same values."""
    w = random_weight(qtype, 96, 4 * 256, int8=True)
    dense = w.dequantize()
    for dim, start, stop in [(0, 48, 96), (1, 256, 512)]:
        part = w.shard(dim, start, stop)
        assert isinstance(part, QuantizedTensor) and part.int8
        assert part.pack().fmt.row_major  # the integer path's records
        ref = dense[start:stop] if dim == 0 else dense[:, start:stop]
        assert torch.equal(part.dequantize(), ref)


@pytest.mark.parametrize("heads, kv, inter, n, fragment", [
    (9, 3, 1536, 2, "num_attention_heads (9)"),
    (12, 3, 1536, 2, "num_key_value_heads (3)"),
    (8, 8, 1537, 2, "intermediate_size (1537)"),
])
def test_unshardable_sizes_are_refused_naming_the_numbers(heads, kv, inter, n, fragment):
    with pytest.raises(
        ValueError,
        match=rf"--tensor-parallel-size {n}.*{fragment.replace('(', '[(]').replace(')', '[)]')}",
    ):
        check_shardable(heads, kv, inter, n)


def test_default_model_with_tp2_is_refused_before_loading(monkeypatch, default_model_path):
    """SmolLM2-135M has 9 heads: TP=2 is refused from the shapes, before any rank starts or any
    weight is read."""
    import tessera.engine.loading as loading
    import tessera.executor.multiproc_executor as mpe
    import tessera.model.loader as loader
    from tessera import LLM

    def forbidden(*a, **k):
        raise AssertionError("must not be called")

    # both names: a module first imported under the patch would keep `forbidden` for good
    monkeypatch.setattr(loader, "load_model", forbidden)
    monkeypatch.setattr(loading, "load_model", forbidden)
    monkeypatch.setattr(mpe, "spawn_ranks", forbidden)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 .*num_attention_heads \(9\)"):
        LLM(tensor_parallel_size=2)


def test_parallel_flags_and_validation():
    ns = build_parser().parse_args(["serve", "-tp", "4", "--nnodes", "2", "--node-rank", "1",
                                    "--distributed-init-method", "tcp://127.0.0.1:29511"])
    parallel = engine_args_from(ns).create_engine_config().parallel
    assert (parallel.tensor_parallel_size, parallel.nnodes, parallel.node_rank) == (4, 2, 1)
    assert parallel.distributed_init_method == "tcp://127.0.0.1:29511"
    assert list(parallel.local_ranks) == [2, 3]
    assert EngineArgs().create_engine_config().parallel == ParallelConfig()
    for kwargs, flag in [({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
                         ({"tensor_parallel_size": 3, "nnodes": 2,
                           "distributed_init_method": "tcp://h:1"}, "--nnodes"),
                         ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2,
                           "distributed_init_method": "tcp://h:1"}, "--node-rank"),
                         ({"distributed_init_method": "http://x"}, "--distributed-init-method")]:
        with pytest.raises(ValueError, match=flag):
            ParallelConfig(**kwargs)


def test_draft_model_speculation_is_refused_under_tensor_parallelism():
    args = EngineArgs(tensor_parallel_size=2,
                      speculative_config={"method": "draft_model", "model": "draft.gguf"})
    with pytest.raises(ValueError, match="draft_model.*--tensor-parallel-size 2"):
        args.create_engine_config()


def test_kv_transfer_is_refused_under_tensor_parallelism():
    args = EngineArgs(tensor_parallel_size=2,
                      kv_transfer_config={"kv_connector": "TcpConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_transfer_config.*--tensor-parallel-size 2"):
        args.create_engine_config()


# ---- mixtures of experts ---------------------------------------------------------------------


def _moe_plan(rank: int, n: int, num_experts: int = 8, expert_parallel: bool = True,
              moe_intermediate_size: int = 32) -> ShardPlan:
    return ShardPlan(rank, n, num_heads=12, num_kv_heads=12, head_dim=16, intermediate_size=None,
                     vocab_size=321, moe_intermediate_size=moe_intermediate_size,
                     num_experts=num_experts, expert_parallel=expert_parallel)


@pytest.mark.parametrize("num_experts, n, sizes", [(8, 2, [4, 4]), (8, 4, [2, 2, 2, 2]),
                                                  (8, 3, [3, 3, 2]), (6, 4, [2, 2, 1, 1]),
                                                  (4, 4, [1, 1, 1, 1]), (8, 1, [8])])
def test_expert_placement_covers_every_expert_once(num_experts, n, sizes):
    placement = expert_placement(num_experts, n)
    assert [len(r) for r in placement] == sizes
    assert [e for r in placement for e in r] == list(range(num_experts))  # contiguous, in order
    plans = [_moe_plan(r, n, num_experts) for r in range(n)]
    assert [list(p.expert_ids) for p in plans] == [list(r) for r in placement]
    name = "model.layers.0.mlp.experts.{}.down_proj.weight"
    for e in range(num_experts):  # each expert's weights held (whole) by exactly one rank
        owners = [p.rank for p in plans if p.holds(name.format(e))]
        assert owners == [next(r for r, block in enumerate(placement) if e in block)]
        assert all(p.slice_of(name.format(e)) is None for p in plans)
    # the router, attention and norms are every rank's
    assert all(p.holds("model.layers.0.mlp.gate.weight") for p in plans)
    assert all(p.holds("model.layers.0.self_attn.q_proj.weight") for p in plans)


def test_more_ranks_than_experts_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--enable-expert-parallel .*-size 4.*num_experts \(2\)"):
        expert_placement(2, 4)
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        _moe_plan(0, 4, num_experts=2)


def test_without_expert_parallel_every_expert_is_sliced():
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(30, 64, generator=g)  # [moe_intermediate, hidden]
    down = torch.randn(64, 30, generator=g)
    plans = [_moe_plan(r, 2, expert_parallel=False, moe_intermediate_size=30) for r in range(2)]
    assert all(p.holds("model.layers.0.mlp.experts.7.up_proj.weight") for p in plans)
    assert all(list(p.expert_ids) == list(range(8)) for p in plans)
    up_name, down_name = ("model.layers.0.mlp.experts.5.up_proj.weight",
                          "model.layers.0.mlp.experts.5.down_proj.weight")
    assert torch.equal(torch.cat([p.shard(up_name, gate) for p in plans], dim=0), gate)
    assert torch.equal(torch.cat([p.shard(down_name, down) for p in plans], dim=1), down)
    assert plans[1].local_shape(up_name, (30, 64)) == (15, 64)
    # a width the ranks cannot split is refused, pointing at whole experts instead
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\).*--enable-expert-par"):
        _moe_plan(0, 4, expert_parallel=False, moe_intermediate_size=30)
    _moe_plan(0, 4, expert_parallel=True, moe_intermediate_size=30)  # whole experts: fine
    assert expert_of("model.layers.3.mlp.experts.12.gate_proj.weight") == 12
    assert expert_of("model.layers.3.mlp.gate.weight") is None


def test_expert_parallel_flag():
    ns = build_parser().parse_args(["serve", "-tp", "2", "--enable-expert-parallel"])
    assert engine_args_from(ns).create_engine_config().parallel.enable_expert_parallel
    assert not EngineArgs().create_engine_config().parallel.enable_expert_parallel


def test_all_head_qk_norm_and_shared_expert_refusals():
    with pytest.raises(ValueError, match="OlmoeForCausalLM normalises q and k over all heads"):
        check_shardable(8, 8, 256, 2, architecture="OlmoeForCausalLM")
    check_shardable(8, 8, 256, 1, architecture="OlmoeForCausalLM")  # one rank: nothing to slice
    check_shardable(8, 8, 256, 2, architecture="Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        check_shardable(8, 8, 256, 2, shared_expert_intermediate_size=97)
