"""Multi-LoRA's config (`--enable-lora`, `--max-loras`, `--max-lora-rank`)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config.common import flag_name


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names; on with --enable-lora): at most `max_loras` distinct
    adapters in one step (the scheduler's limit), ranks up to `max_lora_rank`, and up to
    `max_cpu_loras` adapters kept loaded in the CPU cache (LRU; default: max_loras)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag_name(name)} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"--max-cpu-loras ({cpu}) must be an integer >= --max-loras "
                             f"({self.max_loras}): every adapter of a step is loaded")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
