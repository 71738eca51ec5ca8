"""Speculative decoding with a draft model is lossless: greedy output is identical to greedy
without it, for two drafts of the target's vocabulary:

- a tiny random Llama drafting for a tiny random Llama target (acceptance near 0): alone, batched,
  under preemption (swap and recompute) and chunked prefill, in fp32;
- the default model drafting for itself (acceptance near 100%), batched with a constrained request
  that does not speculate, in fp32 and bf16 (heavy: under preemption too).

Seeded sampling through the general rejection rule is reproducible and batch-independent, with a
logprob per emitted token; stop rules and max_tokens hold inside an accepted run. The rule's
distribution itself is tested in tests/sampling/test_rejection_sampler_draft.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera import LLM, SamplingParams

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _tiny_llama(path, seed: int, vocab: int = 320, layers: int = 2, hidden: int = 64) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target, draft) checkpoints: random Llamas with the same 320-token vocabulary."""
    root = tmp_path_factory.mktemp("tiny_spec")
    return (_tiny_llama(root / "target", 0, layers=2, hidden=64),
            _tiny_llama(root / "draft", 1, layers=1, hidden=32))


def _prompts(vocab: int = 320) -> list[dict]:
    rng = np.random.default_rng(5)
    return [{"prompt_token_ids": rng.integers(1, vocab, int(n)).tolist()} for n in (9, 40, 23, 57)]


TINY_PROMPTS = _prompts()


def _run(llm, params=GREEDY, prompts=TINY_PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _acceptance(llm) -> float:
    m = llm.get_metrics()
    drafts = m["tessera:spec_decode_num_draft_tokens_total"]
    assert m["tessera:spec_decode_num_drafts_total"] > 0 and drafts > 0
    return m["tessera:spec_decode_num_accepted_tokens_total"] / drafts


def _draft(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def tiny_baseline(tiny):
    return _run(LLM(model=tiny[0], max_model_len=256))


def test_tiny_draft_greedy_identical_alone_and_batched(tiny, tiny_baseline):
    target, draft = tiny
    llm = LLM(model=target, max_model_len=256, speculative_config=_draft(draft))
    assert _run(llm) == tiny_baseline
    assert [_run(llm, prompts=[p])[0] for p in TINY_PROMPTS[:2]] == tiny_baseline[:2]
    assert _acceptance(llm) < 0.3  # a random draft: its drafts are mostly rejected


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tiny_draft_greedy_identical_under_preemption(tiny, tiny_baseline, mode):
    # 20 blocks of 4 hold one 80-token request, not all four
    llm = LLM(model=tiny[0], max_model_len=80, num_gpu_blocks_override=20, block_size=4,
              preemption_mode=mode, speculative_config=_draft(tiny[1]))
    assert _run(llm) == tiny_baseline
    m = llm.get_metrics()
    assert m["tessera:num_preemptions_total"] > 0
    _acceptance(llm)


def test_tiny_draft_greedy_identical_chunked_prefill(tiny, tiny_baseline):
    llm = LLM(model=tiny[0], max_model_len=256, enable_chunked_prefill=True,
              max_num_batched_tokens=16, enable_prefix_caching=True,
              speculative_config=_draft(tiny[1], k=4))
    assert _run(llm) == tiny_baseline
    assert _run(llm) == tiny_baseline  # prefix-cache hits: the draft recomputes its own K/V
    _acceptance(llm)


def test_tiny_draft_seeded_sampling_reproducible(tiny):
    """The general rejection rule draws from (seed, position)-keyed generators: a seeded request's
    tokens are the same alone, batched, and on a second run; one logprob per token."""
    llm = LLM(model=tiny[0], max_model_len=256, speculative_config=_draft(tiny[1]))
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, logprobs=1,
                             max_tokens=NUM_TOKENS, ignore_eos=True) for i in range(4)]
    outs = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
    batched = [o.outputs[0].token_ids for o in outs]
    for o in outs:
        c = o.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == NUM_TOKENS
        assert all(t in d and d[t] <= 0 for t, d in zip(c.token_ids, c.logprobs, strict=True))
    assert [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, params, use_tqdm=False)
            ] == batched
    alone = [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
             for p, q in zip(TINY_PROMPTS, params, strict=True)]
    assert alone == batched
    _acceptance(llm)


def test_tiny_draft_stops_and_max_tokens(tiny, tiny_baseline):
    llm = LLM(model=tiny[0], max_model_len=256, speculative_config=_draft(tiny[1], k=4))
    stop_id = tiny_baseline[1][6]
    first = tiny_baseline[1].index(stop_id)
    got = _run(
        llm, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, stop_token_ids=[stop_id])
    )
    assert got[1] == tiny_baseline[1][: first + 1]
    got = _run(llm, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert got == [t[:5] for t in tiny_baseline]


def test_draft_with_another_vocabulary_is_refused(tiny, tmp_path):
    other = _tiny_llama(tmp_path / "other", 2, vocab=256, layers=1, hidden=32)
    with pytest.raises(ValueError, match="speculative_config: model .*vocabulary"):
        LLM(model=tiny[0], max_model_len=256, speculative_config=_draft(other))
    with pytest.raises(ValueError, match="speculative_config: model"):
        LLM(model=tiny[0], max_model_len=256, speculative_config=_draft(str(tmp_path / "none")))


# ---- the default model drafting for itself -------------------------------------------------


def _copy_prompts() -> list[dict]:
    rng = np.random.default_rng(11)
    out = []
    for i in range(4):
        seg = rng.integers(100, 20000, 30 + 5 * i).tolist()
        out.append({"prompt_token_ids": seg + seg[:10] if i % 2 == 0 else seg})
    return out


COPY_PROMPTS = _copy_prompts()
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _self_draft_case(make, path: str):
    """Greedy identical to plain greedy, acceptance near 100%, beside a constrained request."""
    constrained = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs={"json": PERSON}
    )
    prompts = [*COPY_PROMPTS[:3], "Name a person as JSON:"]
    params = [GREEDY] * 3 + [constrained]

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    base = run(make())
    llm = make(speculative_config=_draft(path, k=4))
    assert run(llm) == base
    assert _acceptance(llm) > 0.9
    return base


def test_default_model_drafting_for_itself(make_llm, default_model_path):
    _self_draft_case(lambda **kw: make_llm(num_gpu_blocks_override=64, **kw), default_model_path)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_default_model_drafting_for_itself_under_preemption(make_llm, default_model_path, mode):
    """Its cache follows the target's through preemption: swapped blocks keep the draft's K/V
    (acceptance stays near 100%), recomputed ones are redrafted."""
    _self_draft_case(lambda **kw: make_llm(num_gpu_blocks_override=10, block_size=8,
                                           max_model_len=80, preemption_mode=mode,
                                           enable_chunked_prefill=True,
                                           max_num_batched_tokens=24, **kw),
                     default_model_path)


def test_default_model_drafting_for_itself_bf16(default_model_path):
    from tessera.config import EngineArgs
    from tessera.engine.llm_engine import LLMEngine
    from tessera.engine.loading import load_bundle
    from tessera.kernels.fused import fused_ops_for
    from tessera.kernels.linear import linear_kernel_supported
    from tessera.kernels.paged_attention import paged_attention_available

    cpu = torch.device("cpu")
    if not (linear_kernel_supported(torch.zeros(32, 32, dtype=torch.bfloat16))
            and fused_ops_for(cpu, torch.bfloat16) is not None
            and paged_attention_available(cpu, torch.bfloat16)):
        pytest.skip("bf16 invariance rests on the C++ kernels, not built here")
    bundle = load_bundle(EngineArgs(dtype="bfloat16", max_model_len=512))

    def make(**engine_args):
        args = EngineArgs(dtype="bfloat16", max_model_len=512, num_gpu_blocks_override=64,
                          **engine_args)
        return LLM.from_engine(LLMEngine.from_engine_args(args, bundle=bundle))

    _self_draft_case(make, default_model_path)
