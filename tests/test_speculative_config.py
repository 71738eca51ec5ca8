"""`--speculative-config` / `LLM(speculative_config=)`: vLLM's keys, and a ValueError that names
the bad key (an unknown method lists the known ones)."""

from __future__ import annotations

import pytest

from tessera.config import EngineArgs, SpeculativeConfig
from tessera.entrypoints.cli import build_parser, engine_args_from


@pytest.mark.parametrize("bad, key", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "model": "x.gguf"}, "model"),
    ({"method": "draft_model"}, "model"),
    ({"method": "ngram", "num_lookahead": 3}, "num_lookahead"),
    ({"num_speculative_tokens": 3}, "method"),
])
def test_bad_config_names_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_dict(bad)
    with pytest.raises(ValueError, match=key):
        EngineArgs(speculative_config=bad).create_engine_config()


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ValueError, match="method") as e:
        SpeculativeConfig.from_dict({"method": "eagle"})
    assert "ngram" in str(e.value) and "draft_model" in str(e.value)


def test_llm_rejects_a_bad_config_before_loading():
    from tessera import LLM

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": -1})


def test_cli_flag_takes_json():
    ns = build_parser().parse_args([
        "serve", "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}',
    ])
    config = engine_args_from(ns).create_engine_config().speculative
    assert config == SpeculativeConfig("ngram", 3, 5, 2, None, 8)
    assert not config.is_enabled_for(8) and config.is_enabled_for(7)
    with pytest.raises(ValueError, match="JSON"):
        EngineArgs(speculative_config="{method: ngram}").create_engine_config()
    assert EngineArgs().create_engine_config().speculative is None


def test_draft_model_config():
    config = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m/draft.gguf",
                                          "num_speculative_tokens": 5})
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model", "/m/draft.gguf", 5)
