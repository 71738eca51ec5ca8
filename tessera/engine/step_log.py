"""The step log: a JSON-lines record of everything the scheduler saw and did, one line per event,
switched on by `tessera serve --step-log FILE`, `LLMEngine.start_step_log`, or for any engine of
a process by `TESSERA_STEP_LOG=FILE` (benchmarks that build their own engine).

Why: `tessera simulate --replay FILE` sends the same requests, at the same times and with the
same token ids, through the real scheduler on a virtual clock whose steps take the logged
times, and checks that the schedule comes out the same step by step; the simulator's fidelity
benchmark prices each logged step with its cost model. So the log holds the trace (arrivals,
prompts, the tokens each request produced, aborts) and the schedule (each step's requests and
token counts, preemptions, swaps, wall time). docs/simulator.md documents the format; its
version is `FORMAT_VERSION`, and a reader refuses another.

Every time is `time.perf_counter()` seconds (one clock for the whole file). Records, by `type`:

    header   format, version, model, num_gpu_blocks, num_cpu_blocks, num_draft_gpu_blocks (the
             draft model's own pool, 0 when none), block_bytes (of one KV block, null when the
             executor does not say), scheduler and cache (the configs)
    arrival  time (the scheduler got it), arrival_time (the server received it), request_id,
             prompt_token_ids, max_tokens, n, priority, prompt_logprobs (bool: it turns prefix
             caching off for the request)
    step     step (0, 1, ...), start, end, busy (work was left: the next step began at once),
             num_seqs, num_tokens, reqs ([req_id, new tokens, computed tokens before] per
             scheduled stream), num_shared_context_tokens (of the KV tokens the step's streams
             read, those in blocks another of them reads too: a shared prefix's blocks counted
             once, tessera/core/context_sharing.py; absent in logs written before it, read as
             0), preempted (request ids), ignored (request ids refused as never fitting),
             swap_out and swap_in (blocks), tokens ({req_id: token ids it gained}), finished
             ({req_id: its output length}, streams that ended in this step)
    abort    time, request_ids (the client went away)

Steps that scheduled nothing are not logged (an idle engine polls only while KV transfers are
in flight).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Iterable

from tessera.config import EngineConfig
from tessera.core.context_sharing import BlockTables
from tessera.core.core_output import EngineCoreOutput
from tessera.core.scheduler_output import SchedulerOutput
from tessera.outputs import RequestOutput
from tessera.sampling.params import SamplingParams
from tessera.sequence import child_req_id

ENV_VAR = "TESSERA_STEP_LOG"
FORMAT = "tessera-step-log"
FORMAT_VERSION = 1


def _plain(config) -> dict:
    """A frozen config as JSON values (enums by their value)."""
    return {k: v.value if isinstance(v, enum.Enum) else v
            for k, v in dataclasses.asdict(config).items()}


class StepLog:
    """Writes one engine's step log. The engine calls `arrival`, `step` (for every step, also one
    that scheduled nothing: the block tables follow every message) and `abort`; nothing else
    writes the file. Line-buffered: a server stopped by a signal keeps every line."""

    def __init__(self, path: str, config: EngineConfig, num_gpu_blocks: int,
                 num_cpu_blocks: int, model: str, block_bytes: int | None = None,
                 num_draft_gpu_blocks: int = 0) -> None:
        self._file = open(path, "w", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._num_steps = 0
        self._num_output: dict[str, int] = {}  # req_id -> output tokens so far
        self._block_tables = BlockTables.for_cache(config.cache, num_draft_gpu_blocks)
        self._write({"type": "header", "format": FORMAT, "version": FORMAT_VERSION,
                     "model": model, "num_gpu_blocks": num_gpu_blocks,
                     "num_cpu_blocks": num_cpu_blocks,
                     "num_draft_gpu_blocks": num_draft_gpu_blocks, "block_bytes": block_bytes,
                     "scheduler": _plain(config.scheduler), "cache": _plain(config.cache)})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def arrival(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                priority: int, arrival_age: float) -> None:
        """A request the scheduler took now, received `arrival_age` seconds ago."""
        now = time.perf_counter()
        self._write({"type": "arrival", "time": now, "arrival_time": now - arrival_age,
                     "request_id": request_id, "prompt_token_ids": prompt_token_ids,
                     "max_tokens": params.max_tokens, "n": params.n, "priority": priority,
                     "prompt_logprobs": params.prompt_logprobs is not None})

    def step(self, out: SchedulerOutput, core_outputs: list[EngineCoreOutput],
             outputs: Iterable[RequestOutput], start: float, end: float, busy: bool) -> None:
        """Log the step `out` scheduled (nothing when it scheduled no token)."""
        self._block_tables.update(out)
        if not out.total_num_scheduled_tokens:
            return
        computed = out.num_computed_tokens_by_req()
        tokens: dict[str, list[int]] = {}
        for core in core_outputs:
            for delta in core.seqs:
                if delta.new_token_ids:
                    req_id = child_req_id(core.request_id, delta.index)
                    tokens[req_id] = list(delta.new_token_ids)
                    self._num_output[req_id] = (self._num_output.get(req_id, 0)
                                                + len(delta.new_token_ids))
        finished: dict[str, int] = {}
        for output in outputs:  # stop strings end a stream here, after the scheduler's update
            for completion in output.outputs:
                if completion.finished:
                    req_id = child_req_id(output.request_id, completion.index)
                    finished[req_id] = self._num_output.pop(req_id, 0)
        self._write({
            "type": "step", "step": self._num_steps, "start": start, "end": end, "busy": busy,
            "num_seqs": len(out.num_scheduled_tokens),
            "num_tokens": out.total_num_scheduled_tokens,
            "reqs": [[r, n, computed[r]] for r, n in out.num_scheduled_tokens.items()],
            "num_shared_context_tokens": self._block_tables.num_shared_context_tokens(out),
            "preempted": list(out.preempted_request_ids),
            "ignored": list(out.ignored_request_ids),
            "swap_out": len(out.blocks_to_swap_out), "swap_in": len(out.blocks_to_swap_in),
            "tokens": tokens, "finished": finished})
        self._num_steps += 1

    def abort(self, request_ids: list[str]) -> None:
        self._write({"type": "abort", "time": time.perf_counter(), "request_ids": request_ids})

    def close(self) -> None:
        self._file.close()
