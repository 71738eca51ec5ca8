"""Mixture-of-experts pricing in the simulator: the expected-experts formula, the shipped
Qwen3-30B-A3B and Mixtral-8x7B configs, HF config names parsed, weight bytes that follow the
experts a step touches, FLOPs that follow the active parameters, and `tessera simulate` on a MoE
config end to end."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.entrypoints.cli import main
from tessera.simulator.batch import BatchShape
from tessera.simulator.roofline import RooflineCostModel
from tessera.simulator.specs import (
    expected_experts_touched,
    load_hardware,
    load_model_config,
    model_config_names,
)


@st.composite
def _routing(draw):
    e = draw(st.integers(1, 512))
    return e, draw(st.integers(1, e))


@given(_routing(), st.integers(0, 100_000))
def test_expected_experts_is_bounded_and_monotone_in_the_batch(routing, b):
    e, k = routing
    touched = expected_experts_touched(e, k, b)
    assert 0.0 <= touched <= min(e, b * k)
    assert expected_experts_touched(e, k, b + 1) >= touched
    if b == 1:
        assert touched == pytest.approx(k)  # one token reads exactly its k experts


def test_expected_experts_by_hand_and_refusals():
    # 128 experts, top-8: 16 tokens miss a given expert with probability (15/16)^16
    assert expected_experts_touched(128, 8, 16) == pytest.approx(128 * (1 - (15 / 16) ** 16))
    assert expected_experts_touched(8, 2, 10_000) == pytest.approx(8.0)
    assert expected_experts_touched(8, 8, 3) == 8.0 and expected_experts_touched(8, 2, 0) == 0.0
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        expected_experts_touched(8, 9, 1)
    with pytest.raises(ValueError, match="num_tokens"):
        expected_experts_touched(8, 2, -1)


@pytest.mark.parametrize("name,total,active", [("Qwen3-30B-A3B", 30.5e9, 3.3e9),
                                               ("Mixtral-8x7B", 46.7e9, 12.9e9)])
def test_shipped_moe_configs_have_the_published_sizes(name, total, active):
    assert name in model_config_names()
    spec = load_model_config(name)
    assert spec.is_moe and spec.num_moe_layers == spec.num_layers
    assert spec.num_params == pytest.approx(total, rel=0.02)
    assert spec.num_active_params == pytest.approx(active, rel=0.02)
    assert spec.sliding_window is None and spec.torch_dtype == "bfloat16"


def test_moe_weight_bytes_grow_with_the_batch_below_the_dense_total():
    spec = load_model_config("Qwen3-30B-A3B")
    every_weight = spec.weight_bytes_per_step("bfloat16")  # every expert read
    per_batch = [spec.weight_bytes_per_step("bfloat16", b) for b in (1, 2, 4, 16, 64, 256)]
    assert per_batch == sorted(per_batch) and len(set(per_batch)) == len(per_batch)
    assert per_batch[-1] < every_weight
    # one token reads its active parameters: everything but the gathered embedding
    embed = spec.vocab_size * spec.hidden_size
    assert per_batch[0] == pytest.approx((spec.num_active_params - embed) * 2)
    # FLOPs follow the active parameters, whatever the batch
    assert spec.linear_flops_per_token == pytest.approx(2 * (spec.num_active_params - 2 * embed))
    dense = load_model_config("Llama-3-8B")
    assert dense.weight_bytes_per_step("bfloat16", 1) == dense.weight_bytes_per_step("bfloat16")


def test_roofline_prices_a_moe_decode_by_the_experts_touched():
    spec, hw = load_model_config("Qwen3-30B-A3B"), load_hardware("H100-SXM")
    model = RooflineCostModel(spec, hw, "bfloat16")
    bw = hw.memory_bandwidth * hw.memory_efficiency

    def decode(b: int) -> BatchShape:
        return BatchShape(num_decode_tokens=b, num_context_tokens=b * 100, num_seqs=b,
                          num_attention_pairs=b * 100)

    assert model.linear_time(decode(1)) == pytest.approx(
        spec.weight_bytes_per_step("bfloat16", 1) / bw)
    # 32 decodes touch ~113 of the 128 experts: more bytes than one, fewer than all
    assert 1.5 * model.linear_time(decode(1)) < model.linear_time(decode(32))
    assert model.linear_time(decode(32)) < spec.weight_bytes_per_step("bfloat16") / bw
    # its batch-1 decode reads ~3 B parameters, less than the dense 8 B model's
    llama = RooflineCostModel(load_model_config("Llama-3-8B"), hw, "bfloat16")
    assert model.linear_time(decode(1)) < 0.5 * llama.linear_time(decode(1))
    # the whole model must fit: every expert is resident
    with pytest.raises(ValueError, match="--kv-cache-space"):
        model.check_fits(30.0)  # 61 GB of weights + 30 GiB > 80 GiB
    # tensor parallelism splits each expert: two ranks read half the bytes
    tp2 = RooflineCostModel(spec, hw, "bfloat16", tensor_parallel_size=2)
    assert tp2.linear_time(decode(8)) == pytest.approx(model.linear_time(decode(8)) / 2)


def _write(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_hf_moe_configs_parse_by_their_field_names(tmp_path):
    transformers = pytest.importorskip("transformers")
    qwen = transformers.Qwen3MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=256, moe_intermediate_size=32,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
    (tmp_path / "qwen").mkdir()
    qwen.to_json_file(str(tmp_path / "qwen" / "config.json"))
    spec = load_model_config(str(tmp_path / "qwen"))
    # layers 1 and 5 are MoE (every second, layer 3 kept dense); 0, 2, 3, 4 are dense
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2, 32)
    assert spec.num_moe_layers == 2 and spec.dense_intermediate_size == 256
    attn = 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2
    linears = 4 * (attn + 3 * 64 * 256) + 2 * (attn + 64 * 8 + 8 * 3 * 64 * 32)
    assert spec.num_params == linears + 2 * 1000 * 64
    mixtral = transformers.MixtralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=None)
    (tmp_path / "mixtral").mkdir()
    mixtral.to_json_file(str(tmp_path / "mixtral" / "config.json"))
    spec = load_model_config(str(tmp_path / "mixtral"))
    assert (spec.num_experts, spec.moe_intermediate_size, spec.num_moe_layers) == (8, 128, 2)
    assert spec.sliding_window is None


def test_shared_expert_and_bad_moe_configs(tmp_path):
    base = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    plain = load_model_config(_write(tmp_path, base))
    shared = load_model_config(_write(tmp_path, {**base, "shared_expert_intermediate_size": 96}))
    # an always-on expert (and its one-output gate) in every token's FLOPs and every step's bytes
    assert shared.linear_flops_per_token - plain.linear_flops_per_token == 2 * 2 * (
        3 * 64 * 96 + 64)
    assert (shared.weight_bytes_per_step("float32", 1) - plain.weight_bytes_per_step("float32", 1)
            == 2 * (3 * 64 * 96 + 64) * 4)
    with pytest.raises(ValueError, match="--model-config .*num_experts_per_tok"):
        load_model_config(_write(tmp_path, {**base, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match="--model-config .*num_experts_per_tok"):
        load_model_config(_write(tmp_path, {**{k: v for k, v in base.items()
                                               if k != "num_experts_per_tok"}}))
    with pytest.raises(ValueError, match="n_routed_experts"):
        load_model_config(_write(tmp_path, {**base, "num_experts": 0, "n_routed_experts": 64}))


def test_roofline_expert_parallel_places_whole_experts(tmp_path):
    hw = load_hardware("H100-SXM")
    base = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
            "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 30}
    spec = load_model_config(_write(tmp_path, base))
    assert spec.dense_intermediate_size is None  # every layer MoE: 256 need not shard
    # -tp 4 slices each expert like a dense MLP: it must divide the expert's width (30)
    with pytest.raises(ValueError, match="moe_intermediate_size \\(30\\).*expert-parallel"):
        RooflineCostModel(spec, hw, "bfloat16", tensor_parallel_size=4)
    # whole experts instead: 6 over 4 ranks is 2, 2, 1, 1; the fullest rank reads 2 of 6
    ep = RooflineCostModel(spec, hw, "bfloat16", tensor_parallel_size=4, expert_parallel=True)
    one = RooflineCostModel(spec, hw, "bfloat16")
    b = BatchShape(num_decode_tokens=4, num_context_tokens=40, num_seqs=4, num_attention_pairs=40)
    bw = hw.memory_bandwidth * hw.memory_efficiency
    total = spec.weight_bytes_per_step("bfloat16", 4)
    experts = spec.expert_bytes_per_step("bfloat16", 4)
    assert 0 < experts < total
    assert ep.linear_time(b) == pytest.approx(((total - experts) / 4 + experts * 2 / 6) / bw)
    assert one.linear_time(b) == pytest.approx(total / bw)
    assert ep.describe()["enable_expert_parallel"]
    with pytest.raises(ValueError, match="--enable-expert-parallel.*num_experts \\(6\\)"):
        RooflineCostModel(spec, hw, "bfloat16", tensor_parallel_size=8, expert_parallel=True)
    # an even split reads what slicing reads; a dense model has no experts to place
    qwen = load_model_config("Qwen3-30B-A3B")
    assert (RooflineCostModel(qwen, hw, "bfloat16", 2, expert_parallel=True).linear_time(b)
            == pytest.approx(RooflineCostModel(qwen, hw, "bfloat16", 2).linear_time(b)))
    llama = RooflineCostModel(load_model_config("Llama-3-8B"), hw, "bfloat16", 2,
                              expert_parallel=True)
    assert not llama.expert_parallel


@pytest.mark.parametrize("parallel", [[], ["-tp", "2", "--enable-expert-parallel"]],
                         ids=["one-device", "ep2"])
def test_simulate_runs_on_the_shipped_qwen3_moe(tmp_path, capsys, parallel):
    result = tmp_path / "sim.json"
    assert main(["simulate", "--model-config", "Qwen3-30B-A3B", "--hardware", "H200",
                 "--dtype", "bfloat16", "--kv-cache-space", "20", "--dataset", "random",
                 "--num-prompts", "16", "--random-input-len", "64", "--random-output-len", "8",
                 *parallel, "--result-file", str(result)]) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    data = json.loads(result.read_text())
    assert data["config"]["model_config"] == "Qwen3-30B-A3B"
    assert data["config"]["enable_expert_parallel"] is bool(parallel)
    m = data["metrics"]
    assert m["completed"] == 16 and m["total_output_tokens"] == 16 * 8
    # a decode step of 16 requests reads ~3.3 B..27 B parameters in bf16 on the H200's 3.84 TB/s
    # effective: between ~1.6 ms and ~14 ms plus the 2 ms overhead (on one device)
    assert 2.5 < m["median_tpot_ms"] < 20.0


def test_roofline_refuses_to_shard_what_the_engine_refuses(tmp_path):
    """OLMoE's q/k norm spans all heads: the engine refuses TP > 1, so the simulator must too."""
    hw = load_hardware("H100-SXM")
    base = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    olmoe = load_model_config(_write(tmp_path, {**base, "architectures": ["OlmoeForCausalLM"]}))
    assert olmoe.architecture == "OlmoeForCausalLM"
    RooflineCostModel(olmoe, hw, "bfloat16")  # one device: fine
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: OlmoeForCausalLM"):
        RooflineCostModel(olmoe, hw, "bfloat16", tensor_parallel_size=2)
    qwen = load_model_config(_write(tmp_path, {**base, "architectures": ["Qwen3MoeForCausalLM"]}))
    assert RooflineCostModel(qwen, hw, "bfloat16", tensor_parallel_size=2).tensor_parallel_size == 2
