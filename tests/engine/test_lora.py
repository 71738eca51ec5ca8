"""LoRA adapters (PEFT's format) served by the engine: greedy tokens per adapter equal HF + PEFT's
in fp32; a batch mixing adapters and the base model equals each alone, also under preemption,
chunked prefill, prefix caching (no hit across adapters) and --max-loras 1; bad adapters are
refused naming the field; the worker's CPU cache is LRU up to --max-cpu-loras."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("peft", reason="the LoRA tests build their adapters with peft (dev extra)")

from lora_adapters import ADAPTERS, hf_greedy, save_peft_adapter  # noqa: E402
from tiny_llama import save_tiny_llama  # noqa: E402

from tessera import LLM, LoRARequest, SamplingParams  # noqa: E402

PROMPTS = [[1, 5, 9, 33], list(range(10, 60)), list(range(100, 300, 3))]
NUM_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base path, {name: LoRARequest}, {name or None: [expected tokens per prompt]})."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(str(root / "base"), num_kv_heads=2)
    requests, expected = {}, {None: [hf_greedy(base, p, NUM_TOKENS) for p in PROMPTS]}
    for i, (name, (targets, r, alpha, rslora)) in enumerate(sorted(ADAPTERS.items())):
        path = str(root / name)
        peft_model = save_peft_adapter(base, path, targets, r, alpha, rslora, seed=i + 1)
        requests[name] = LoRARequest(name, i + 1, path)
        expected[name] = [hf_greedy(peft_model, p, NUM_TOKENS) for p in PROMPTS]
    for name in ADAPTERS:  # every adapter changes the output, or the tests prove nothing
        assert expected[name] != expected[None], name
    return str(root / "base"), requests, expected


def _mixed(requests):
    """Every prompt under every adapter and the base, interleaved."""
    names = [None, *sorted(requests)]
    jobs = [(p, name) for i, p in enumerate(PROMPTS) for name in names[i:] + names[:i]]
    loras = [None if name is None else requests[name] for _, name in jobs]
    return jobs, loras


def _check_mixed(llm, requests, expected):
    jobs, loras = _mixed(requests)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], PARAMS, use_tqdm=False,
                        lora_request=loras)
    for (p, name), out in zip(jobs, outs, strict=True):
        assert out.outputs[0].token_ids == expected[name][PROMPTS.index(p)], (name, p[:3])


def test_each_adapter_alone_matches_hf_peft(setup):
    base, requests, expected = setup
    llm = LLM(model=base, enable_lora=True, max_loras=3)
    for name, request in requests.items():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False,
                            lora_request=request)
        assert [o.outputs[0].token_ids for o in outs] == expected[name], name
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[None]
    # a batch mixing the three adapters and the base model equals each alone
    _check_mixed(llm, requests, expected)


@pytest.mark.parametrize("engine_args", [
    # preemption (20 blocks of 4 tokens), chunked prefill (16-token budget), prefix caching
    {"max_loras": 2, "num_gpu_blocks_override": 20, "block_size": 4, "max_model_len": 80,
     "enable_chunked_prefill": True, "max_num_batched_tokens": 16,
     "enable_prefix_caching": True},
], ids=["preempt_chunked_prefix"])
def test_mixed_batch_invariance(setup, engine_args):
    base, requests, expected = setup
    llm = LLM(model=base, enable_lora=True, **engine_args)
    _check_mixed(llm, requests, expected)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.get_metrics()["tessera:num_preemptions_total"] > 0


def test_prefix_cache_never_hits_across_adapters(setup):
    base, requests, expected = setup
    llm = LLM(model=base, enable_lora=True, max_loras=2, enable_prefix_caching=True,
              block_size=4)
    prompt = PROMPTS[2]  # 67 tokens: 16 full blocks
    hits = lambda: llm.get_metrics()["tessera:prefix_cache_hits_total"]  # noqa: E731
    order = [("all7", 0), ("qv", 0), (None, 0), ("qv", 1), ("all7", 1)]  # second run of each hits
    for name, expect_hit in order:
        before = hits()
        out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False,
                           lora_request=None if name is None else requests[name])[0]
        assert out.outputs[0].token_ids == expected[name][2], name
        assert (hits() > before) == bool(expect_hit), (name, hits(), before)


def test_bad_adapters_are_refused_naming_the_field(setup, tmp_path):
    base, requests, _ = setup
    llm_off = LLM(model=base)
    with pytest.raises(ValueError, match="enable-lora"):
        llm_off.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=requests["qv"])
    llm = LLM(model=base, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="lora_path"):
        llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False,
                     lora_request=LoRARequest("nope", 9, str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=r"r \(16\) is larger than --max-lora-rank \(8\)"):
        llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=requests["mlp_rs"])
    # lm_head is not a target the engine serves
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(base)
    bad = str(tmp_path / "lm_head")
    save_peft_adapter(hf, bad, ["q_proj", "lm_head"], 4, 8)
    with pytest.raises(ValueError, match="target_modules"):
        llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=LoRARequest("h", 5, bad))
    dora = str(tmp_path / "dora")
    save_peft_adapter(hf, dora, ["q_proj"], 4, 8, use_dora=True)
    with pytest.raises(ValueError, match="use_dora"):
        llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=LoRARequest("d", 6, dora))
    llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=[requests["all7"]])
    with pytest.raises(ValueError, match="lora_int_id 1 already names"):
        llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False,
                     lora_request=LoRARequest("x", 1, requests["qv"].lora_path))
    assert not llm.llm_engine.has_unfinished_requests()
    with open(os.path.join(requests["qv"].lora_path, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4  # the fixture's adapters are untouched


def test_cpu_cache_is_lru_up_to_max_cpu_loras_and_max_loras_1(setup):
    base, requests, expected = setup
    llm = LLM(model=base, enable_lora=True, max_loras=1, max_cpu_loras=2)
    manager = llm.llm_engine.executor.runner.lora_manager
    for name in ["all7", "qv", "all7", "mlp_rs", "all7", "qv"]:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False,
                           lora_request=requests[name])[0]
        assert out.outputs[0].token_ids == expected[name][0], name
    # loads: all7, qv, (all7 cached), mlp_rs evicts qv, (all7 cached), qv evicts mlp_rs
    assert manager.num_loads == 4
    assert list(manager._cpu) == [requests["all7"].lora_int_id, requests["qv"].lora_int_id]
    assert len(manager._active) == 1 and next(iter(manager._active.values())).nbytes > 0
    # one adapter per step: the mixed batch's other adapters wait their turn, same tokens
    _check_mixed(llm, requests, expected)


@pytest.mark.heavy
def test_tensor_parallel_2_mixed_batch(setup):
    """Each rank holds A sharded like its layer's input and B like its output: TP=2 gives the
    HF + PEFT tokens, adapters and base mixed in one batch."""
    base, requests, expected = setup
    llm = LLM(model=base, enable_lora=True, max_loras=3, tensor_parallel_size=2)
    try:
        _check_mixed(llm, requests, expected)
    finally:
        llm.llm_engine.shutdown()


def _write_adapter(path, arch, layers, r, scale, seed=0):
    """A PEFT-format adapter written directly (A and B random, B times `scale`)."""
    from safetensors.torch import save_file

    from tessera.lora.peft import target_shapes

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        for target, (out_f, in_f) in target_shapes(arch).items():
            kind = "self_attn" if target[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{i}.{kind}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, in_f, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, r, generator=gen) * 0.05 * scale
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                   "target_modules": sorted(target_shapes(arch))}, f)


@pytest.mark.heavy
def test_gguf_base_stays_quantized(default_model_path, tmp_path):
    """The default model (GGUF Q4_1) with adapters: its projections stay QuantLinears under the
    LoRA wrappers; an adapter with B = 0 gives the base tokens exactly; a real one changes them,
    and mixing it with the base in one batch equals each alone."""
    from tessera.kernels.quant_linear import QuantLinear

    llm = LLM(model=default_model_path, enable_lora=True, max_loras=2, max_model_len=256)
    model = llm.llm_engine.executor.runner.model
    arch = model.cfg
    assert all(isinstance(layer.wqkv.base, QuantLinear) for layer in model.layers)
    _write_adapter(str(tmp_path / "zero"), arch, range(arch.num_hidden_layers), 8, 0.0)
    _write_adapter(str(tmp_path / "real"), arch, range(0, arch.num_hidden_layers, 3), 8, 1.0)
    zero = LoRARequest("zero", 1, str(tmp_path / "zero"))
    real = LoRARequest("real", 2, str(tmp_path / "real"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    alone = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False,
                                                                  lora_request=req)]
             for name, req in (("base", None), ("zero", zero), ("real", real))}
    assert alone["zero"] == alone["base"]
    assert alone["real"] != alone["base"]
    mixed = llm.generate(prompts * 2, params, use_tqdm=False, lora_request=[None, real, real, None])
    assert [o.outputs[0].token_ids for o in mixed] == [
        alone["base"][0], alone["real"][1], alone["real"][0], alone["base"][1]]
