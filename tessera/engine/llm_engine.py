"""`LLMEngine`: requests in, one scheduled forward pass per `step()`, `RequestOutput`s out.

    schedule -> execute (cache moves, forward, sample) -> update (append, fork, detokenize, stop)
    -> free what finished -> outputs

Synchronous and single-threaded: `AsyncLLMEngine` drives it from a background thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tessera.config import EngineArgs, EngineConfig
from tessera.core.scheduler import Scheduler
from tessera.core.scheduler_output import SchedulerOutput
from tessera.engine.detokenizer import IncrementalDetokenizer
from tessera.engine.stop_checker import StopChecker
from tessera.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tessera.sampling.params import SamplingParams
from tessera.sampling.sampler import SampledToken
from tessera.sequence import Sequence, SequenceGroup, SequenceStatus
from tessera.worker.model_runner import ModelRunner, ModelRunnerOutput

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
        model_runner: ModelRunner,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        model_name: str = "tessera",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.model_runner = model_runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.clock = clock
        cache = model_runner.cache_engine
        self.scheduler = Scheduler(
            config.scheduler, config.cache, cache.num_gpu_blocks, cache.num_cpu_blocks, clock=clock
        )
        # no tokenizer (a bare HF checkpoint): token ids in, token ids out, no text
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop_checker = StopChecker(config.model.max_model_len, eos_token_ids)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> RNG of a seeded request
        self._seq_ids = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}
        self.step_times = StepTimes()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0

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
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        seq = Sequence(next(self._seq_ids), token_ids)
        group = SequenceGroup(
            request_id=request_id,
            seqs=[seq],
            sampling_params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority,
            prompt=text,
        )
        if params.seed is not None:
            self.generators[seq.seq_id] = self._generator(params.seed)
        self._groups[request_id] = group
        self.scheduler.add_seq_group(group)

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
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt_token_ids: {bad[0]!r} is not a token id in [0, {self.vocab_size})"
                )
        if not token_ids:
            raise ValueError("prompt is empty")
        return text, token_ids

    def _generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.model_runner.device)
        gen.manual_seed(seed)
        return gen

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for group in self.scheduler.abort_seq_group(ids):
            self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        t1 = time.perf_counter()
        runner_out = self.model_runner.execute(sched_out, self.generators)
        t2 = time.perf_counter()
        self.scheduler.update_after_step(sched_out)
        progressed = self._process_samples(sched_out, runner_out)
        finished = self.scheduler.free_finished_seq_groups()
        outputs = self._make_outputs(progressed + sched_out.ignored_groups, finished)
        self.step_times.record(t1 - t0, t2 - t1, time.perf_counter() - t2, sched_out.num_batched_tokens)
        return outputs

    def _process_samples(self, sched_out: SchedulerOutput, out: ModelRunnerOutput) -> list[SequenceGroup]:
        """Append each sampled token (forking n-1 children when a prompt completes), detokenize and
        check stop conditions. Returns the groups that gained a token."""
        now = self.clock()
        progressed = []
        for sg in sched_out.scheduled_groups:
            group = sg.group
            if group.first_scheduled_time is None:
                group.first_scheduled_time = now
            # prompt tokens computed this step (update_after_step already advanced the counters):
            # chunks, recomputed prompts and prompt-cache misses count, cache hits do not
            self.num_prompt_tokens_total += sum(
                max(0, min(s.seq.num_computed_tokens, s.seq.get_prompt_len())
                    - (s.seq.num_computed_tokens - s.num_new_tokens))
                for s in sg.seqs
            )
            self._record_prompt_logprobs(group, sg.seqs[0].seq.seq_id, out)
            sampled = [(s.seq, out.samples[s.seq.seq_id]) for s in sg.seqs if s.seq.seq_id in out.samples]
            if not sampled:
                continue
            if group.first_token_time is None:
                group.first_token_time = now
            for seq, tokens in sampled:
                self._fork_children(group, seq, tokens[1:])
                self._append(group, seq, tokens[0])
            group.last_token_time = now
            progressed.append(group)
        return progressed

    @staticmethod
    def _record_prompt_logprobs(group: SequenceGroup, seq_id: int, out: ModelRunnerOutput) -> None:
        """Extend the group's prompt logprobs with this chunk's (once: a recompute scores again)."""
        if seq_id not in out.prompt_logprobs:
            return
        first_pos, chunk = out.prompt_logprobs[seq_id]
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]  # the first prompt token has no logprob
        if len(group.prompt_logprobs) == first_pos:
            group.prompt_logprobs.extend(chunk)

    def _fork_children(self, group: SequenceGroup, parent: Sequence, tokens: list[SampledToken]) -> None:
        seed = group.sampling_params.seed
        for token in tokens:
            child = parent.fork(next(self._seq_ids))
            self.scheduler.fork_seq(group, parent, child)
            if seed is not None:
                self.generators[child.seq_id] = self._generator(seed + len(group.seqs) - 1)
            self._append(group, child, token)

    def _append(self, group: SequenceGroup, seq: Sequence, token: SampledToken) -> None:
        params = group.sampling_params
        seq.append_token(token.token_id, token.top_logprobs or {token.token_id: token.logprob})
        self.num_generation_tokens_total += 1
        new_text = self.detokenizer.decode_new(seq, params.skip_special_tokens) if self.detokenizer else ""
        self.stop_checker.check(seq, params, len(new_text))

    def _make_outputs(self, groups: list[SequenceGroup], finished: list[SequenceGroup]) -> list[RequestOutput]:
        now = self.clock()
        seen: dict[str, SequenceGroup] = {}
        for group in groups + finished:
            seen.setdefault(group.request_id, group)
        outputs = []
        for group in seen.values():
            if group.is_finished():
                group.finished_time = group.finished_time or now
                self._forget(group)
            outputs.append(self._request_output(group))
        return outputs

    def _forget(self, group: SequenceGroup) -> None:
        self._groups.pop(group.request_id, None)
        for seq in group.seqs:
            self.generators.pop(seq.seq_id, None)

    @staticmethod
    def _request_output(group: SequenceGroup) -> RequestOutput:
        want_logprobs = group.sampling_params.logprobs is not None
        completions = [
            CompletionOutput(
                index=i,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if want_logprobs else None,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(group.seqs)
        ]
        ignored = group.seqs[0].status is SequenceStatus.FINISHED_IGNORED
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=[] if ignored else completions,
            finished=group.is_finished(),
            metrics=RequestMetrics(
                arrival_time=group.arrival_time,
                first_scheduled_time=group.first_scheduled_time,
                first_token_time=group.first_token_time,
                last_token_time=group.last_token_time,
                finished_time=group.finished_time,
            ),
            prompt_logprobs=group.prompt_logprobs,
            error=group.error,
        )

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
            "tessera:prompt_tokens_total": float(self.num_prompt_tokens_total),
            "tessera:generation_tokens_total": float(self.num_generation_tokens_total),
            "tessera:prefix_cache_hits_total": float(bm.num_prefix_cache_hits),
            "tessera:prefix_cache_queries_total": float(bm.num_prefix_cache_queries),
        }
