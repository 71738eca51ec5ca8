"""`LLMEngine`: requests in, one scheduled forward pass per `step()`, `RequestOutput`s out.

    schedule -> executor.execute_model -> scheduler.update_from_output -> output_processor

Synchronous and single-threaded: `AsyncLLMEngine` drives it from a background thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tessera.config import EngineArgs, EngineConfig
from tessera.core.scheduler import Scheduler
from tessera.engine.output_processor import OutputProcessor, RequestState
from tessera.engine.stats import EngineStats, StatsSnapshot
from tessera.executor.abstract import Executor
from tessera.inputs import check_token_ids
from tessera.outputs import RequestOutput
from tessera.sampling.grammar import GrammarBackend
from tessera.sampling.params import SamplingParams
from tessera.sequence import Sequence, SequenceGroup, new_seq_id

logger = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Where the engine's time goes, summed over steps (seconds): for benchmarks and profiling."""

    num_steps: int = 0
    num_tokens: int = 0
    schedule: float = 0.0
    execute: float = 0.0
    update: float = 0.0

    def record(self, schedule: float, execute: float, update: float, num_tokens: int) -> None:
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.schedule += schedule
        self.execute += execute
        self.update += update


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        model_name: str = "tessera",
        clock: Callable[[], float] = time.monotonic,
        grammar_backend: GrammarBackend | None = None,
    ):
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.clock = clock
        self.grammar_backend = grammar_backend or GrammarBackend(tokenizer, vocab_size,
                                                                 eos_token_ids)
        self.scheduler = Scheduler(
            config.scheduler, config.cache, executor.num_gpu_blocks, executor.num_cpu_blocks,
            clock=clock, eos_token_ids=eos_token_ids,
        )
        self.output_processor = OutputProcessor(tokenizer, clock)
        self.step_times = StepTimes()
        self.stats = EngineStats()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, bundle=None) -> LLMEngine:
        """Load the model named by `args` (or reuse a loaded `ModelBundle`) and build the engine."""
        from tessera.engine.loading import build_engine

        return build_engine(cls, args, bundle)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError; a prompt that can never fit is not an
        error here: it comes back from `step()` finished, with `error` set."""
        params = sampling_params or SamplingParams()
        if self.tokenizer is None and params.stop:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_constraints(params)
        text, token_ids = self._tokenize(prompt)
        arrival = self.clock() if arrival_time is None else arrival_time
        group = SequenceGroup(
            request_id=request_id,
            seqs=[Sequence(new_seq_id(), token_ids)],
            sampling_params=params,
            arrival_time=arrival,
            priority=priority,
            prompt=text,
        )
        self.scheduler.add_seq_group(group)
        self.output_processor.add_request(
            RequestState(request_id, text, token_ids, params, arrival_time=arrival)
        )

    def check_constraints(self, params: SamplingParams) -> None:
        """Token ids in the vocabulary, and a structured-output constraint that compiles (the
        compiled grammar is cached, so calling this ahead, off the engine thread, is cheap)."""
        params.check_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            self.grammar_backend.compile(params.structured_outputs)

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            token_ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
            check_token_ids(token_ids, self.vocab_size, "prompt_token_ids")
        if not token_ids:
            raise ValueError("prompt is empty")
        return text, token_ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.stats.observe_aborted([rid for rid in ids if rid in self.output_processor.requests])
        self.scheduler.abort_seq_group(ids)
        self.output_processor.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output)
        t2 = time.perf_counter()
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stop_string_matches = self.output_processor.process(core_outputs)
        self.scheduler.finish_seqs(stop_string_matches)
        self.stats.observe_step(
            self.clock(), scheduler_output.total_num_scheduled_tokens, outputs,
            [c.request_id for c in core_outputs if any(d.new_token_ids for d in c.seqs)],
        )
        self.step_times.record(
            t1 - t0, t2 - t1, time.perf_counter() - t2, scheduler_output.total_num_scheduled_tokens
        )
        return outputs

    # ---- helpers for front ends --------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        from tessera.tokenizer import apply_chat_template

        return apply_chat_template(self.tokenizer, messages)

    def get_metrics(self) -> dict[str, float]:
        """Current values keyed by the Prometheus names `/metrics` serves."""
        s = self.scheduler
        bm = s.block_manager
        return {
            "tessera:num_requests_running": float(len(s.running)),
            "tessera:num_requests_waiting": float(len(s.waiting)),
            "tessera:num_requests_swapped": float(len(s.swapped)),
            "tessera:kv_cache_usage_perc": float(bm.gpu_usage()),
            "tessera:cpu_cache_usage_perc": float(bm.cpu_usage()),
            "tessera:num_preemptions_total": float(s.num_preemptions_total),
            "tessera:prompt_tokens_total": float(s.num_prompt_tokens_total),
            "tessera:generation_tokens_total": float(s.num_generation_tokens_total),
            "tessera:prefix_cache_hits_total": float(bm.num_prefix_cache_hits),
            "tessera:prefix_cache_queries_total": float(bm.num_prefix_cache_queries),
            "tessera:prompt_tokens_cached_total": float(bm.num_prefix_cache_hits),
        }

    def get_stats(self) -> StatsSnapshot:
        """The histograms and labelled counters only the loop sees (see tessera/engine/stats.py)."""
        return self.stats.snapshot()

    def shutdown(self) -> None:
        self.executor.shutdown()
