"""Structured outputs through the offline API on the default model: every output matches its
constraint (checked by `jsonschema` and `re`, not by our own code), under batching with
unconstrained requests, n > 1, sampling and preemption; unconstrained greedy rows are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tessera import LLM, SamplingParams
from tessera.sampling.structured_outputs import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
}
TEAM = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "maxLength": 12},
        "members": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 1},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    },
    "required": ["team", "members", "code"],
}
PROMPT = "Describe a small software team as JSON."
UNCONSTRAINED = ["The capital of France is", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    return make_llm()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def texts(llm, prompts, params) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schema_regex_choice_grammar_in_one_batch(llm):
    free = texts(llm, UNCONSTRAINED, greedy(max_tokens=12, ignore_eos=True))
    params = [
        greedy(max_tokens=120, structured_outputs={"json": TEAM}),
        greedy(max_tokens=40, structured_outputs={"json": PERSON}),
        greedy(max_tokens=20, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
        greedy(max_tokens=8, structured_outputs={"choice": ["red", "green", "blue"]}),
        greedy(max_tokens=30, structured_outputs={
            "grammar": 'root ::= "(" num " + " num ")"\nnum ::= [1-9] [0-9]?'}),
        greedy(max_tokens=60, structured_outputs={"json_object": True}),
        greedy(max_tokens=12, ignore_eos=True),
        greedy(max_tokens=12, ignore_eos=True),
    ]
    ask_json = {"prompt_token_ids": llm.llm_engine.apply_chat_template([{
        "role": "user", "content": "Return a JSON object with keys name and age for Bob, 30."}])}
    prompts = [PROMPT, "A user as JSON:", "A code:", "My favourite colour is", "A sum:",
               ask_json, *UNCONSTRAINED]
    outs = texts(llm, prompts, params)
    jsonschema.validate(json.loads(outs[0]), TEAM)
    jsonschema.validate(json.loads(outs[1]), PERSON)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[2]), outs[2]
    assert outs[3] in ("red", "green", "blue")
    assert re.fullmatch(r"\([1-9][0-9]? \+ [1-9][0-9]?\)", outs[4]), outs[4]
    assert isinstance(json.loads(outs[5]), dict)
    assert outs[6:] == free  # unconstrained greedy rows are untouched by their neighbours' masks


def test_sampled_n_and_seeds_stay_valid_and_reproducible(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60,
                       structured_outputs={"json": PERSON})
    first = llm.generate(PROMPT, p, use_tqdm=False)[0].outputs
    assert len(first) == 3
    for o in first:
        jsonschema.validate(json.loads(o.text), PERSON)
    again = llm.generate(PROMPT, p.clone(), use_tqdm=False)[0].outputs
    assert [o.text for o in again] == [o.text for o in first]


def test_preemption_keeps_constraints_and_greedy(make_llm):
    """A cache too small for the batch preempts (both modes); matchers are rebuilt by replay."""
    params = [greedy(max_tokens=40, structured_outputs={"json": PERSON}) for _ in range(4)]
    preamble = "Our records list many people with their names, ages and roles. " * 4
    prompts = [f"{preamble}Person number {i} as JSON:" for i in range(4)]
    ample = texts(make_llm(), prompts, params)
    for mode in ("swap", "recompute"):
        small = make_llm(num_gpu_blocks_override=13, block_size=16, preemption_mode=mode,
                         max_model_len=200)
        outs = texts(small, prompts, params)
        assert small.get_metrics()["tessera:num_preemptions_total"] > 0
        assert outs == ample
        for text in outs:
            jsonschema.validate(json.loads(text), PERSON)


def test_logit_bias_and_allowed_token_ids(llm):
    tok = llm.get_tokenizer()
    target = tok.encode(" banana", add_special_tokens=False)[0]
    out = llm.generate("Hello", greedy(max_tokens=3, ignore_eos=True,
                                       logit_bias={str(target): 100}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [target] * 3
    allowed = tok.encode(" yes no", add_special_tokens=False)
    out = llm.generate("Hello", SamplingParams(max_tokens=6, ignore_eos=True, seed=1,
                                               allowed_token_ids=allowed), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize("spec, fragment", [
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({"jsn": {}}, "unknown fields"),
])
def test_invalid_constraints_are_value_errors_naming_the_field(llm, spec, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        llm.generate("x", greedy(structured_outputs=spec), use_tqdm=False)
    # nothing internal leaks into the message
    try:
        llm.generate("x", greedy(structured_outputs=spec), use_tqdm=False)
    except ValueError as e:
        assert ".cc:" not in str(e) and "Check failed" not in str(e)


def test_params_accept_the_dataclass_and_out_of_vocab_ids_are_refused(llm):
    p = greedy(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert p.structured_outputs.key == ("choice", '["a", "b"]')
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("x", greedy(logit_bias={10**7: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("x", greedy(allowed_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_constraints_beside_speculative_decoding(make_llm):
    """With n-gram speculation on, constrained rows speculate too (their grammar is walked through
    the drafts and rolled back) and stay valid; every row matches plain greedy."""
    spec = make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    plain = make_llm()
    copy = "Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat,"
    params = [greedy(max_tokens=40, structured_outputs={"json": PERSON}),
              greedy(max_tokens=24, ignore_eos=True)]
    outs = texts(spec, ["A user as JSON:", copy], params)
    jsonschema.validate(json.loads(outs[0]), PERSON)
    assert outs == texts(plain, ["A user as JSON:", copy], params)
    assert spec.get_metrics()["tessera:spec_decode_num_accepted_tokens_total"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_speculate(make_llm, default_model_path, method):
    """Constrained requests alone: drafts are verified and accepted for them, the output stays valid
    and equals plain greedy (a draft the grammar refuses is rejected, never emitted)."""
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1} if method == "ngram" else
            {"method": "draft_model", "model": default_model_path, "num_speculative_tokens": 3})
    llm, plain = make_llm(speculative_config=spec), make_llm()
    prompts = ['Repeat this JSON: {"name": "Ada Lovelace"} {"name": "Ada Lovelace"} ',
               "A user as JSON:"]
    params = [greedy(max_tokens=30, structured_outputs={"json": PERSON})] * 2
    outs = texts(llm, prompts, params)
    for out in outs:
        jsonschema.validate(json.loads(out), PERSON)
    assert outs == texts(plain, prompts, params)
    m = llm.get_metrics()
    assert m["tessera:spec_decode_num_drafts_total"] > 0
    assert m["tessera:spec_decode_num_accepted_tokens_total"] > 0


def test_a_grammar_no_token_can_follow_ends_that_request_alone(llm):
    """A choice that needs a character no token of the vocabulary spells (\x1d here) reaches a dead
    end: the request stops there, or under ignore_eos emits stop tokens until max_tokens, where
    every logit -inf sampled an arbitrary token that the grammar refused and the engine step
    failed (found by the fuzz test). The request beside it is untouched."""
    dead = StructuredOutputsParams(choice=["ab\x1dcd"])
    fine = StructuredOutputsParams(choice=["yes", "no"])
    for ignore_eos in (False, True):
        params = [greedy(max_tokens=8, ignore_eos=ignore_eos, structured_outputs=dead),
                  SamplingParams(max_tokens=8, seed=3, min_p=0.3, structured_outputs=fine)]
        outs = llm.generate(["Say something", "Answer yes or no"], params, use_tqdm=False)
        text = outs[0].outputs[0].text
        assert text == "ab", text
        assert outs[0].outputs[0].finish_reason == ("length" if ignore_eos else "stop")
        assert outs[1].outputs[0].text in ("yes", "no")
