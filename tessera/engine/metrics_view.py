"""The engine's flat `{name: value}` metrics (`LLMEngine.get_metrics()`) from one scheduler stats
snapshot: the Prometheus names `/metrics` serves (tessera/engine/metrics.py re-publishes them),
vLLM's where vLLM has one. A labelled sample is keyed `name{label="value"}`, as Prometheus prints
it. A pure function of its inputs, so the names are tested without an engine."""

from __future__ import annotations

import time

from tessera.config.lora import LoRAConfig
from tessera.config.speculative import SpeculativeConfig
from tessera.core.scheduler_stats import SchedulerStats


def engine_metrics(s: SchedulerStats, lora: LoRAConfig | None,
                   spec: SpeculativeConfig | None) -> dict[str, float]:
    """`s` taken with detail=True when `lora` is set (the adapters in use label the info gauge)."""
    metrics = {
        "tessera:num_requests_running": float(s.num_running),
        "tessera:num_requests_waiting": float(s.num_waiting),
        "tessera:num_requests_swapped": float(s.num_swapped),
        "tessera:kv_cache_usage_perc": float(s.gpu_usage),
        "tessera:cpu_cache_usage_perc": float(s.cpu_usage),
        "tessera:num_preemptions_total": float(s.num_preemptions_total),
        "tessera:prompt_tokens_total": float(s.num_prompt_tokens_total),
        "tessera:generation_tokens_total": float(s.num_generation_tokens_total),
        "tessera:prefix_cache_hits_total": float(s.num_prefix_cache_hits_total),
        "tessera:prefix_cache_queries_total": float(s.num_prefix_cache_queries_total),
        "tessera:prompt_tokens_cached_total": float(s.num_prefix_cache_hits_total),
    }
    if s.kv_transfer:  # disaggregated prefill/decode
        metrics["tessera:kv_transfer_requests_total"] = float(s.num_kv_transfer_requests_total)
        metrics["tessera:kv_transfer_bytes_total"] = float(s.num_kv_transfer_bytes_total)
        metrics["tessera:kv_transfer_failures_total"] = float(s.num_kv_transfer_failures_total)
        metrics["tessera:num_requests_waiting_for_remote_kvs"] = float(
            s.num_waiting_for_remote_kvs
        )
    if lora is not None and s.detail is not None:  # vLLM's info gauge: the labels say
        running = _label(s.detail.running_lora_adapters)
        waiting = _label(s.detail.waiting_lora_adapters)
        metrics[
            f'tessera:lora_requests_info{{max_lora="{lora.max_loras}",'
            f'running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}}'
        ] = time.time()  # ... and the value is the time
    if spec is not None:  # vLLM's names; accepted per draft position as a labelled counter
        metrics["tessera:spec_decode_num_drafts_total"] = float(s.num_spec_drafts_total)
        metrics["tessera:spec_decode_num_draft_tokens_total"] = float(
            s.num_spec_draft_tokens_total
        )
        metrics["tessera:spec_decode_num_accepted_tokens_total"] = float(
            s.num_spec_accepted_tokens_total
        )
        per_pos = s.num_spec_accepted_tokens_per_pos
        for pos in range(spec.num_speculative_tokens):
            metrics[
                f'tessera:spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}'
            ] = float(per_pos[pos]) if pos < len(per_pos) else 0.0
    return metrics


def _label(names: tuple[str, ...]) -> str:
    """Adapter names as one Prometheus label value, comma-separated (vLLM's format)."""
    return ",".join(names).replace("\\", "\\\\").replace('"', '\\"')
