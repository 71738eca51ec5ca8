"""`StructuredOutputsParams`: the constraint a request puts on its output (vLLM's name and fields).

Exactly one of `json` (a JSON schema, as a dict or its text), `json_object` (any JSON object),
`regex`, `choice` (one of these strings) or `grammar` (EBNF/GBNF text) is set. This module is
torch-free and plain data, so it travels inside `SamplingParams` to a runner in another process;
the grammar is compiled where the tokens are sampled (`tessera/sampling/grammar.py`).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Not a constraint: the token ids that end a reasoning model's thinking (`</think>`). When
    # set, the grammar applies only after them (the reasoning before is free text), as vLLM does
    # under --reasoning-parser. The server sets it; it does not change the compiled grammar.
    reasoning_end_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar")
                      if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, "
                             f"choice or grammar, got {set_fields or 'none'}")
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else None
            if text is None and not isinstance(self.json, dict):
                raise ValueError("structured_outputs.json must be a JSON schema (an object or "
                                 f"its text), got {type(self.json).__name__}")
            if text is not None:
                try:
                    parsed = _json.loads(text)
                except ValueError:
                    raise ValueError("structured_outputs.json is not valid JSON") from None
                if not isinstance(parsed, dict | bool):
                    raise ValueError("structured_outputs.json must be a JSON schema object")
            _check_length("structured_outputs.json", self.schema_text)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"structured_outputs.{name} must be a non-empty string")
                _check_length(f"structured_outputs.{name}", value)
        if self.choice is not None:
            if (not isinstance(self.choice, list | tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                                 "strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(self.choice)} entries; at "
                                 f"most {MAX_CHOICES} are allowed")
            _check_length("structured_outputs.choice", "".join(self.choice))
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.reasoning_end_token_ids is not None:
            if not self.reasoning_end_token_ids or not all(
                    isinstance(t, int) and t >= 0 for t in self.reasoning_end_token_ids):
                raise ValueError("structured_outputs.reasoning_end_token_ids must be a non-empty "
                                 "list of token ids")
            object.__setattr__(self, "reasoning_end_token_ids",
                               tuple(self.reasoning_end_token_ids))

    @classmethod
    def from_dict(cls, value: Any) -> StructuredOutputsParams:
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs must be an object with one of json, json_object, "
                             "regex, choice or grammar")
        unknown = set(value) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}; known: "
                             "json, json_object, regex, choice, grammar")
        return cls(**value)

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def schema_text(self) -> str:
        """The JSON schema as canonical text (dict key order kept: it orders the output)."""
        assert self.json is not None
        return self.json if isinstance(self.json, str) else _json.dumps(self.json)

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (for the compile cache)."""
        kind = self.kind
        if kind == "json":
            return kind, self.schema_text
        if kind == "choice":
            assert self.choice is not None
            return kind, _json.dumps(list(self.choice))
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


def _check_length(field_name: str, text: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{field_name} is {len(text)} characters; at most "
                         f"{MAX_CONSTRAINT_CHARS} are allowed")
