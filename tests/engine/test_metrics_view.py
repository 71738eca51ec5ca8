"""engine_metrics: the flat metric names and values of one scheduler snapshot, without an engine."""

from __future__ import annotations

import dataclasses

from tessera.config.lora import LoRAConfig
from tessera.config.speculative import SpeculativeConfig
from tessera.core.scheduler_stats import SchedulerDetail, SchedulerStats
from tessera.engine.metrics_view import engine_metrics

STATS = SchedulerStats(
    num_waiting=2, num_running=3, num_swapped=1, num_waiting_for_remote_kvs=0,
    num_gpu_blocks=100, num_free_gpu_blocks=75, num_cpu_blocks=0, num_free_cpu_blocks=0,
    num_preemptions_total=4, num_prompt_tokens_total=500, num_generation_tokens_total=60,
    num_prefix_cache_queries_total=200, num_prefix_cache_hits_total=48,
    num_spec_drafts_total=5, num_spec_draft_tokens_total=20, num_spec_accepted_tokens_total=9,
    num_spec_accepted_tokens_per_pos=(5, 3, 1), kv_transfer=False,
    num_kv_transfer_requests_total=0, num_kv_transfer_bytes_total=0,
    num_kv_transfer_failures_total=0,
)


def test_the_always_present_gauges_and_counters():
    m = engine_metrics(STATS, None, None)
    assert m["tessera:num_requests_running"] == 3.0
    assert m["tessera:num_requests_waiting"] == 2.0
    assert m["tessera:num_requests_swapped"] == 1.0
    assert m["tessera:kv_cache_usage_perc"] == 0.25
    assert m["tessera:cpu_cache_usage_perc"] == 0.0  # no swap space: not a division by zero
    assert m["tessera:num_preemptions_total"] == 4.0
    assert m["tessera:prefix_cache_hits_total"] == m["tessera:prompt_tokens_cached_total"] == 48.0
    assert not any("spec_decode" in k or "kv_transfer" in k or "lora" in k for k in m)


def test_speculative_counters_per_draft_position():
    m = engine_metrics(STATS, None, SpeculativeConfig(num_speculative_tokens=4))
    assert m["tessera:spec_decode_num_drafts_total"] == 5.0
    assert m["tessera:spec_decode_num_accepted_tokens_total"] == 9.0
    per_pos = [m[f'tessera:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
               for i in range(4)]
    assert per_pos == [5.0, 3.0, 1.0, 0.0]  # a position no draft reached yet reads 0


def test_kv_transfer_counters_only_with_a_connector():
    m = engine_metrics(dataclasses.replace(STATS, kv_transfer=True, num_waiting_for_remote_kvs=2,
                                           num_kv_transfer_bytes_total=4096), None, None)
    assert m["tessera:kv_transfer_bytes_total"] == 4096.0
    assert m["tessera:num_requests_waiting_for_remote_kvs"] == 2.0


def test_lora_info_gauge_labels_escape_adapter_names():
    detail = SchedulerDetail(
        gpu_block_states=b"", cpu_block_states=b"", oldest_waiting_arrival=None,
        oldest_swapped_arrival=None, requests=(), running_lora_adapters=("a", 'b"x'),
        waiting_lora_adapters=())
    m = engine_metrics(dataclasses.replace(STATS, detail=detail), LoRAConfig(max_loras=2), None)
    (key,) = [k for k in m if k.startswith("tessera:lora_requests_info")]
    assert key == ('tessera:lora_requests_info{max_lora="2",running_lora_adapters="a,b\\"x",'
                   'waiting_lora_adapters=""}')
    assert m[key] > 0  # the value is the time of the sample
