"""In bfloat16 too, greedy results do not depend on chunked prefill, prefix caching, preemption or
batching. Exact equality, no near-tie allowance: on CPU every kernel of the forward pass (linear,
attention, norms, RoPE, sampling) computes a row the same way whatever else is in the step, so a
token's logits are bitwise the same however its prompt was split or served.
"""

from __future__ import annotations

import numpy as np
import pytest

from tessera import SamplingParams
from tessera.kernels.fused import fused_ops_for
from tessera.kernels.linear import linear_kernel_supported
from tessera.kernels.paged_attention import paged_attention_available


@pytest.fixture(scope="module")
def make_bf16_llm(default_model_path):
    import torch

    from tessera.config import EngineArgs
    from tessera.engine.llm_engine import LLMEngine
    from tessera.engine.loading import load_bundle
    from tessera.entrypoints.llm import LLM

    cpu = torch.device("cpu")
    probe = torch.zeros(32, 32, dtype=torch.bfloat16)
    if not (
        linear_kernel_supported(probe)
        and fused_ops_for(cpu, torch.bfloat16) is not None
        and paged_attention_available(cpu, torch.bfloat16)
    ):
        pytest.skip("bf16 invariance rests on the C++ kernels, not built here")
    bundle = load_bundle(EngineArgs(dtype="bfloat16", max_model_len=1024))

    def make(**engine_args):
        engine_args.setdefault("max_model_len", 1024)
        args = EngineArgs(dtype="bfloat16", **engine_args)
        return LLM.from_engine(LLMEngine.from_engine_args(args, bundle=bundle))

    return make


def test_bf16_greedy_is_invariant(make_bf16_llm):
    rng = np.random.default_rng(0)  # random-token prompts: near-tied logits are common
    prompts = [
        {"prompt_token_ids": rng.integers(100, 49000, int(n)).tolist()}
        for n in rng.integers(150, 400, 6)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(llm, batch=prompts):
        return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]

    base = run(make_bf16_llm())
    assert run(make_bf16_llm(enable_chunked_prefill=True, max_num_batched_tokens=64)) == base
    cached = make_bf16_llm(enable_prefix_caching=True)
    run(cached)
    assert run(cached) == base  # the second run hits the cache
    assert cached.get_metrics()["tessera:prefix_cache_hits_total"] > 0
    small = make_bf16_llm(num_gpu_blocks_override=40, max_model_len=640,
                          preemption_mode="recompute")
    assert run(small) == base
    assert small.get_metrics()["tessera:num_preemptions_total"] > 0
    assert run(make_bf16_llm(), prompts[3:4]) == base[3:4]
