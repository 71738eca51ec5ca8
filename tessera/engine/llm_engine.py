"""`LLMEngine`: requests in, one scheduled forward pass per `step()`, `RequestOutput`s out.

    schedule -> executor.execute_model -> scheduler.update_from_output -> output_processor

Synchronous and single-threaded: `AsyncLLMEngine` drives it from a background thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable

from tessera.config import EngineArgs, EngineConfig
from tessera.core.admission import cache_fit
from tessera.core.kv_cache_groups import cache_group_windows
from tessera.core.kv_connector import PullConnectorScheduler, check_kv_transfer_params
from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler import Scheduler
from tessera.core.scheduler_output import SchedulerOutput
from tessera.engine.dashboard.snapshot import DashboardRecorder
from tessera.engine.lora_registry import LoRARegistry
from tessera.engine.metrics_view import engine_metrics
from tessera.engine.output_processor import OutputProcessor, RequestState
from tessera.engine.stats import EngineStats, StatsSnapshot
from tessera.engine.step_log import ENV_VAR as STEP_LOG_ENV
from tessera.engine.step_log import StepLog
from tessera.engine.step_recovery import find_culprits
from tessera.engine.step_times import StepTimes
from tessera.executor.abstract import Executor, ExecutorDeadError
from tessera.inputs import prompt_token_ids
from tessera.lora.request import LoRARequest
from tessera.outputs import EmbeddingRequestOutput, RequestMetrics, RequestOutput
from tessera.pooling_params import PoolingParams
from tessera.sampling.grammar import GrammarBackend
from tessera.sampling.params import RequestOutputKind, SamplingParams
from tessera.sequence import Sequence, SequenceGroup, new_seq_id

logger = logging.getLogger(__name__)

_KV_POLL_SECONDS = 0.002  # idle step interval while only KV transfers are in flight


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
        kv_connector: PullConnectorScheduler | None = None,
        model_arch=None,
    ):
        self.config = config
        # the base model's shapes: adapters are checked against them (--enable-lora)
        self.model_arch = model_arch
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.clock = clock
        self.grammar_backend = grammar_backend or GrammarBackend(tokenizer, vocab_size,
                                                                 eos_token_ids)
        # each KV cache group's window, as the block manager keeps them (fixed by the config)
        self.group_windows = cache_group_windows(config.cache.sliding_window,
                                                 config.cache.layer_windows)
        if kv_connector is None and config.kv_transfer is not None:
            kv_connector = PullConnectorScheduler(
                config.kv_transfer, config.cache.block_size, clock=clock,
                num_groups=len(self.group_windows))
        self.scheduler = Scheduler(
            config.scheduler, config.cache, executor.num_gpu_blocks, executor.num_cpu_blocks,
            clock=clock, eos_token_ids=eos_token_ids, kv_connector=kv_connector,
            max_loras=None if config.lora is None else config.lora.max_loras,
            num_draft_gpu_blocks=executor.num_draft_gpu_blocks,
        )
        self.loras = LoRARegistry(config.lora, model_arch)
        self.output_processor = OutputProcessor(tokenizer, clock)
        self.step_times = StepTimes()
        self.stats = EngineStats(kv_transfer=config.kv_transfer is not None)
        self.step_log: StepLog | None = None  # start_step_log: for the simulator's replay
        if os.environ.get(STEP_LOG_ENV):
            self.start_step_log(os.environ[STEP_LOG_ENV])
        # the live view (/dashboard): records steps only while a page is open
        self.dashboard = DashboardRecorder(self.scheduler, model_name)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, bundle=None,
                         step_log: str | None = None) -> LLMEngine:
        """Load the model named by `args` (or reuse a loaded `ModelBundle`) and build the engine;
        with `step_log`, it logs every step there (`start_step_log`)."""
        from tessera.engine.loading import build_engine

        engine = build_engine(cls, args, bundle)
        if step_log is not None:
            engine.start_step_log(step_log)
        return engine

    def start_step_log(self, path: str) -> None:
        """Write the step log (tessera/engine/step_log.py: the format `tessera simulate
        --replay` reads) to `path` from now on, replacing the file. Call it before the first
        request: a replay needs every arrival."""
        if self.step_log is not None:
            self.step_log.close()
        self.step_log = StepLog(path, self.config, self.executor.num_gpu_blocks,
                                self.executor.num_cpu_blocks, self.model_name,
                                getattr(self.executor, "block_bytes", None),
                                self.executor.num_draft_gpu_blocks)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams | PoolingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError; a prompt that can never fit is not an
        error here: it comes back from `step()` finished, with `error` set. With `PoolingParams`
        (vLLM's params for an embedding) the request is prefill-only and finishes with an
        `EmbeddingRequestOutput`. `lora_request`: the adapter it runs under (--enable-lora),
        checked here (ValueError naming the field)."""
        if lora_request is not None:
            self.loras.check(lora_request)
        if isinstance(sampling_params, PoolingParams):
            self._add_pooling_request(request_id, prompt, sampling_params, priority, arrival_time)
            return
        params = self._check_params(sampling_params or SamplingParams())
        if self.tokenizer is None and params.stop:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_constraints(params)
        text, token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        self._check_fits(len(token_ids), params)
        if params.kv_transfer_params is not None:
            if params.n != 1:
                raise ValueError("kv_transfer_params: a request with n > 1 cannot move its KV")
            check_kv_transfer_params(params.kv_transfer_params, self.config.kv_transfer,
                                     len(token_ids), self.config.cache.block_size,
                                     len(self.group_windows))
        arrival = self.clock() if arrival_time is None else arrival_time
        group = SequenceGroup(
            request_id=request_id,
            seqs=[Sequence(new_seq_id(), token_ids)],
            sampling_params=params,
            arrival_time=arrival,
            priority=priority,
            prompt=text,
            lora_request=lora_request,
        )
        self.scheduler.add_seq_group(group)
        if self.step_log is not None:
            self.step_log.arrival(request_id, token_ids, params, priority,
                                  self.clock() - arrival)
        self.output_processor.add_request(
            RequestState(request_id, text, token_ids, params, arrival_time=arrival)
        )

    def _add_pooling_request(self, request_id: str, prompt: str | list[int] | dict,
                             pooling_params: PoolingParams, priority: int,
                             arrival_time: float | None) -> None:
        """An embedding request: its prompt alone is computed (it may fill max_model_len, having
        no output), pooled as `--pooler-config` says unless the request overrides `normalize`."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        # one token's worth of SamplingParams keeps the scheduler's arithmetic whole; nothing is
        # sampled (the update finishes the request when its prompt is done)
        params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        arrival = self.clock() if arrival_time is None else arrival_time
        group = SequenceGroup(
            request_id=request_id, seqs=[Sequence(new_seq_id(), token_ids)],
            sampling_params=params, arrival_time=arrival, priority=priority, prompt=text,
            pooling_params=pooling_params.resolve(self.config.pooler),
        )
        self.scheduler.add_seq_group(group)
        self.output_processor.add_request(
            RequestState(request_id, text, token_ids, params, arrival_time=arrival, pooling=True))

    def check_constraints(self, params: SamplingParams) -> None:
        """Token ids in the vocabulary, and a structured-output constraint that compiles (the
        compiled grammar is cached, so calling this ahead, off the engine thread, is cheap)."""
        params.check_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            self.grammar_backend.compile(params.structured_outputs)
    def _check_params(self, params: SamplingParams) -> SamplingParams:
        """The limits that need the model (SamplingParams checked the rest): logprobs by
        --max-logprobs; a top_k above the vocabulary is off, so it is clamped to it (vLLM's rule),
        and no wider integer reaches the sampler."""
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be at most {limit} (the server's --max-logprobs), "
                                 f"got {value}")
        if params.top_k > self.vocab_size:
            params = dataclasses.replace(params, top_k=self.vocab_size)
        return params

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """n > 1: the cache must hold all n sequences at their longest, each whole (a recompute
        prefills every sequence again, without sharing), or the request could be admitted, run,
        and be rejected later with its work thrown away. (One sequence always fits: the engine
        refuses to start with a cache smaller than one max_model_len request.)"""
        if params.n == 1:
            return
        max_len = self.config.model.max_model_len
        longest = min(num_prompt_tokens + (params.max_tokens or max_len), max_len)
        cache = self.config.cache
        need, usable, _ = cache_fit(params.n, longest, cache.block_size,
                                    self.executor.num_gpu_blocks, cache.watermark,
                                    group_windows=self.group_windows,
                                    max_chunk_tokens=self.config.scheduler.max_num_batched_tokens)
        if self.executor.num_draft_gpu_blocks:  # the draft's own pool holds every token block
            draft = cache_fit(params.n, longest, cache.block_size,
                              self.executor.num_draft_gpu_blocks, cache.watermark)
            if draft[0] * usable > need * draft[1]:  # the tighter of the two pools decides
                need, usable = draft[0], draft[1]
        if need > usable:
            most = max(usable // (need // params.n), 1)
            raise ValueError(
                f"n must be at most {most} for this prompt and max_tokens: {params.n} sequences "
                f"of up to {longest} tokens need up to {need} KV blocks, more than the "
                f"{usable} the cache holds; lower n or max_tokens")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.step_log is not None and ids:
            self.step_log.abort(ids)
        self.stats.observe_aborted([rid for rid in ids if rid in self.output_processor.requests])
        self.scheduler.abort_seq_group(ids)
        self.output_processor.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        """Also True while KV transfers are in flight: the loop must step to hear them end."""
        return self.scheduler.has_unfinished_seqs() or self.scheduler.has_pending_kv_transfers()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        failed: list[RequestOutput | EmbeddingRequestOutput] = []
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except ExecutorDeadError:
            raise  # no worker left to re-run anything on: the caller fails every request
        except Exception as e:
            runner_output, failed = self._recover(scheduler_output, e)
        t2 = time.perf_counter()
        watched = self.dashboard.active
        accepted = self.scheduler.stats().num_spec_accepted_tokens_total if watched else 0
        if runner_output.kv_transfer_stats is not None:
            self.stats.observe_kv_transfers(runner_output.kv_transfer_stats.transfer_seconds)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stop_string_matches = self.output_processor.process(core_outputs)
        self.scheduler.finish_seqs(stop_string_matches)
        self.stats.observe_step(
            self.clock(), scheduler_output.total_num_scheduled_tokens, outputs,
            [c.request_id for c in core_outputs if any(d.new_token_ids for d in c.seqs)],
        )
        outputs += failed  # the culprits of a step that raised (engine/step_recovery.py)
        t3 = time.perf_counter()
        self.step_times.record(
            t1 - t0, t2 - t1, t3 - t2, scheduler_output.total_num_scheduled_tokens,
            len(scheduler_output.num_scheduled_tokens),
        )
        if self.step_log is not None:
            self.step_log.step(scheduler_output, core_outputs, outputs, t0, t3,
                               self.has_unfinished_requests())
        if watched:
            end = self.clock()
            self.dashboard.record_step(
                scheduler_output, end - (t3 - t0), end,
                self.scheduler.stats().num_spec_accepted_tokens_total - accepted)
        if (
            not scheduler_output.total_num_scheduled_tokens
            and self.scheduler.has_pending_kv_transfers()
        ):
            time.sleep(_KV_POLL_SECONDS)  # only transfers in flight: poll, do not spin
        return outputs

    def _recover(
        self, scheduler_output: SchedulerOutput, error: Exception
    ) -> tuple[ModelRunnerOutput, list[RequestOutput]]:
        """The step raised: find the request(s) that make it fail and fail only those; the
        others' results come from re-runs (see engine/step_recovery.py)."""
        logger.error(
            "engine step failed (%s: %s); re-running its %d requests in halves to find the culprit",
            type(error).__name__,
            error,
            len(scheduler_output.num_scheduled_tokens),
            exc_info=error,
        )
        runner_output, culprits = find_culprits(
            scheduler_output, self.scheduler.resend_whole, self.executor.execute_model
        )
        failed: dict[str, BaseException] = {}
        for req_id, e in culprits.items():
            request_id = self.scheduler.request_id_of(req_id)
            if request_id is not None:
                failed.setdefault(request_id, e)
        outputs = []
        for request_id, e in failed.items():
            logger.error(
                "request %s fails the engine step on its own (%s: %s): it is stopped, "
                "the others go on",
                request_id,
                type(e).__name__,
                e,
                exc_info=e,
            )
            state = self.output_processor.requests.get(request_id)
            if state is not None:
                outputs.append(
                    RequestOutput(
                        request_id=request_id,
                        prompt=state.prompt,
                        prompt_token_ids=state.prompt_token_ids,
                        outputs=[],
                        finished=True,
                        metrics=state.metrics or RequestMetrics(arrival_time=state.arrival_time),
                        error=f"the engine failed while running this request ({type(e).__name__}); "
                        "it was stopped so that the other requests could go on",
                        failed=True,
                    )
                )
        self.abort_request(list(failed))
        return runner_output, outputs

    # ---- helpers for front ends --------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], **options) -> list[int]:
        """`options` go to `tessera.tokenizer.apply_chat_template` (tools, chat_template,
        chat_template_kwargs, ...)."""
        from tessera.tokenizer import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, **options)

    def get_metrics(self) -> dict[str, float]:
        """Current values keyed by the Prometheus names `/metrics` serves (engine_metrics)."""
        lora = self.config.lora
        stats = self.scheduler.stats(detail=lora is not None)  # detail: the adapters in use
        return engine_metrics(stats, lora, self.config.speculative)

    def get_stats(self) -> StatsSnapshot:
        """The histograms and labelled counters only the loop sees (see tessera/engine/stats.py)."""
        return self.stats.snapshot()

    def get_dashboard_snapshot(self) -> dict:
        """One sample of the live view (tessera/engine/dashboard/snapshot.py); engine thread
        only."""
        return self.dashboard.snapshot(self.clock())

    def check_health(self) -> None:
        """Raises `ExecutorDeadError` once a worker process is gone (for idle front ends)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        if self.step_log is not None:
            self.step_log.close()
        self.executor.shutdown()

