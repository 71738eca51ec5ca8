"""`tessera` CLI: engine flags are generated from EngineArgs (names, help, choices, bools)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tessera.config import EngineArgs
from tessera.entrypoints.cli import build_parser, engine_args_from


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_match_engine_args():
    args = _serve_args()
    assert (args.host, args.port, args.api_key, args.served_model_name) == (
        "127.0.0.1", 8000, None, None)
    assert engine_args_from(args) == EngineArgs()


def test_every_engine_field_is_a_documented_flag():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        assert flag in help_text, flag
    assert (
        "{swap,recompute}" in help_text
        and "{auto,float32,float,bfloat16,half,float16}" in help_text
    )


def test_flags_parse_into_engine_args():
    args = _serve_args(
        "--block-size",
        "32",
        "--max-num-batched-tokens",
        "4096",
        "--preemption-mode",
        "swap",
        "--enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--kv-cache-space",
        "0.5",
        "--max-model-len",
        "512",
        "--dtype",
        "bfloat16",
        "--port",
        "0",
        "--api-key",
        "k",
        "--served-model-name",
        "m",
    )
    ea = engine_args_from(args)
    assert (ea.block_size, ea.max_num_batched_tokens, ea.preemption_mode) == (32, 4096, "swap")
    assert ea.enable_chunked_prefill and not ea.enable_prefix_caching
    assert (ea.kv_cache_space, ea.max_model_len, ea.dtype) == (0.5, 512, "bfloat16")
    assert (args.port, args.api_key, args.served_model_name) == (0, "k", "m")


def test_chunked_prefill_and_prefix_caching_are_on_by_default_as_in_vllm_v1():
    ea = engine_args_from(_serve_args())
    assert ea.enable_chunked_prefill and ea.enable_prefix_caching
    config = ea.create_engine_config(model_max_len=8192)
    assert config.scheduler.enable_chunked_prefill and config.cache.enable_prefix_caching
    assert config.scheduler.max_num_batched_tokens == 2048  # vLLM v1's server default
    assert EngineArgs() == ea
    off = engine_args_from(_serve_args("--no-enable-chunked-prefill", "--no-enable-prefix-caching"))
    assert not off.enable_chunked_prefill and not off.enable_prefix_caching
    config = off.create_engine_config(model_max_len=8192)
    assert not config.scheduler.enable_chunked_prefill and not config.cache.enable_prefix_caching
    assert config.scheduler.max_num_batched_tokens == 8192  # a whole prompt fits
    config = EngineArgs(enable_chunked_prefill=False, max_model_len=1024).create_engine_config(
        model_max_len=8192
    )
    assert config.scheduler.max_num_batched_tokens == 2048


@pytest.mark.parametrize(
    "argv",
    [
        ["--preemption-mode", "never"],
        ["--block-size", "big"],
        ["--port", "70000"],
        ["model.gguf", "--enable-prefix-caching", "yes"],  # a bool takes no value
    ],
)
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _serve_args(*argv)
    assert e.value.code == 2


def test_console_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "tessera.entrypoints.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "serve" in out.stdout
