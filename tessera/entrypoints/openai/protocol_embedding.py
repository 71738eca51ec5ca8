"""Pydantic models of `POST /v1/embeddings` (OpenAI's shapes; requests strict, as in protocol.py:
a field we do not honour is a 400 naming it)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field

from tessera.entrypoints.openai.protocol import _Request, _Response
from tessera.sampling.params import INT32_MAX

# inputs in one request (OpenAI's limit); each becomes one prefill-only engine request
MAX_EMBEDDING_INPUTS = 2048

_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]
_Many = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
EmbeddingInput = (_Text | Annotated[list[_Text], _Many] | _TokenIds
                  | Annotated[list[_TokenIds], _Many])


class EmbeddingRequest(_Request):
    model: str | None = Field(None, description="the served model name; default: the only one")
    input: EmbeddingInput = Field(
        description="a string, strings, token ids, or lists of token ids (each one embedding)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each vector")
    dimensions: int | None = Field(
        None, ge=1, description="refused: this model's embeddings cannot be shortened")
    user: str | None = Field(None, description="end-user id; accepted, not used")
    # vLLM's extras
    normalize: bool | None = Field(None, description="unit L2 norm; default: --pooler-config's")
    add_special_tokens: bool = Field(True, description="e.g. the BOS token, for string inputs")
    priority: int | None = Field(0, ge=-(2**31), le=2**31 - 1,
                                 description="lower runs first under --scheduling-policy priority")


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
