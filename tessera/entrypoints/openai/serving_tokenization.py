"""`POST /tokenize` and `POST /detokenize` (vLLM's shapes): what the model sees for a prompt or a
conversation, and the text of token ids. Clients use them to count tokens and to check templates
without generating."""

from __future__ import annotations

from fastapi.responses import Response

from tessera.entrypoints.openai.errors import bad_request
from tessera.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from tessera.entrypoints.openai.serving_chat import OpenAIServingChat
from tessera.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest,
                       chat: OpenAIServingChat) -> Response:
        self.check_model(req.model)
        self._need_tokenizer()
        if isinstance(req, TokenizeChatRequest):
            # the same rendering as /v1/chat/completions, so the counts agree
            as_chat = ChatCompletionRequest.model_construct(
                _fields_set={"add_generation_prompt"} & req.model_fields_set,
                messages=req.messages, tools=req.tools, tool_choice=None,
                chat_template=req.chat_template, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.chat_template_kwargs)
            token_ids = await chat.render(as_chat)
        else:
            token_ids = await self.preprocessor.encode(req.prompt, "prompt",
                                                       req.add_special_tokens)
        strs = (self.tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs
                else None)
        body = TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len,
                                tokens=token_ids, token_strs=strs)
        return Response(body.model_dump_json(), media_type="application/json")

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        self.check_model(req.model)
        self._need_tokenizer()
        if req.tokens:
            self.check_token_ids(req.tokens, "tokens")
        body = DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer", "model")
