"""The grammar mask stage against a reference built from the matcher's own bitmask unpacked by
hand: constrained rows anywhere in the batch, unconstrained rows untouched, ended grammars allow
only stop tokens, and a matcher rebuilt by replay equals one advanced token by token."""

from __future__ import annotations

import pytest
import torch

from tessera.sampling.grammar import GrammarBackend, apply_grammar_masks
from tessera.sampling.structured_outputs import StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")
VOCAB = 49152


@pytest.fixture(scope="module")
def backend(default_tokenizer) -> GrammarBackend:
    return GrammarBackend(default_tokenizer, VOCAB, (default_tokenizer.eos_token_id,))


def allowed_reference(state) -> torch.Tensor:
    """The tokens the matcher allows, by xgrammar's own mask application (not ours)."""
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    state.matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return torch.isfinite(logits[0])


def test_masks_only_constrained_rows_wherever_they_sit(backend, default_tokenizer):
    digits = backend.matcher(StructuredOutputsParams(regex=r"[0-9]+"), [])
    person = backend.matcher(StructuredOutputsParams(json={"type": "object"}),
                             default_tokenizer.encode('{"a"', add_special_tokens=False))
    states = [None, digits, None, person]
    logits = torch.randn(4, VOCAB)
    masked = logits.clone()
    apply_grammar_masks(masked, states, (default_tokenizer.eos_token_id,))
    for i in (0, 2):
        assert torch.equal(masked[i], logits[i])
    for i in (1, 3):
        allowed = allowed_reference(states[i])
        assert 0 < int(allowed.sum()) < VOCAB
        assert torch.equal(masked[i][allowed], logits[i][allowed])
        assert torch.isneginf(masked[i][~allowed]).all()
    # every allowed token of the digit grammar decodes to digits (the reference is not vacuous)
    ids = allowed_reference(digits).nonzero().squeeze(1).tolist()
    assert all(default_tokenizer.decode([t]).isdigit() for t in ids[:200])


def test_ended_grammar_allows_only_stop_tokens(backend, default_tokenizer):
    eos = default_tokenizer.eos_token_id
    state = backend.matcher(StructuredOutputsParams(choice=["yes"]),
                            default_tokenizer.encode("yes", add_special_tokens=False) + [eos])
    assert state.matcher.is_terminated()
    logits = torch.randn(1, VOCAB)
    apply_grammar_masks(logits, [state], (eos,))
    assert torch.isfinite(logits[0]).nonzero().squeeze(1).tolist() == [eos]


def test_replay_equals_incremental(backend, default_tokenizer):
    params = StructuredOutputsParams(json={"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]})
    tokens = default_tokenizer.encode('{"n": 12', add_special_tokens=False)
    step = backend.matcher(params, [])
    for t in tokens:
        step.accept([t])
    replayed = backend.matcher(params, tokens)
    assert torch.equal(allowed_reference(step), allowed_reference(replayed))
    step.rollback(1)
    assert torch.equal(allowed_reference(step), allowed_reference(backend.matcher(params,
                                                                              tokens[:-1])))
    with pytest.raises(AssertionError, match="violates"):
        step.accept(default_tokenizer.encode("zzz", add_special_tokens=False))


def test_compile_is_cached_and_errors_are_clean(backend):
    a = backend.compile(StructuredOutputsParams(regex="[a-z]+"))
    assert backend.compile(StructuredOutputsParams(regex="[a-z]+")) is a
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex is invalid") as e:
        backend.compile(StructuredOutputsParams(regex="(["))
    assert ".cc" not in str(e.value) and "Check failed" not in str(e.value)


def test_reasoning_gate_constrains_only_after_the_end_of_thinking(backend, default_tokenizer):
    """--reasoning-parser: the grammar starts after `</think>`; before it nothing is masked."""
    end = tuple(default_tokenizer.encode("</think>", add_special_tokens=False))
    gated = StructuredOutputsParams(regex=r"[0-9]+", reasoning_end_token_ids=end)
    plain = backend.matcher(StructuredOutputsParams(regex=r"[0-9]+"), [])
    state = backend.matcher(gated, [])
    thinking = default_tokenizer.encode("Let me think", add_special_tokens=False)
    state.accept(thinking)  # words, which the digit grammar would refuse
    logits = torch.randn(2, VOCAB)
    masked = logits.clone()
    apply_grammar_masks(masked, [state, plain], (default_tokenizer.eos_token_id,))
    assert torch.equal(masked[0], logits[0])
    assert not torch.equal(masked[1], logits[1])
    state.accept(list(end))
    assert torch.equal(allowed_reference(state), allowed_reference(plain))
    with pytest.raises(AssertionError, match="violates"):
        backend.matcher(gated, [*thinking, *end]).accept(thinking[:1])
    # rollback across the opening closes the gate again; replay equals step by step
    digits = default_tokenizer.encode("42", add_special_tokens=False)
    state.accept(digits)
    state.rollback(len(digits) + 1)
    assert bool(allowed_reference(state).all())
    state.accept([end[-1], *digits])
    replayed = backend.matcher(gated, [*thinking, *end, *digits])
    assert torch.equal(allowed_reference(state), allowed_reference(replayed))
