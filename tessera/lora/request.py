"""`LoRARequest`: which adapter a request runs under, vLLM's `vllm.lora.request.LoRARequest`.

Plain, frozen and picklable: it travels from the front end through the scheduler (which limits the
distinct adapters of a step by `lora_int_id` and salts prefix-cache keys with it) to every
tensor-parallel rank, each of which loads the adapter from `lora_path` into its own cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: `lora_name` (what clients send as `model`), `lora_int_id` (>= 1, unique per
    adapter: the scheduler and the caches key on it; 0 means the base model), `lora_path` (a
    directory in PEFT's format: adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got "
                             f"{self.lora_path!r}")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
