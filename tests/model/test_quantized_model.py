"""The default model with its GGUF weights kept quantized against the same weights dequantized to
fp32 (--quantization none), whose own reference is HF on the GGUF (tests/model/test_llama_vs_hf.py).

--quantization gguf (the `model_bundle` fixture): with the C++ kernels the quantized linears equal
the dense ones on gguf's dequantized weights bit for bit, so tokens and logprobs are identical; on
the torch fallback only the near-tie rule holds.

--quantization gguf_int8 (llama.cpp's numeric form): activations rounded
per row to 8-bit blocks, so logits move by ~1e-2; greedy tokens agree with the dequantized model
except where its top two logits are close, and batching, chunking and prefix caching still never
change a token.

--quantization gguf_int8_a16: the same integer products with a residual plane that holds the
activations to 16 bits (~5e-6 relative error), so greedy tokens equal the dequantized model's.
"""

from __future__ import annotations

import pytest
import torch
from greedy_reference import check_greedy

from tessera import SamplingParams
from tessera.kernels.quant_linear import QuantLinear, quant_kernel_supported

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
INT8_MARGIN = 0.3  # logprob gap under which the integer path may pick the other token


@pytest.fixture(scope="module")
def dequantized_bundle(default_model_path):
    from tessera.config import EngineArgs
    from tessera.engine.loading import load_bundle

    return load_bundle(EngineArgs(max_model_len=1024, quantization="none"))


def _llm(bundle, **engine_args):
    from tessera.config import EngineArgs
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.llm import LLM

    args = EngineArgs(max_model_len=1024, quantization=bundle.quantization, **engine_args)
    return LLM.from_engine(LLMEngine.from_engine_args(args, bundle=bundle))


needs_quant_kernel = pytest.mark.skipif(
    not quant_kernel_supported(torch.float32, torch.device("cpu")),
    reason="no quantized C++ kernel on this CPU (it needs AVX-512): the weights are dequantized "
           "at load (test_quantization_choice.py)")


@needs_quant_kernel
def test_default_model_keeps_its_gguf_types(model_bundle):
    model = model_bundle.model
    assert model_bundle.quantization == "gguf"  # conftest pins the exact path
    layer = model.layers[0]
    for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2):
        assert isinstance(lin, QuantLinear) and {p.fmt.name for p in lin.parts} == {"q4_half"}
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.parts[0].fmt.name == "q8_half"
    assert model.embed.weight is model.lm_head.parts[0]  # tied: one packed copy serves both


def test_quantized_greedy_equals_dequantized(
    model_bundle, dequantized_bundle, default_tokenizer, request
):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": default_tokenizer.encode(p)} for p in PROMPTS]
    quant = _llm(model_bundle).generate(prompts, params, use_tqdm=False)
    dense = _llm(dequantized_bundle).generate(prompts, params, use_tqdm=False)
    exact = quant_kernel_supported(torch.float32, torch.device("cpu"))
    for p, q, d in zip(prompts, quant, dense, strict=True):
        if exact:
            assert q.outputs[0].token_ids == d.outputs[0].token_ids
            assert q.outputs[0].logprobs == d.outputs[0].logprobs  # bit for bit
        else:
            check_greedy(
                request.getfixturevalue("hf_model"),
                p["prompt_token_ids"],
                d.outputs[0].token_ids,
                q.outputs[0].token_ids,
            )


@needs_quant_kernel
def test_quantized_weights_take_under_40_percent_of_bf16(model_bundle, dequantized_bundle):
    quantized = sum(model_bundle.model.weight_bytes().values())
    bf16 = sum(dequantized_bundle.model.weight_bytes().values()) // 2  # the fp32 model's, halved
    assert quantized <= 0.4 * bf16, (quantized, bf16)


@pytest.fixture(scope="module")
def int8_bundle(default_model_path):
    from tessera.config import EngineArgs
    from tessera.engine.loading import load_bundle

    return load_bundle(EngineArgs(max_model_len=1024, quantization="gguf_int8"))


def test_integer_path_keeps_every_gguf_type_quantized(int8_bundle):
    from tessera.config import EngineArgs

    assert EngineArgs().quantization == "auto" and int8_bundle.quantization == "gguf_int8"
    model = int8_bundle.model
    layer = model.layers[0]
    for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2):
        assert isinstance(lin, QuantLinear) and {p.fmt.name for p in lin.parts} == {"u4h"}
        assert all(lin.int8)
    assert model.lm_head.parts[0].fmt.name == "s8h"
    assert model.embed.weight is model.lm_head.parts[0]


def test_int8_greedy_follows_the_dequantized_model_outside_close_calls(
        int8_bundle, dequantized_bundle, default_tokenizer):
    """Where the dequantized fp32 model's top two logits are more than INT8_MARGIN apart, the
    integer path picks the same token (measured: |logit error| ~0.02-0.05 on this model)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": default_tokenizer.encode(p)} for p in PROMPTS]
    int8 = _llm(int8_bundle).generate(prompts, params, use_tqdm=False)
    dense = _llm(dequantized_bundle).generate(prompts, params, use_tqdm=False)
    for q, d in zip(int8, dense, strict=True):
        q_ids, d_ids = q.outputs[0].token_ids, d.outputs[0].token_ids
        if q_ids == d_ids:
            continue
        i = next(i for i, (a, b) in enumerate(zip(q_ids, d_ids, strict=True)) if a != b)
        top2 = sorted(d.outputs[0].logprobs[i].values(), reverse=True)[:2]
        gap = top2[0] - top2[1]
        assert gap <= INT8_MARGIN, f"token {i}: not a close call (gap {gap:.3f})"


@pytest.fixture(scope="module")
def a16_bundle(default_model_path):
    from tessera.config import EngineArgs
    from tessera.engine.loading import load_bundle

    return load_bundle(EngineArgs(max_model_len=1024, quantization="gguf_int8_a16"))


def test_a16_runs_every_linear_on_two_activation_planes(a16_bundle):
    from tessera.kernels.quant_linear import int8_kernel_supported

    if not int8_kernel_supported(torch.float32, torch.device("cpu")):
        assert a16_bundle.quantization in ("gguf", "none")  # the fallback, as for gguf_int8
        return
    assert a16_bundle.quantization == "gguf_int8_a16"
    model = a16_bundle.model
    linears = [model.lm_head] + [lin for layer in model.layers
                                 for lin in (layer.wqkv, layer.wo, layer.w13, layer.w2)]
    for lin in linears:
        assert isinstance(lin, QuantLinear) and all(lin.int8)
        assert {p.act_planes for p in lin.parts} == {2}


def test_a16_greedy_equals_the_dequantized_model(a16_bundle, dequantized_bundle,
                                                 default_tokenizer):
    """16-bit activations move logits by ~1e-4, far below this model's close calls on these
    prompts: every token equals the dequantized fp32 model's (gguf_int8 differs on some)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": default_tokenizer.encode(p)} for p in PROMPTS]
    a16 = _llm(a16_bundle).generate(prompts, params, use_tqdm=False)
    dense = _llm(dequantized_bundle).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a16] == [o.outputs[0].token_ids for o in dense]


@pytest.mark.parametrize("bundle", ["int8_bundle", "a16_bundle"])
def test_int8_rows_do_not_depend_on_batching_or_chunking(bundle, default_tokenizer, request):
    """Each row is quantized alone, so batching, chunked prefill and prefix caching keep every
    token (compared exactly, on the integer path itself)."""
    int8_bundle = request.getfixturevalue(bundle)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": default_tokenizer.encode(p * 3)} for p in PROMPTS]
    batched = _llm(int8_bundle).generate(prompts, params, use_tqdm=False)
    chunked = _llm(int8_bundle, enable_chunked_prefill=True, max_num_batched_tokens=16,
                   enable_prefix_caching=True)
    alone = [chunked.generate([p], params, use_tqdm=False)[0] for p in prompts + prompts]
    expected = [b.outputs[0].token_ids for b in batched] * 2
    assert [a.outputs[0].token_ids for a in alone] == expected


def test_quantization_flag_is_validated():
    from tessera.config import EngineArgs

    with pytest.raises(ValueError, match="--quantization"):
        EngineArgs(quantization="awq").create_engine_config()


def _prompt_logits(path, prompt: list[int], quantization: str, dtype: torch.dtype) -> torch.Tensor:
    """float32 logits at every position of `prompt`, one prefill, on the model loaded as given."""
    from tessera.model.llama import LlamaForCausalLM
    from tessera.model.loader import load_model
    from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
    from tessera.worker.model_runner import ModelRunner
    from tessera.worker.static_batch import StaticBatch

    cpu, bs = torch.device("cpu"), 16
    cfg, weights = load_model(path, quantization)
    model = LlamaForCausalLM(cfg, weights, dtype, cpu, 1024)
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs, dtype)
    batch = StaticBatch(ModelRunner(model, CacheEngine(spec, 64, 0, cpu), bs, cpu), bs)
    return batch.logits([batch.new_seq(prompt, len(prompt))], all_positions=True).float()


@pytest.mark.skipif(not quant_kernel_supported(torch.bfloat16, torch.device("cpu")),
                    reason="no bf16 quantized kernel on this CPU")
def test_bf16_quantized_logits_are_at_least_as_close_to_fp32_as_dense_bf16(default_model_path,
                                                                          default_tokenizer):
    """bf16 on quantized weights (the block-sum form on CPUs without AMX) never rounds a weight
    to bf16; dense bf16 does. Against fp32 on the same dequantized weights, the quantized bf16
    model must be no further off than dense bf16, and top-1 must agree outside near-ties."""
    prompt = default_tokenizer.encode(" ".join(PROMPTS) * 2)
    ref = _prompt_logits(default_model_path, prompt, "none", torch.float32)
    quant = _prompt_logits(default_model_path, prompt, "gguf", torch.bfloat16)
    dense = _prompt_logits(default_model_path, prompt, "none", torch.bfloat16)
    q_err, d_err = (quant - ref).abs().mean().item(), (dense - ref).abs().mean().item()
    assert q_err <= 1.1 * d_err, (q_err, d_err)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5  # as BF16_NEAR_TIE in test_llama_vs_hf.py
    assert not (clear & (quant.argmax(-1) != ref.argmax(-1))).any()
