"""What the model runner hands back after a step: plain lists keyed by `req_id`, no tensors.

Torch-free on purpose: it crosses process boundaries (tensor-parallel rank 0 to the driver) and the
scheduler's `update_from_output` reads it without importing torch.

`sampled_token_ids[i]` holds the tokens request `req_ids[i]` produced this step, in order:
usually one; several when draft tokens were accepted (speculative decoding); and, when the prompt
of a request with n > 1 completes, its n first tokens (the first for itself, one per child the
scheduler forks). A request that computed a prompt chunk and sampled nothing has an empty list.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def req_id_to_index(self) -> dict[str, int]:
        """Row of each request in the lists above (vLLM's name)."""
        return {req_id: i for i, req_id in enumerate(self.req_ids)}
