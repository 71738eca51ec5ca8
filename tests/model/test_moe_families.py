"""The mixture-of-experts families against HF transformers: tiny random checkpoints (8 experts,
top-2) made with transformers' own config classes, saved with `save_pretrained`, loaded with
`LLM(model=DIR)`.

Router weights are scaled up so that each token's top-2 experts are clear winners (random
routers at the default init sit at near-ties, where any float difference picks another expert);
norm weights are randomised. Checked: prompt logits and greedy tokens against HF; the same
tokens alone and batched, under preemption (both modes) and chunked prefill; the fused expert
path against a dense loop over every expert, touching only the experts its tokens chose; and
configs the engine cannot honour refused at load by field name."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import transformers

from tessera import LLM, SamplingParams
from tests.greedy_reference import check_greedy, hf_greedy

_COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=False, num_experts_per_tok=2)
WINDOW = 12
FAMILIES = {
    # layer 1 dense (mlp_only_layers), experts narrower than the dense MLP, renormalised top-k
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True,
                       mlp_only_layers=[1])),
    # every second layer sparse, a shared expert, bias on q/k/v
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       decoder_sparse_step=2)),
    # q/k norms over the whole projection, clip_qkv, no renormalisation
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=8, clip_qkv=2.0, pad_token_id=0, eos_token_id=2)),
    # Mistral's sliding window, always renormalised
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, sliding_window=WINDOW)),
}
PROMPTS = [list(range(10, 34)), [7] * 5 + list(range(60, 80)), [3, 5, 9, 33, 2, 8]]
MAX_TOKENS = 12


def make_hf_moe(family: str, **overrides):
    """A tiny random HF model of `family` (eval mode, float32)."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # the router: decisive top-2
                p.mul_(40.0)
            elif name.endswith(".bias"):  # Qwen2-MoE's q/k/v biases start at zero
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    model = make_hf_moe(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    expected = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return request.param, str(path), model, expected


def _greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(model, got: list[list[int]], expected: list[list[int]]) -> None:
    for prompt, exp, g in zip(PROMPTS, expected, got, strict=True):
        tie = check_greedy(model, prompt, exp, g)
        assert tie is None or "top-2 gap" in tie


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_logits_match_hf(family, dtype):
    from tessera.model.loader import load_model
    from tessera.model.registry import get_model_class
    from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
    from tessera.worker.model_runner import ModelRunner
    from tessera.worker.static_batch import StaticBatch

    name, path, model, _ = family
    cpu, bs, torch_dtype = torch.device("cpu"), 8, getattr(torch, dtype)
    cfg, weights = load_model(path)
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    ours = get_model_class(cfg.architecture)(cfg, weights, torch_dtype, cpu, 256)
    sparse = {"qwen3_moe": [True, False, True], "qwen2_moe": [False, True, False]}
    assert [layer.moe is not None for layer in ours.layers] == sparse.get(name, [True] * 3)
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs,
                       torch_dtype)
    batch = StaticBatch(ModelRunner(ours, CacheEngine(spec, 32, 0, cpu), bs, cpu), bs)
    prompt = PROMPTS[1]
    got = batch.logits([batch.new_seq(prompt, len(prompt))], all_positions=True).float()
    ref_model = model if dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)
    with torch.inference_mode():
        ref = ref_model(torch.tensor([prompt])).logits[0].float()
    tol = 2e-4 if dtype == "float32" else 0.1
    assert (got - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_greedy_matches_hf_alone_and_batched(family):
    name, path, model, expected = family
    llm = LLM(model=path, max_model_len=256)
    batched = _greedy(llm)
    _check(model, batched, expected)
    alone = [_greedy(llm, [p])[0] for p in PROMPTS]
    assert alone == batched  # batch invariance: the same tokens bit for bit


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3_moe"], indirect=True)
@pytest.mark.parametrize("engine_args", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap"},
    {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
], ids=["recompute", "swap", "chunked"])
def test_invariant_under_scheduling(family, engine_args):
    """All three prompts fit the cache at admission, their outputs do not: preemptions (or
    chunks of 16 tokens); the tokens stay HF's."""
    name, path, model, expected = family
    llm = LLM(model=path, num_gpu_blocks_override=17, block_size=4, max_model_len=64,
              **engine_args)
    _check(model, _greedy(llm), expected)
    if "preemption_mode" in engine_args and name != "mixtral":  # Mixtral's window frees blocks
        assert llm.get_metrics()["tessera:num_preemptions_total"] > 0
    llm.llm_engine.scheduler.block_manager.check_integrity()


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
@pytest.mark.parametrize("field, value", [
    ("num_experts_per_tok", 9),  # more than the 8 experts
    ("hidden_act", "gelu"),  # the experts' gate is SiLU
    ("attention_bias", True),
    ("shared_expert_intermediate_size", 64),  # a shared expert this family does not have
])
def test_refuses_a_config_it_cannot_honour(family, tmp_path, field, value):
    name, path, _, _ = family
    copy = tmp_path / "edited"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config[field] = value
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        LLM(model=str(copy))


@pytest.mark.heavy  # two worker processes
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"], indirect=True)
def test_tensor_parallel_equals_one_rank(family):
    """-tp 2 slices every expert (and the attention) over two ranks: HF's greedy tokens."""
    name, path, model, expected = family
    llm = LLM(model=path, max_model_len=256, tensor_parallel_size=2)
    try:
        _check(model, _greedy(llm), expected)
    finally:
        llm.llm_engine.executor.shutdown()


@pytest.mark.parametrize("family", ["olmoe"], indirect=True)
def test_olmoe_refuses_tensor_parallel(family):
    """Its q/k norm spans every head: refused before any worker starts, naming the flag."""
    with pytest.raises(ValueError, match="--tensor-parallel-size 2"):
        LLM(model=family[1], tensor_parallel_size=2)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"], indirect=True)
def test_transformers_fused_expert_layout(family, tmp_path):
    """transformers' in-memory layout (every expert of a layer in one `experts.gate_up_proj`
    [E, 2I, H] and `experts.down_proj` [E, H, I]) loads as the per-expert checkpoint does."""
    from safetensors.torch import save_file

    from tessera.model.loader import load_model

    name, path, model, _ = family
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    _, fused = load_model(str(tmp_path))
    _, per_expert = load_model(path)
    assert fused.keys() == per_expert.keys()
    assert all(torch.equal(fused[k], per_expert[k]) for k in fused)
