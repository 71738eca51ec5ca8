"""The offline `LLM` API end to end on the default model: sampling parameters, stop conditions,
n > 1, logprobs, seeds, errors and metrics."""

from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams

METRIC_NAMES = {
    "tessera:num_requests_running", "tessera:num_requests_waiting", "tessera:num_requests_swapped",
    "tessera:kv_cache_usage_perc", "tessera:cpu_cache_usage_perc", "tessera:num_preemptions_total",
    "tessera:prompt_tokens_total", "tessera:generation_tokens_total",
    "tessera:prefix_cache_hits_total", "tessera:prefix_cache_queries_total",
    "tessera:prompt_tokens_cached_total",
}


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    return make_llm()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_outputs_in_input_order_and_metrics(llm):
    prompts = ["Hello, my name is", "The capital of France is", "1 2 3 4"]
    outs = llm.generate(prompts, greedy(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert all(len(o.outputs[0].token_ids) == 5 and o.finished for o in outs)
    metrics = llm.get_metrics()
    assert set(metrics) == METRIC_NAMES
    assert metrics["tessera:num_requests_running"] == 0
    assert metrics["tessera:generation_tokens_total"] >= 15
    assert metrics["tessera:prompt_tokens_total"] >= sum(len(o.prompt_token_ids) for o in outs)
    assert metrics["tessera:kv_cache_usage_perc"] == 0.0  # everything freed


def test_max_tokens_and_ignore_eos(llm):
    out = llm.generate(
        "The capital of France is", greedy(max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 40 and c.finish_reason == "length"


def test_eos_stops_and_min_tokens_defers_it(llm):
    prompt = {
        "prompt_token_ids": llm.llm_engine.apply_chat_template(
            [{"role": "user", "content": "Say hi."}]
        )
    }
    free = llm.generate(prompt, greedy(max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 200  # ended by EOS
    n = len(free.token_ids) + 5
    held = llm.generate(prompt, greedy(max_tokens=200, min_tokens=n), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= n


def test_stop_string_is_cut_unless_asked(llm):
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = (
        llm.generate(prompt, greedy(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    stop = full.strip().split()[2]  # a string that occurs in the greedy text
    cut = llm.generate(prompt, greedy(max_tokens=20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[: full.index(stop)]
    kept = llm.generate(
        prompt, greedy(max_tokens=20, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )
    assert kept[0].outputs[0].text == full[: full.index(stop) + len(stop)]


def test_n_gives_distinct_samples(llm):
    out = llm.generate(
        "Tell me a story about",
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    texts = {tuple(c.token_ids) for c in out.outputs}
    assert len(texts) == 3


def test_seeded_sample_independent_of_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("The weather today is", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"Random prompt number {i} says" for i in range(15)]
    batch_params = [SamplingParams(temperature=1.0, max_tokens=8 + i) for i in range(15)]
    outs = llm.generate(["The weather today is", *others], [params, *batch_params], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone


def test_logprobs_match_reference_log_softmax(llm, hf_model):
    prompt = llm.get_tokenizer().encode("The capital of France is")
    out = llm.generate(
        {"prompt_token_ids": prompt},
        greedy(max_tokens=6, logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    with torch.inference_mode():
        ref = torch.log_softmax(
            hf_model(torch.tensor([prompt + c.token_ids])).logits[0].float(), -1
        )
    for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert 3 <= len(lp) <= 4 and tok in lp
        assert abs(lp[tok] - ref[len(prompt) - 1 + i, tok].item()) < 1e-3
        top3 = ref[len(prompt) - 1 + i].topk(3).indices.tolist()
        assert set(top3) <= set(lp)


def test_bad_sampling_params_name_the_field(llm):
    for kwargs, field in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 2**31}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2**70}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    # past --max-logprobs (default 20): refused by the engine, as vLLM does
    with pytest.raises(ValueError, match=r"^logprobs must be at most 20"):
        llm.generate("Hello", SamplingParams(logprobs=21), use_tqdm=False)


def test_prompt_too_long_fails_alone(llm):
    too_long = {"prompt_token_ids": [100] * 1500}  # max_model_len is 1024 here
    outs = llm.generate([too_long, "Hello there"], greedy(max_tokens=4), use_tqdm=False)
    assert outs[0].finished and outs[0].error and "1024" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) >= 1


def test_unknown_engine_argument_is_a_clear_error():
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(max_num_seq=3)


def test_chat_uses_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}], greedy(max_tokens=12), use_tqdm=False
    )[0]
    assert out.outputs[0].text.strip()
    assert out.prompt_token_ids[:1] == llm.get_tokenizer().encode("<|im_start|>")


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_reference(make_llm, llm, hf_model, chunked):
    engine = make_llm(enable_chunked_prefill=True, max_num_batched_tokens=8) if chunked else llm
    prompt = llm.get_tokenizer().encode(
        "The quick brown fox jumps over the lazy dog near the river bank"
    )
    out = engine.generate(
        {"prompt_token_ids": prompt}, greedy(max_tokens=2, prompt_logprobs=1), use_tqdm=False
    )[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        lp = out.prompt_logprobs[pos]
        assert abs(lp[prompt[pos]] - ref[pos - 1, prompt[pos]].item()) < 1e-3
        assert int(ref[pos - 1].argmax()) in lp
