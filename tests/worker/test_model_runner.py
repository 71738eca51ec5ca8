"""The runner's side of the boundary: its persistent batch follows the scheduler's messages, and
`prepare_input` flattens a step (decodes first) into input ids, positions, slot mapping, logits
indices and each backend's per-token tables. No model is needed: only the input preparation."""

from __future__ import annotations

import pytest
import torch

from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
from tessera.worker.model_runner import ModelRunner

BS = 4


def make_runner(backend: str | None = None) -> ModelRunner:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=BS, dtype=torch.float32)
    dev = torch.device("cpu")
    return ModelRunner(None, CacheEngine(spec, 16, 0, dev), BS, dev, attention_backend=backend)


def two_requests(runner: ModelRunner, chunk: int = 6) -> SchedulerOutput:
    """b decodes (prompt 3 + 1 output, on block 7); a is new (prompt 6, on blocks 5 and 2)."""
    first = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("b", [11, 12, 13], [], SamplingParams(), [7], 0)],
        num_scheduled_tokens={"b": 3},
    )
    runner.requests.update(first)
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3, 4, 5, 6], [], SamplingParams(seed=5),
                                           [5, 2], 0, seed=5)],
        scheduled_cached_reqs=[CachedRequestData("b", [14], [], False, 3)],
        num_scheduled_tokens={"a": chunk, "b": 1},
    )


def test_prepare_input_flattens_decodes_first():
    runner = make_runner()
    out = two_requests(runner)
    runner.requests.update(out)
    inp = runner.prepare_input(out)
    assert inp.input_ids.tolist() == [14, 1, 2, 3, 4, 5, 6]
    assert inp.positions.tolist() == [3, 0, 1, 2, 3, 4, 5]
    assert inp.attn_metadata.slot_mapping.tolist() == [7 * BS + 3, 20, 21, 22, 23, 8, 9]
    assert inp.logits_indices.tolist() == [0, 6] and inp.sampled_req_ids == ["b", "a"]
    assert runner.requests["b"].output_token_ids == [14]  # the diff was applied
    assert runner.requests["a"].generator is not None  # seeded: its own generator


def test_a_prompt_chunk_is_not_sampled():
    runner = make_runner()
    out = two_requests(runner, chunk=4)
    runner.requests.update(out)
    inp = runner.prepare_input(out)
    assert inp.logits_indices.tolist() == [0] and inp.sampled_req_ids == ["b"]
    assert inp.attn_metadata.slot_mapping.tolist() == [31, 20, 21, 22, 23]


def test_paged_kernel_tables_per_token():
    runner = make_runner()
    if runner.attn_backend.name != "paged_kernel":
        pytest.skip("the C++ kernel is not built here")
    out = two_requests(runner)
    runner.requests.update(out)
    meta = runner.prepare_input(out).attn_metadata
    # b's row: its table; a's 6 rows: a's table; padded to the longest (2 blocks) with block 0
    assert meta.token_block_tables.tolist() == [[7, 0]] + [[5, 2]] * 6
    assert meta.token_seq_lens.tolist() == [4, 1, 2, 3, 4, 5, 6]


def test_sdpa_metadata_has_one_decode_and_one_fresh_prefill():
    runner = make_runner("sdpa")
    out = two_requests(runner)
    runner.requests.update(out)
    meta = runner.prepare_input(out).attn_metadata
    assert meta.num_decodes == 1
    assert meta.decode_block_tables.tolist() == [7]
    assert meta.decode_mask.view(-1).tolist() == [True] * 4
    [span] = meta.prefills
    assert (span.start, span.end, span.num_context) == (1, 7, 0)


def test_persistent_batch_replaces_tables_and_keeps_generators_on_resume():
    runner = make_runner()
    out = two_requests(runner)
    runner.requests.update(out)
    gen = runner.requests["a"].generator
    # copy-on-write moved a's last block: the whole table is sent again
    runner.requests.update(SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData("a", [9], [5, 3], True, 6)],
        num_scheduled_tokens={"a": 1}))
    assert runner.requests["a"].block_ids == [5, 3]
    # appended blocks extend it
    runner.requests.update(SchedulerOutput(
        scheduled_cached_reqs=[CachedRequestData("a", [10], [4], False, 7)],
        num_scheduled_tokens={"a": 1}))
    assert runner.requests["a"].block_ids == [5, 3, 4]
    assert runner.requests["a"].output_token_ids == [9, 10]
    # resumed after recompute: sent whole again, generator kept
    runner.requests.update(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3, 4, 5, 6], [9, 10], SamplingParams(seed=5),
                                           [1, 0], 0, seed=5)],
        num_scheduled_tokens={"a": 8}))
    assert runner.requests["a"].generator is gen and runner.requests["a"].block_ids == [1, 0]
    runner.requests.update(SchedulerOutput(finished_req_ids=["a", "b"]))
    assert len(runner.requests) == 0
