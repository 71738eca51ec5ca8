"""LoRA adapters served over one base model (vLLM's names): `LoRARequest(name, int_id, path)`
names an adapter for a request; `tessera.lora.peft` reads and checks PEFT's format on disk.

Kept torch-free at import: `tessera.core` carries `LoRARequest`s, and the heavier modules
(`peft`, the batched layers in tessera/model/lora_layers.py, the worker's cache in
tessera/worker/lora_manager.py) are imported where they are used.
"""

from tessera.lora.request import LoRARequest

__all__ = ["LoRARequest"]
