"""The draft model's KV cache follows the target's: the scheduler's swaps and copies move its
blocks too, a swapped-back request keeps its draft K/V, a recomputed one starts over, and
positions past the block table go to scratch blocks above the scheduler's ids."""

from __future__ import annotations

import types

import torch

from tessera.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tessera.sampling.params import SamplingParams
from tessera.worker.cache_engine import CacheEngine, KVCacheSpec
from tessera.worker.input_batch import InputBatch
from tessera.worker.spec_decode import DraftModelProposer, DraftRequest

V = 7
CPU = torch.device("cpu")


class CountingDraft:
    """Proposes (last token + 1) % V; records each forward's positions and slots."""

    def __init__(self):
        self.calls = []

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        self.calls.append((positions.tolist(), attn_metadata))
        return torch.nn.functional.one_hot((input_ids + 1) % V, V).float()

    def compute_logits(self, hidden):
        return hidden


def _proposer(k=3):
    spec = KVCacheSpec(1, 1, 2, 4, torch.float32)
    meta = types.SimpleNamespace(
        build_metadata=lambda spans, slots, positions: (spans, slots.tolist())
    )
    return DraftModelProposer(CountingDraft(), CacheEngine(spec, 8, 8, CPU), meta, 4, k, 64, CPU)


def _new(req_id, tokens, blocks, computed, seed=None):
    return NewRequestData(req_id, tokens, [], SamplingParams(temperature=0.0), blocks, computed,
                          seed=seed)


def test_swap_moves_draft_blocks_and_keeps_their_kv():
    prop = _proposer()
    prop.cache.gpu_cache[:, :, 2] = 3.0
    prop.computed["a"] = 6
    prop.apply_cache_ops(SchedulerOutput(blocks_to_swap_out={2: 5}))
    assert torch.all(prop.cache.cpu_cache[:, :, 5] == 3.0)
    # back in, to device block 6: the draft's K/V came along, so it stays valid
    back = SchedulerOutput(scheduled_new_reqs=[_new("a", list(range(7)), [6, 1], 6)],
                           blocks_to_swap_in={5: 6, 4: 1})
    prop.apply_cache_ops(back)
    assert torch.all(prop.cache.gpu_cache[:, :, 6] == 3.0)
    assert prop.computed["a"] == 6
    prop.apply_cache_ops(SchedulerOutput(blocks_to_copy=[(6, 0)]))
    assert torch.all(prop.cache.gpu_cache[:, :, 0] == 3.0)
    # sent whole without a swap-in (recompute, step recovery): start over
    prop.apply_cache_ops(SchedulerOutput(scheduled_new_reqs=[_new("a", list(range(7)), [6, 1], 4)]))
    assert prop.computed["a"] == 0
    prop.apply_cache_ops(SchedulerOutput(finished_req_ids=["a"]))
    assert "a" not in prop.computed


def test_catch_up_then_drafts_with_scratch_past_the_table():
    prop = _proposer(k=3)
    batch = InputBatch(CPU)
    out = SchedulerOutput(scheduled_new_reqs=[_new("a", [1, 2, 3, 4, 5], [3, 4], 0)])
    batch.update(out)
    prop.apply_cache_ops(out)
    # the target computed the 5 prompt tokens and sampled 6: context of 6 tokens
    drafts = prop.propose([DraftRequest(batch["a"], [6])])
    assert drafts == [[0, 1, 2]]  # (6 + 1) % 7, then + 1 each step
    positions = [p for p, _ in prop.model.calls]
    assert positions == [[0, 1, 2, 3, 4, 5], [6], [7]]
    # positions 0..7 in blocks 3, 4 of the table; 8.. would be scratch (id >= 8): not needed here
    (_, slots0), (_, slots2) = prop.model.calls[0][1], prop.model.calls[2][1]
    assert slots0 == [12, 13, 14, 15, 16, 17] and slots2 == [19]
    assert prop.computed["a"] == 6
    # next step: 2 drafts accepted plus a bonus token; table grown by one block
    diff = SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("a", [6], [5], False, 5)])
    batch.update(diff)
    prop.apply_cache_ops(diff)
    prop.model.calls.clear()
    drafts = prop.propose([DraftRequest(batch["a"], [0, 1, 4])])
    assert drafts == [[5, 6, 0]]
    # catch-up: the 3 new tokens (positions 6..8); drafts fed at 9, 10 (all in the 3 blocks)
    assert [p for p, _ in prop.model.calls] == [[6, 7, 8], [9], [10]]
    assert prop.computed["a"] == 9
    # a table too short for the drafts: they spill into scratch blocks past id 8
    batch.update(
        SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("a", [0, 1, 4], [], False, 9)])
    )
    prop.model.calls.clear()
    prop.propose([DraftRequest(batch["a"], [2, 3])])
    slots = [s for _, (_, ss) in prop.model.calls for s in ss]
    # context of 11: inputs at 9, 10 (catch-up), 11, 12 (drafts); 12 is past the 3 blocks
    assert [p for p, _ in prop.model.calls] == [[9, 10], [11], [12]]
    assert slots[-1] >= 8 * 4  # a scratch block, above the scheduler's 8
    assert prop.computed["a"] == 11
