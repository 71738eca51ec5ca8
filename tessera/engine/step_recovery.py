"""The engine's last line of defence: a step whose forward pass or sampling raised hurts only the
request that caused it.

Parameters have ranges (tessera/sampling/params.py) and work before admission is bounded, so a
step should never fail. If one does anyway (a bug one request's input reaches, a fault in a
kernel for one shape), failing every request in flight would let one request hurt all the others.
Instead `find_culprits` runs the step's requests again in halves, recursively, until each failing
half is a single request: that one is the culprit; every other request's results from the
successful halves are merged into one `ModelRunnerOutput`, as if the step had succeeded without
the culprit. Greedy tokens do not change: a request's results do not depend on its batch.

Why re-running is safe although the failed step may have half-updated the runner:
- the scheduler wrote nothing yet (`update_from_output`, which advances progress after a step,
  did not run), so its state still describes the step: the same tokens to compute, the same block
  tables;
- the runner's persistent batch may hold half-applied diffs, so each re-run sends its requests
  whole (`Scheduler.resend_whole`), which replaces the runner's copy (its seeded generators are
  kept; the sampler restores their state when it raises, so a seeded request draws the same
  numbers as it would have);
- K/V written for the failed step sits past each request's `num_computed_tokens`, and the re-run
  overwrites exactly those slots; the culprit's slots are freed with it.
- The step's cache operations (swap, copy) are not repeated: they ran before the forward pass.

Cost: a failing step costs at most 2k·log2(n) extra runs for k culprits among n requests; a step
that fails for every request (a broken device) ends with every request failed, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tessera.core.runner_output import ModelRunnerOutput
from tessera.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def find_culprits(
    scheduler_output: SchedulerOutput,
    resend_whole: Callable[[SchedulerOutput, list[str]], SchedulerOutput],
    execute: Callable[[SchedulerOutput], ModelRunnerOutput],
) -> tuple[ModelRunnerOutput, dict[str, BaseException]]:
    """Re-run the failed step's requests in halves. Returns the merged output of every request
    that ran, and the culprits (req_id -> the exception that request alone raised)."""
    culprits: dict[str, BaseException] = {}
    results: list[ModelRunnerOutput] = []

    def run(req_ids: list[str]) -> None:
        try:
            results.append(execute(resend_whole(scheduler_output, req_ids)))
        except Exception as e:
            if len(req_ids) == 1:
                culprits[req_ids[0]] = e
                return
            mid = len(req_ids) // 2
            run(req_ids[:mid])
            run(req_ids[mid:])

    req_ids = list(scheduler_output.num_scheduled_tokens)
    if len(req_ids) == 1:
        run(req_ids)  # once more alone: a transient fault is not the request's
    else:
        mid = len(req_ids) // 2
        run(req_ids[:mid])
        run(req_ids[mid:])
    return merge_outputs(results), culprits


def merge_outputs(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """One output for disjoint sets of requests (rows concatenated in order)."""
    merged = ModelRunnerOutput()
    with_logprobs = any(o.logprobs for o in outputs)
    with_drafts = any(o.spec_token_ids for o in outputs)
    for o in outputs:
        merged.req_ids += o.req_ids
        merged.sampled_token_ids += o.sampled_token_ids
        if with_logprobs:
            merged.logprobs += o.logprobs or [[] for _ in o.req_ids]
        if with_drafts:  # speculative decoding: a half without proposals proposes nothing
            merged.spec_token_ids += o.spec_token_ids or [[] for _ in o.req_ids]
        merged.prompt_logprobs.update(o.prompt_logprobs)
        merged.pooler_output.update(o.pooler_output)
        # the KV connector's reports ride on whichever re-run collected them
        merged.finished_sending += o.finished_sending
        merged.finished_recving += o.finished_recving
        merged.failed_recving += o.failed_recving
        merged.kv_transfer_stats = o.kv_transfer_stats or merged.kv_transfer_stats
    return merged
