"""The offline API: `LLM(model=None, **engine_args).generate(prompts, sampling_params)`, and
`LLM.embed(prompts)` for embeddings."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence as SequenceABC

from tqdm import tqdm

from tessera.config import EngineArgs
from tessera.engine.llm_engine import LLMEngine
from tessera.lora.request import LoRARequest
from tessera.outputs import EmbeddingRequestOutput, RequestOutput
from tessera.pooling_params import PoolingParams
from tessera.sampling.params import RequestOutputKind, SamplingParams

PromptType = str | dict | list[int]


class LLM:
    """Batch generation over one engine. Engine flags are keyword arguments with the same names as
    `tessera serve` flags (`block_size=16`, `enable_prefix_caching=True`, ...)."""

    def __init__(self, model: str | None = None, **engine_args):
        unknown = set(engine_args) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(
                f"unknown engine argument(s): {', '.join(sorted(unknown))}; "
                f"known: {', '.join(EngineArgs.field_names())}"
            )
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._request_ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (e.g. several engines sharing one loaded model)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._request_ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt is a string,
        `{"prompt_token_ids": [...]}` or `{"prompt": "..."}`. `lora_request`: the LoRA adapter
        of every prompt, or one per prompt (None: the base model); needs `enable_lora=True`."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._broadcast(sampling_params, len(prompt_list), "sampling_params")
        priorities = self._broadcast(priority, len(prompt_list), "priority", default=0)
        loras = self._broadcast(lora_request, len(prompt_list), "lora_request")
        for lora in loras:  # every adapter checked before any request is queued
            if lora is not None:
                self.llm_engine.loras.check(lora)
        request_ids = []
        for prompt, params, prio, lora in zip(prompt_list, params_list, priorities, loras,
                                              strict=True):
            # only the final output is read: no per-step copies of the text so far
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            request_id = str(next(self._request_ids))
            self.llm_engine.add_request(request_id, prompt, params, priority=prio,
                                        lora_request=lora)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (vLLM's `LLM.embed`): `out.outputs.embedding`
        is the prompt's final hidden states pooled as `pooler_config` says (default: the last
        token's, normalized). Prompts take the forms `generate` takes; each is prefill-only and
        scheduled like any other request. A prompt the engine rejects raises ValueError."""
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._broadcast(pooling_params or PoolingParams(), len(prompt_list),
                                      "pooling_params")
        request_ids = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            request_id = str(next(self._request_ids))
            self.llm_engine.add_request(request_id, prompt, params)
            request_ids.append(request_id)
        outputs = self._run(request_ids, use_tqdm)
        for out in outputs:
            if out.error is not None:
                raise ValueError(f"prompt {request_ids.index(out.request_id)}: {out.error}")
        return outputs  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the model's
        chat template (or `chat_template`); `chat_template_kwargs` are extra template variables,
        e.g. `{"enable_thinking": False}` for Qwen3."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, "tools": tools,
                   "chat_template_kwargs": chat_template_kwargs}
        prompts = [
            {"prompt_token_ids": self.llm_engine.apply_chat_template(conv, **options)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_metrics(self) -> dict[str, float]:
        return self.llm_engine.get_metrics()

    # ---- internals ---------------------------------------------------------------------------
    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [{"prompt_token_ids": prompts}]  # a single token-id prompt
        return prompts

    @staticmethod
    def _broadcast(value, n: int, name: str, default=None) -> list:
        if value is None:
            value = SamplingParams() if name == "sampling_params" else default
        if isinstance(value, list | tuple):
            if len(value) != n:
                raise ValueError(f"{name}: got {len(value)} for {n} prompts")
            return list(value)
        return [value] * n

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start, num_output_tokens = time.perf_counter(), 0
        try:
            while pending and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        if isinstance(out, RequestOutput):
                            num_output_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"output {num_output_tokens / elapsed:.1f} tok/s")
        except BaseException:
            engine.abort_request(list(pending))  # leave nothing behind on Ctrl-C or an error
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids if r in finished]
