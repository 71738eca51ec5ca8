"""Embedding requests in the scheduler (fake runner outputs, no model): prefill-only under the
token budget and chunked prefill, finished and freed in the step that completes the prompt (no
decode seat), prefix-cache hits only for LAST pooling."""

from __future__ import annotations

from core_fakes import make_group, make_scheduler

from tessera.config import PreemptionMode
from tessera.core.runner_output import ModelRunnerOutput
from tessera.pooling_params import PoolingParams
from tessera.sequence import SequenceStatus

VECTOR = [0.6, 0.8]


def pooling_group(req_id: str, prompt: list[int], pooling_type: str = "LAST"):
    group = make_group(req_id, len(prompt), prompt=prompt, max_tokens=1)
    group.pooling_params = PoolingParams(pooling_type=pooling_type, normalize=True)
    return group


def run_step(sched):
    """One step of a fake runner: an embedding request whose prompt this step completes gets
    VECTOR; a generation request that reaches its length samples token 1."""
    out = sched.schedule()
    pooled, req_ids = {}, []
    for req_id, n in out.num_scheduled_tokens.items():
        group, seq = sched._live[req_id]
        if seq.num_computed_tokens + n < seq.get_len():
            continue
        if group.pooling_params is not None:
            pooled[req_id] = VECTOR
        else:
            req_ids.append(req_id)
    runner_out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[1] for _ in req_ids],
                                   pooler_output=pooled)
    return out, sched.update_from_output(out, runner_out)


def test_chunked_prefill_only_request_finishes_with_its_prompt_and_frees_everything():
    sched = make_scheduler(chunked=True, max_num_batched_tokens=8, num_gpu_blocks=16)
    group = pooling_group("e", list(range(20)))
    sched.add_seq_group(group)
    chunks = []
    while sched.has_unfinished_seqs():
        out, core = run_step(sched)
        chunks.append(out.num_scheduled_tokens["e"])
        assert out.total_num_scheduled_tokens <= 8
    assert chunks == [8, 8, 4]
    assert [c.pooler_output for c in core] == [VECTOR] and core[0].finished
    assert group.seqs[0].status is SequenceStatus.FINISHED_STOPPED
    assert group.seqs[0].output_token_ids == []  # nothing was sampled
    assert sched.block_manager.get_num_free_gpu_blocks() == 16 and not sched.running
    stats = sched.stats()
    assert stats.num_generation_tokens_total == 0 and stats.num_prompt_tokens_total == 20


def test_no_decode_seat_is_held_beside_generation():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_seq_group(make_group("g", 4, max_tokens=3))
    sched.add_seq_group(pooling_group("e", list(range(6))))
    _, core = run_step(sched)  # both prefill; the embedding ends in the same step
    assert {c.request_id: c.finished for c in core} == {"g": False, "e": True}
    assert [g.request_id for g in sched.running] == ["g"]
    sched.add_seq_group(make_group("h", 4))  # its seat is free at once
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"g", "h"}


def test_prefix_hits_only_for_last_pooling():
    prompt = list(range(100, 117))  # 4 full blocks of 4, and one token more
    for pooling_type, hit in (("LAST", 16), ("MEAN", 0), ("CLS", 0)):
        sched = make_scheduler(prefix=True)
        sched.add_seq_group(make_group("warm", len(prompt), prompt=prompt, max_tokens=1))
        while sched.has_unfinished_seqs():
            run_step(sched)
        sched.add_seq_group(pooling_group("e", prompt, pooling_type))
        out, core = run_step(sched)
        assert out.num_prefix_cache_hit_tokens == hit, pooling_type
        assert out.num_scheduled_tokens["e"] == len(prompt) - hit
        assert core[0].pooler_output == VECTOR


def test_recompute_preemption_starts_the_prompt_again():
    sched = make_scheduler(chunked=True, max_num_batched_tokens=4, num_gpu_blocks=6,
                           max_model_len=24, mode=PreemptionMode.RECOMPUTE)
    sched.add_seq_group(make_group("g", 4, max_tokens=16))
    run_step(sched)
    sched.add_seq_group(pooling_group("e", list(range(16)), "MEAN"))
    preempted, pooled = False, None
    while sched.has_unfinished_seqs():
        out, core = run_step(sched)
        if "e" in out.preempted_request_ids:
            preempted = True
            assert sched._live["e"][1].num_computed_tokens == 0
        pooled = next((c.pooler_output for c in core if c.request_id == "e"), pooled)
    assert preempted and pooled == VECTOR
    assert sched.block_manager.get_num_free_gpu_blocks() == 6
