"""The model's own sampling defaults (`generation_config.json`), as vLLM's `--generation-config`
applies them: a request that does not set temperature, top_p, top_k, min_p, repetition_penalty or
max_tokens gets the model's value instead of the API's default.

`auto` (the default) reads `generation_config.json` beside an HF model directory (a GGUF file
carries no sampling defaults, so it gets none); `vllm` (or `none`) ignores the model's file; any
other value is a directory holding a `generation_config.json`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_sampling_defaults(setting: str, model_path: str) -> dict[str, Any]:
    """SamplingParams defaults from the model's generation config (empty when there is none)."""
    if setting in ("vllm", "none"):
        return {}
    if setting == "auto":
        folder = model_path if os.path.isdir(model_path) else None
        if folder is None:
            return {}
    else:
        folder = setting
        if not os.path.isfile(os.path.join(folder, "generation_config.json")):
            raise ValueError(f"--generation-config: no generation_config.json in {folder!r}")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("do_sample") is False:  # the model asks for greedy decoding
        config = {**config, "temperature": 0.0}
    defaults = {field: config[key] for key, field in _KEYS.items() if key in config}
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults
