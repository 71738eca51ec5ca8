"""What the engine thread hands the live view: a plain, JSON-ready dict built from the counters the
scheduler already keeps, never a live object the HTTP side could read while the engine writes it.

Cost, because nothing here may slow the engine:
- per step, only while someone watches (`active`): one pass over the step's scheduled requests
  (prefill or decode tokens) and one small tuple appended to a bounded deque; while nobody
  watches, one attribute test per step;
- per sample (at most one per `--dashboard-interval`): `Scheduler.stats(detail=True)`: the block
  map, one byte per block from `BlockPool.block_states()` (C-level passes; ~1 ms for 20,000
  blocks here), the queues' lengths and oldest arrival (the FCFS head; the priority policy has
  no such head and walks its queue), and one row per running or swapped request (at most
  `MAX_REQUEST_ROWS`).

Nothing about a request's content is read: ids, counts and states only.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tessera.core.scheduler import Scheduler
from tessera.core.scheduler_output import SchedulerOutput
from tessera.core.scheduler_stats import RequestStats

SCHEMA_VERSION = 1
MAX_STEPS = 64  # steps kept between two samples (the latest ones)
MAX_REQUEST_ROWS = 256
# block map cell codes, as digits: see docs/dashboard.md
FREE, USED, CACHED, CACHED_USED, SWAPPING = "0", "1", "2", "3", "4"
_DIGITS = bytes.maketrans(bytes(range(5)), b"01234")


class DashboardRecorder:
    """Owned by the engine thread (or the simulator's loop). `active` is the one field another
    thread writes: a bool the HTTP side sets while a page is open."""

    def __init__(self, scheduler: Scheduler, model_name: str = "tessera") -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self.active = False
        self._steps: deque[tuple] = deque(maxlen=MAX_STEPS)
        self._num_steps = 0
        self._num_swap_preemptions = 0  # counted while active; rates use differences
        self._swap_gpu: set[int] = set()  # device blocks moved out or in since the last sample
        self._swap_cpu: set[int] = set()
        self._seq = 0

    def reset(self) -> None:
        """Forget the steps and swaps of an earlier viewing (a page opens after none was)."""
        self._steps.clear()
        self._swap_gpu, self._swap_cpu = set(), set()

    def record_step(self, out: SchedulerOutput, start: float, end: float,
                    num_spec_accepted: int = 0) -> None:
        """One step's batch: `start`/`end` in the snapshot's clock (seconds)."""
        spec = out.scheduled_spec_decode_tokens
        # a fresh prompt computing one token (the rest hit the prefix cache) is a prefill too
        fresh = {r.req_id for r in out.scheduled_new_reqs if not r.output_token_ids}
        prefill = decode = drafted = 0
        for req_id, n in out.num_scheduled_tokens.items():
            k = len(spec[req_id]) if spec and req_id in spec else 0
            drafted += k
            if n - k == 1 and req_id not in fresh:  # one new token (plus drafts): a decode
                decode += 1
            else:
                prefill += n - k
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            self._swap_gpu.update(out.blocks_to_swap_out)
            self._swap_cpu.update(out.blocks_to_swap_out.values())
            self._swap_cpu.update(out.blocks_to_swap_in)
            self._swap_gpu.update(out.blocks_to_swap_in.values())
        self._num_swap_preemptions += out.num_swapped_out
        self._num_steps += 1
        self._steps.append((self._num_steps, start, end, prefill, decode, drafted,
                            num_spec_accepted, out.total_num_scheduled_tokens,
                            len(out.num_scheduled_tokens), len(out.preempted_request_ids)))

    def snapshot(self, now: float) -> dict[str, Any]:
        """One sample (docs/dashboard.md); drains the steps recorded since the last one."""
        sched = self.scheduler
        s = sched.stats(detail=True, max_requests=MAX_REQUEST_ROWS)
        detail = s.detail
        assert detail is not None
        config, block_size = sched.config, sched.cache_config.block_size
        self._seq += 1
        steps = [{"step": i, "start": t0, "step_ms": 1e3 * (t1 - t0), "prefill_tokens": p,
                  "decode_tokens": d, "spec_drafted": k, "spec_accepted": a,
                  "num_tokens": n, "num_seqs": q, "preempted": r}
                 for i, t0, t1, p, d, k, a, n, q, r in self._steps]
        self._steps.clear()
        gpu = _block_map(detail.gpu_block_states, self._swap_gpu)
        cpu = _block_map(detail.cpu_block_states, self._swap_cpu)
        num_swapping = len(self._swap_gpu)
        self._swap_gpu, self._swap_cpu = set(), set()
        return {
            "version": SCHEMA_VERSION,
            "seq": self._seq,
            "time": now,
            "config": {"model": self.model_name, "block_size": block_size,
                       "num_gpu_blocks": s.num_gpu_blocks, "num_cpu_blocks": s.num_cpu_blocks,
                       "max_num_batched_tokens": config.max_num_batched_tokens,
                       "max_num_seqs": config.max_num_seqs,
                       "scheduling_policy": config.scheduling_policy.value},
            "queues": {"waiting": s.num_waiting, "running": s.num_running,
                       "swapped": s.num_swapped,
                       "waiting_for_remote_kv": s.num_waiting_for_remote_kvs,
                       "oldest_waiting_s": _age(detail.oldest_waiting_arrival, now),
                       "oldest_swapped_s": _age(detail.oldest_swapped_arrival, now)},
            "kv": {"num_blocks": s.num_gpu_blocks, "num_free": s.num_free_gpu_blocks,
                   "num_used": s.num_gpu_blocks - s.num_free_gpu_blocks,
                   "num_cached": gpu.count(CACHED) + gpu.count(CACHED_USED),
                   "num_swapping": num_swapping, "blocks": gpu,
                   "cpu": {"num_blocks": s.num_cpu_blocks,
                           "num_used": s.num_cpu_blocks - s.num_free_cpu_blocks,
                           "blocks": cpu}},
            "steps": steps,
            "counters": {"prompt_tokens": s.num_prompt_tokens_total,
                         "generation_tokens": s.num_generation_tokens_total,
                         "preemptions": s.num_preemptions_total,
                         "swap_preemptions": self._num_swap_preemptions,
                         "prefix_cache_queries": s.num_prefix_cache_queries_total,
                         "prefix_cache_hits": s.num_prefix_cache_hits_total,
                         "spec_draft_tokens": s.num_spec_draft_tokens_total,
                         "spec_accepted_tokens": s.num_spec_accepted_tokens_total},
            "requests": {"rows": [_row(r) for r in detail.requests],
                         "num_more": s.num_running + s.num_swapped - len(detail.requests)},
        }


def _block_map(states: bytes, swapping: set[int]) -> str:
    """The digits of `states`, with the blocks being swapped marked SWAPPING."""
    if swapping:
        cells = bytearray(states)
        for block in swapping:
            cells[block] = 4
        states = bytes(cells)
    return states.translate(_DIGITS).decode("ascii")


def _age(since: float | None, now: float) -> float | None:
    return None if since is None else max(0.0, now - since)


def _row(r: RequestStats) -> dict[str, Any]:
    return {"id": r.request_id, "adapter": r.lora_name, "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens, "tokens_done": r.num_computed_tokens,
            "tokens_total": r.max_num_tokens, "num_seqs": r.num_seqs, "state": r.state}
