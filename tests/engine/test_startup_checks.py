"""Configurations that cannot strand a request are refused at start: a KV cache too small for one
request of max_model_len (as vLLM refuses it), with the numbers and the fix in the message."""

from __future__ import annotations

import pytest

from tessera.core.admission import check_cache_holds_max_model_len


def test_rule_counts_blocks_and_the_watermark():
    check_cache_holds_max_model_len(64, 16, 0.0, 1024)  # exactly one request
    with pytest.raises(ValueError, match="needs 65 blocks"):
        check_cache_holds_max_model_len(64, 16, 0.0, 1025)
    # 100 blocks, 1 kept free as the watermark: 99 usable
    check_cache_holds_max_model_len(100, 16, 0.01, 99 * 16)
    with pytest.raises(
        ValueError, match=r"99 are usable .* lower --max-model-len \(to at most 1584\)"
    ):
        check_cache_holds_max_model_len(100, 16, 0.01, 100 * 16)


def test_engine_refuses_to_start(make_llm):
    # a cache too small for one request (64 blocks of 16 under max_model_len 2048): 32 blocks of 16
    # under 1024
    with pytest.raises(ValueError) as e:
        make_llm(num_gpu_blocks_override=32, max_model_len=1024)
    message = str(e.value)
    assert "--max-model-len 1024" in message and "32 blocks" in message
    assert "--num-gpu-blocks-override" in message and "at most 512" in message
    with pytest.raises(ValueError, match=r"Raise --kv-cache-space or lower --max-model-len"):
        make_llm(kv_cache_space=0.001, max_model_len=1024)  # 1 block of 16 tokens
    make_llm(num_gpu_blocks_override=32, max_model_len=512)  # fits: starts
