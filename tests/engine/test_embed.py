"""`LLM.embed`: a tiny random HF Llama's final hidden states, pooled LAST / MEAN / CLS, equal to
HF transformers' own to 1e-5: one prompt, a batch, under chunked prefill (MEAN sums chunks), with
prefix caching, and through preemption in a cache too small for the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from transformers import LlamaConfig, LlamaForCausalLM

from tessera import LLM
from tessera.pooling_params import PoolingParams

PROMPTS = [[1, 5, 9, 33], list(range(10, 60)), [7] * 13, list(range(100, 300, 3)),
           list(range(40, 77))]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return str(path), model


def hf_embedding(model, prompt: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    """HF's last hidden state (after the final norm), pooled the same way."""
    with torch.inference_mode():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]  # [len, hidden]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    return F.normalize(vector, dim=-1) if normalize else vector


def check(llm: LLM, model, pooling_type: str, normalize: bool, prompts=PROMPTS) -> None:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finished and out.prompt_token_ids == prompt
        got = torch.tensor(out.outputs.embedding)
        want = hf_embedding(model, prompt, pooling_type, normalize)
        assert out.outputs.hidden_size == 64
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embed_matches_hf(tiny_llama, pooling_type):
    path, model = tiny_llama
    normalize = pooling_type != "MEAN"  # both settings of normalize are covered
    llm = LLM(model=path, max_model_len=256,
              pooler_config={"pooling_type": pooling_type, "normalize": normalize})
    check(llm, model, pooling_type, normalize, PROMPTS[1:2])  # one prompt alone
    check(llm, model, pooling_type, normalize)  # a batch
    # chunked prefill: a 16-token budget splits every long prompt over several steps; prefix
    # caching serves LAST's repeats from the cache (MEAN and CLS compute every position)
    llm = LLM(model=path, max_model_len=256, enable_chunked_prefill=True,
              max_num_batched_tokens=16, enable_prefix_caching=True, block_size=4,
              pooler_config={"pooling_type": pooling_type, "normalize": normalize})
    check(llm, model, pooling_type, normalize)
    check(llm, model, pooling_type, normalize)  # again: prefix-cache hits where allowed
    hits = llm.get_metrics()["tessera:prefix_cache_hits_total"]
    assert (hits > 0) == (pooling_type == "LAST")


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_embed_through_preemption(tiny_llama, preemption_mode):
    """24 blocks of 4 tokens: two decoding requests grow until the newest request, an embedding
    halfway through its chunked prompt, is preempted (swapped out, or recomputed from 0); its
    MEAN still equals HF's."""
    from tessera import SamplingParams

    path, model = tiny_llama
    llm = LLM(model=path, num_gpu_blocks_override=24, block_size=4, max_model_len=96,
              enable_chunked_prefill=True, max_num_batched_tokens=8,
              preemption_mode=preemption_mode,
              pooler_config={"pooling_type": "MEAN", "normalize": True})
    engine = llm.llm_engine
    greedy = SamplingParams(max_tokens=36, ignore_eos=True, temperature=0.0)
    for k in range(2):
        engine.add_request(f"g{k}", {"prompt_token_ids": [3 + k] * 8}, greedy)
    prompts = {"e0": list(range(10, 70)), "e1": PROMPTS[3]}
    for rid, prompt in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, PoolingParams())
    preempted: set[str] = set()
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        preempted.update(out.preempted_request_ids)
        return out

    engine.scheduler.schedule = recording_schedule
    embeddings = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in prompts:
                embeddings[out.request_id] = out.outputs.embedding
    assert preempted & set(prompts), "no embedding request was preempted"
    for rid, prompt in prompts.items():
        torch.testing.assert_close(torch.tensor(embeddings[rid]),
                                   hf_embedding(model, prompt, "MEAN", True), atol=1e-5, rtol=0)


def test_embed_mixed_with_generation(tiny_llama):
    """Embeddings and generation share the engine; an embedding holds no seat after its prompt
    (the running queue empties), and per-request normalize overrides the server's."""
    from tessera import SamplingParams

    path, model = tiny_llama
    llm = LLM(model=path, max_model_len=256)
    engine = llm.llm_engine
    engine.add_request("g", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0))
    engine.add_request("e", {"prompt_token_ids": PROMPTS[1]}, PoolingParams(normalize=False))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "e" in finished:
            assert [g.request_id for g in engine.scheduler.running] in (["g"], [])
    assert len(finished["g"].outputs[0].token_ids) == 5
    want = hf_embedding(model, PROMPTS[1], "LAST", False)
    torch.testing.assert_close(torch.tensor(finished["e"].outputs.embedding), want,
                               atol=1e-5, rtol=0)


def test_embed_refusals(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(model=path, pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="unknown key"):
        LLM(model=path, pooler_config='{"pooling": "LAST"}')
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=8)
    llm = LLM(model=path, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed({"prompt_token_ids": list(range(40))}, use_tqdm=False)
    # a prompt of exactly max_model_len fits: an embedding has no output token
    assert len(llm.embed({"prompt_token_ids": list(range(32))},
                         use_tqdm=False)[0].outputs.embedding) == 64
