"""Disaggregated prefill/decode on windowed models, two engines in one process over the TCP
connector: the producer's window groups release while it prefills, only the live entries of
the per-group tables move, the consumer releases too, and the consumer's greedy tokens are a
colocated engine's. Mistral-style (every layer windowed) and Gemma-3-style (local and global
layers, KV cache groups)."""

from __future__ import annotations

import json
import socket

import pytest
from tiny_windowed import TARGETS, WINDOW, save_tiny

from tessera import LLM, SamplingParams

NUM_TOKENS = 10
PROMPTS = [[(5 * i + 7 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((31, 42, 23))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=sorted(TARGETS))
def model(request, tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp(request.param), *TARGETS[request.param], seed=7)
    return request.param, path


def _engine(path: str, kv: dict) -> LLM:
    # chunks of 8 tokens: the producer's window groups release while it prefills
    return LLM(model=path, block_size=4, max_model_len=96, enable_chunked_prefill=True,
               max_num_batched_tokens=8, enable_prefix_caching=False,
               kv_transfer_config=json.dumps(kv))


def test_consumer_decodes_a_windowed_prompt_the_producer_computed(model):
    name, path = model
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    plain = LLM(model=path, block_size=4, max_model_len=96)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    producer = _engine(path, {"kv_connector": "TcpConnector", "kv_role": "kv_producer",
                              "kv_port": _free_port()})
    consumer = _engine(path, {"kv_connector": "TcpConnector", "kv_role": "kv_consumer"})
    try:
        p_bm = producer.llm_engine.scheduler.block_manager
        c_bm = consumer.llm_engine.scheduler.block_manager
        assert p_bm.group_windows == c_bm.group_windows
        assert WINDOW in p_bm.group_windows  # release is on with a connector
        first = SamplingParams(temperature=0.0, max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True})
        outs = producer.generate([{"prompt_token_ids": p} for p in PROMPTS], first,
                                 use_tqdm=False)
        producer.llm_engine.step()  # registers the last finished request's blocks to serve
        params = [o.kv_transfer_params for o in outs]
        assert all(p and p["do_remote_prefill"] for p in params)
        assert any(-1 in p["remote_block_ids"] for p in params)  # released before sending
        assert p_bm.num_released_blocks > 0
        got = consumer.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            [SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            kv_transfer_params=kp) for kp in params], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in got] == expected
        metrics = consumer.get_metrics()
        # the consumer computed only each prompt's last token: the rest came from the peer
        assert metrics["tessera:prompt_tokens_total"] == len(PROMPTS)
        assert c_bm.num_released_blocks > 0
        c_bm.check_integrity()
        assert c_bm.gpu.num_free == c_bm.num_gpu_blocks
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()
