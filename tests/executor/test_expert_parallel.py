"""Expert parallelism and tensor parallelism on a mixture of experts, in real worker processes:
greedy tokens of EP=2 (`-tp 2 --enable-expert-parallel`: whole experts per rank) and of TP=2
(every expert sliced) equal TP=1 on a tiny Qwen3-MoE (8 experts, top-2, one dense layer); each
rank reads only its share of the checkpoint (its experts, whole, or its slice of every expert);
the flag is accepted and idle with one rank and on a dense model.

Every divergence must be a near-tie of the HF reference (an all-reduce sums in another order);
more than one per run is a bug. Every engine a test builds is shut down by it.
"""

from __future__ import annotations

import logging

import pytest
from greedy_reference import check_greedy
from tiny_llama import save_tiny_llama
from tiny_moe import save_tiny_qwen3_moe

from tessera import LLM, SamplingParams
from tessera.distributed.sharding import ShardPlan, expert_of
from tessera.model.gguf_quant import QuantizedTensor
from tessera.model.loader import load_model, read_model_config
from tests.executor.test_tensor_parallel import Engines

NUM_TOKENS = 10
PROMPTS = [list(range(10, 34)), [7] * 5 + list(range(60, 80)), [3, 5, 9, 33, 2, 8],
           list(range(200, 120, -3))]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    return path, save_tiny_qwen3_moe(path)


@pytest.fixture(scope="module")
def tp1_tokens(tiny_moe):
    """TP=1's greedy tokens, and the bytes of its whole model."""
    path, _ = tiny_moe
    llm = LLM(model=path, max_model_len=256)
    try:
        whole = sum(llm.llm_engine.executor.runner.model.weight_bytes().values())
        return _greedy(llm), whole
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture
def engines():
    e = Engines()
    yield e
    e.close()


def _greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_same(hf_model, expected, got, label: str) -> None:
    ties = [t for p, e, g in zip(PROMPTS, expected, got, strict=True)
            if (t := check_greedy(hf_model, p, e, g))]
    assert len(ties) <= 1, f"more than one near-tie in {label}: {ties}"


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_experts(tiny_moe, rank):
    """The loader under an EP plan returns this rank's experts whole and no other's; under a TP
    plan, a half of every expert. Attention and the router are the same either way."""
    path, _ = tiny_moe
    arch = read_model_config(path)
    ep = ShardPlan.for_arch(arch, rank, 2, expert_parallel=True)
    assert ep.expert_parallel and list(ep.expert_ids) == list(range(4 * rank, 4 * rank + 4))
    _, ep_weights = load_model(path, "none", ep)
    _, tp_weights = load_model(path, "none", ShardPlan.for_arch(arch, rank, 2))
    ep_experts = {expert_of(n) for n in ep_weights} - {None}
    assert ep_experts == set(ep.expert_ids)
    assert {expert_of(n) for n in tp_weights} - {None} == set(range(8))
    up = "model.layers.0.mlp.experts.{}.up_proj.weight"
    assert tuple(ep_weights[up.format(4 * rank)].shape) == (32, 64)  # whole
    assert tuple(tp_weights[up.format(0)].shape) == (16, 64)  # half of each
    router = "model.layers.2.mlp.gate.weight"
    assert tuple(ep_weights[router].shape) == tuple(tp_weights[router].shape) == (8, 64)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        assert ep_weights[name].equal(tp_weights[name])  # the non-expert shards agree


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep2", "tp2"])
def test_two_ranks_equal_one_on_a_tiny_qwen3_moe(tiny_moe, tp1_tokens, engines, expert_parallel):
    path, hf_model = tiny_moe
    expected, whole = tp1_tokens
    llm = engines(path, max_model_len=256, tensor_parallel_size=2,
                  enable_expert_parallel=expert_parallel)
    ex = llm.llm_engine.executor
    assert len(ex.pids) == 2
    # each rank holds about half the weights: half the experts whole, or half of each
    assert all(0.4 * whole < i.weight_bytes < 0.65 * whole for i in ex.rank_infos), (
        whole, [i.weight_bytes for i in ex.rank_infos])
    _assert_same(hf_model, expected, _greedy(llm), "ep2" if expert_parallel else "tp2")
    # no collective beyond TP's: two all-reduces per layer and step, plus the embedding's
    stats = ex.collective_stats()
    assert stats[0]["stats"].num_all_reduce == stats[1]["stats"].num_all_reduce
    assert stats[0]["stats"].num_all_reduce % (2 * 3 + 1) == 0


def test_expert_parallel_with_one_rank_is_idle(tiny_moe, tp1_tokens, caplog):
    path, _ = tiny_moe
    caplog.set_level(logging.INFO, logger="tessera.engine.loading")
    llm = LLM(model=path, max_model_len=256, enable_expert_parallel=True)
    try:
        assert "--enable-expert-parallel with one rank" in caplog.text
        assert _greedy(llm) == tp1_tokens[0]
    finally:
        llm.llm_engine.shutdown()


def test_expert_parallel_on_a_dense_model_shards_as_tp(tmp_path):
    """A dense model has no experts to place: its plan is TP's, rank for rank."""
    save_tiny_llama(str(tmp_path), num_kv_heads=2)
    arch = read_model_config(str(tmp_path))
    for rank in range(2):
        plan = ShardPlan.for_arch(arch, rank, 2, expert_parallel=True)
        assert not plan.expert_parallel
        assert plan == ShardPlan.for_arch(arch, rank, 2)


def test_fused_expert_tensors_split_per_rank(tiny_moe, tmp_path):
    """transformers' in-memory layout, every expert of a layer in one tensor
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), loads per rank as the
    per-expert names do."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path, _ = tiny_moe
    state = load_file(f"{path}/model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for layer in (0, 2):
        stem = f"model.layers.{layer}.mlp.experts"
        parts = [[state.pop(f"{stem}.{e}.{p}.weight") for e in range(8)]
                 for p in ("gate_proj", "up_proj", "down_proj")]
        fused[f"{stem}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(parts[0], parts[1], strict=True)])
        fused[f"{stem}.down_proj"] = torch.stack(parts[2])
    out = tmp_path / "fused"
    out.mkdir()
    shutil.copy(f"{path}/config.json", out / "config.json")
    save_file({**state, **fused}, str(out / "model.safetensors"))
    arch = read_model_config(path)
    for expert_parallel in (True, False):
        plan = ShardPlan.for_arch(arch, 1, 2, expert_parallel=expert_parallel)
        _, want = load_model(path, "none", plan)
        _, got = load_model(str(out), "none", plan)
        assert want.keys() == got.keys() and all(want[n].equal(got[n]) for n in want)


@pytest.mark.parametrize("per_expert", [False, True], ids=["3d-tensors", "tensor-per-expert"])
def test_gguf_experts_stay_quantized_on_their_rank(tmp_path, per_expert):
    """A GGUF file's expert tensors (3-D, or early files' one per expert): under expert
    parallelism a rank keeps its experts whole (quantized ones in their Q8_0 blocks), and none
    of the others'."""
    import gguf

    from tests.model.test_moe_gguf import write_moe_gguf

    save_tiny_qwen3_moe(str(tmp_path / "hf"), mlp_only_layers=[])  # llama.cpp's: all sparse
    path = str(tmp_path / "q8.gguf")
    write_moe_gguf(path, "qwen3moe", str(tmp_path / "hf"), gguf.GGMLQuantizationType.Q8_0,
                   per_expert=per_expert)
    arch = read_model_config(path)
    plan = ShardPlan.for_arch(arch, 1, 2, expert_parallel=True)
    assert plan.intermediate_size is None  # no dense MLP: its width need not shard
    _, weights = load_model(path, "gguf", plan)
    assert {expert_of(n) for n in weights} - {None} == {4, 5, 6, 7}
    down = weights["model.layers.2.mlp.experts.6.down_proj.weight"]
    assert tuple(down.shape) == (64, 32)
    # the test's writer quantizes the 3-D tensors only
    assert isinstance(down, QuantizedTensor) is not per_expert


@pytest.mark.heavy
def test_ep3_uneven_placement_equals_tp1(tmp_path, engines):
    """8 experts on 3 ranks (3, 3, 2), six query heads and three KV heads (one per rank)."""
    hf_model = save_tiny_qwen3_moe(str(tmp_path), num_attention_heads=6, num_key_value_heads=3)
    expected = _greedy(engines(str(tmp_path), max_model_len=256))
    llm = engines(str(tmp_path), max_model_len=256, tensor_parallel_size=3,
                  enable_expert_parallel=True)
    assert len(llm.llm_engine.executor.pids) == 3
    _assert_same(hf_model, expected, _greedy(llm), "ep3")


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_ep2_preemption_chunked_prefill_and_prefix_caching(tiny_moe, engines, mode):
    path, hf_model = tiny_moe
    shared = list(range(30, 70))  # a 40-token common prefix
    prompts = [shared + p for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    expected = run(engines(path, max_model_len=96))
    # 24 blocks of 4 tokens hold 96 of the ~360 the batch wants: preemption all along (the
    # longest request stops at max_model_len, in both runs)
    llm = engines(path, max_model_len=96, tensor_parallel_size=2, enable_expert_parallel=True,
                  num_gpu_blocks_override=24, block_size=4, preemption_mode=mode,
                  swap_space=0.01, enable_chunked_prefill=True, max_num_batched_tokens=16,
                  enable_prefix_caching=True)
    got = run(llm)
    assert llm.get_metrics()["tessera:num_preemptions_total"] > 0
    ties = [t for p, e, g in zip(prompts, expected, got, strict=True)
            if (t := check_greedy(hf_model, p, e, g))]
    assert len(ties) <= 1, ties


@pytest.mark.heavy
@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep2", "tp2"])
def test_qwen2_moe_shared_expert_on_two_ranks(tmp_path, engines, expert_parallel):
    """Qwen2-MoE's shared expert is sliced on every rank under both cuts (the MLP's all-reduce
    sums it once); its sigmoid gate is replicated."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                            max_position_embeddings=512, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(40.0)
    hf_model.save_pretrained(str(tmp_path))
    expected = _greedy(engines(str(tmp_path), max_model_len=256))
    llm = engines(str(tmp_path), max_model_len=256, tensor_parallel_size=2,
                  enable_expert_parallel=expert_parallel)
    _assert_same(hf_model, expected, _greedy(llm), "qwen2-moe")
