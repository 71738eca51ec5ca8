"""What every part's config shares: byte units, flag names, JSON-object options."""

from __future__ import annotations

import json

GiB = 1 << 30


def flag_name(name: str) -> str:
    """The command-line flag of a config field: `max_num_seqs` -> `--max-num-seqs`. Error messages
    name flags with it, and the CLI (tessera/entrypoints/cli.py) registers them with it."""
    return "--" + name.replace("_", "-")


def config_dict(value: dict | str, name: str, known: tuple[str, ...]) -> dict:
    """A JSON-object config (`LLM(name={...})`, or the JSON text of `--name-with-dashes`) as a
    dict with known keys only; every error names the option."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--{name.removesuffix('_config').replace('_', '-')}-config is not "
                             f"valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (JSON object), got {type(value).__name__}")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return value
