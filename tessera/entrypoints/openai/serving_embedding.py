"""`POST /v1/embeddings`: each input becomes one prefill-only engine request (`PoolingParams`),
scheduled beside the generation requests of the same engine; its vector is the prompt's final
hidden states pooled as `--pooler-config` says (tessera/worker/pooler.py).

`encoding_format: "base64"` sends each vector as the base64 of its little-endian float32 bytes
(what the `openai` client asks for by default and decodes back into floats)."""

from __future__ import annotations

import base64
import struct
import uuid

from fastapi import Request
from fastapi.responses import Response

from tessera.entrypoints.openai.errors import bad_request
from tessera.entrypoints.openai.protocol_embedding import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from tessera.entrypoints.openai.serving_engine import OpenAIServing
from tessera.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, req: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        self.check_priority(req.priority)
        try:
            params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        except ValueError as e:  # dimensions: the message names it
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
        prompts = await self._prompts(req)
        base_id = f"embd-{uuid.uuid4().hex}"
        # PoolingParams in place of SamplingParams: the engine makes the request prefill-only
        finals: list = await self.run_to_completion(raw_request, base_id, prompts, params,
                                                    req.priority or 0)
        if finals is None:
            return self.aborted_response()
        data = [EmbeddingData(index=i, embedding=_encode(out.outputs.embedding,
                                                         req.encoding_format))
                for i, out in enumerate(finals)]
        num_tokens = sum(len(p) for p in prompts)
        body = EmbeddingResponse(id=base_id, model=self.served_model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                      total_tokens=num_tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    async def _prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        """Token ids of each input; every one must fit in max_model_len (an embedding has no
        output, so a prompt may fill it)."""
        raw = req.input
        single = isinstance(raw, str) or isinstance(raw[0], int)
        items: list = [raw] if single else list(raw)
        prompts = []
        for i, item in enumerate(items):
            param = "input" if len(items) == 1 else f"input.{i}"
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise bad_request("this model has no tokenizer: send token ids as input",
                                      "input")
                token_ids = await self.preprocessor.encode(item, param, req.add_special_tokens)
                if not token_ids:
                    raise bad_request(f"{param} tokenizes to nothing", param)
            else:
                token_ids = list(item)
                self.check_token_ids(token_ids, param)
            if len(token_ids) > self.max_model_len:
                raise bad_request(f"this model's maximum context length is {self.max_model_len} "
                                  f"tokens, but {param} has {len(token_ids)} tokens; shorten it",
                                  param)
            prompts.append(token_ids)
        return prompts


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
