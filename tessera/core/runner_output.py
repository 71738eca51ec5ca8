"""What the model runner hands back after a step: plain lists keyed by `req_id`, no tensors.

Torch-free on purpose: it crosses process boundaries (tensor-parallel rank 0 to the driver) and the
scheduler's `update_from_output` reads it without importing torch.

`sampled_token_ids[i]` holds the tokens request `req_ids[i]` produced this step, in order:
usually one; several when draft tokens were accepted (speculative decoding); and, when the prompt
of a request with n > 1 completes, its n first tokens (the first for itself, one per child the
scheduler forks). A request that computed a prompt chunk and sampled nothing has an empty list.
An embedding request never samples: the step that completes its prompt puts its pooled vector in
`pooler_output` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVTransferStats:
    """What the KV connector's worker half moved since the last step (deltas, summed by the
    scheduler into the kv_transfer_* counters)."""

    num_requests: int = 0  # transfers completed (sent by a producer, received by a consumer)
    num_bytes: int = 0
    num_failures: int = 0  # pulls that failed or timed out (the request then prefills locally)
    transfer_seconds: list[float] = field(default_factory=list)  # one per completed transfer


@dataclass
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # per sampled token: {token_id: logprob} of the raw model distribution: the chosen token and,
    # when the request asked for `logprobs`, the top alternatives
    logprobs: list[list[dict[int, float]]] = field(default_factory=list)
    # req_id -> (position of the first scored prompt token, {token_id: logprob} per position)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # speculative decoding: per row of `req_ids`, the draft tokens proposed to follow the tokens
    # sampled this step (verified next step); empty when speculation is off
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # KV connector (disaggregated prefill/decode): requests whose blocks the worker has read out
    # for the peer (the producer frees them), whose remote KV landed in their blocks (the
    # consumer decodes them), or whose pull failed (the consumer prefills them locally)
    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_recving: list[str] = field(default_factory=list)
    kv_transfer_stats: KVTransferStats | None = None
    # embedding requests whose prompt completed this step: req_id -> the pooled vector (floats,
    # normalized if asked); such a request has no row in `req_ids` (it samples nothing)
    pooler_output: dict[str, list[float]] = field(default_factory=dict)

    @property
    def req_id_to_index(self) -> dict[str, int]:
        """Row of each request in the lists above (vLLM's name)."""
        return {req_id: i for i, req_id in enumerate(self.req_ids)}
