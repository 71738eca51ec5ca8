"""The engine's check of the `LoRARequest`s it is given: LoRA is on (--enable-lora), one int id
names one adapter, and the adapter on disk is one the engine can serve over this base model
(tessera/lora/peft.py: targets, rank, shapes), refused with a ValueError naming the field before
the request is queued. A checked adapter is remembered, so a request pays the check once per
adapter, not once per request."""

from __future__ import annotations

import threading

from tessera.config import LoRAConfig
from tessera.lora.peft import PeftLoRAConfig, check_adapter
from tessera.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, arch) -> None:
        self.config = config
        self.arch = arch
        self._checked: dict[LoRARequest, PeftLoRAConfig] = {}
        self._by_id: dict[int, LoRARequest] = {}
        self._lock = threading.Lock()  # the server checks off the engine thread too

    def check_path(self, path: str) -> PeftLoRAConfig:
        """Whether the adapter at `path` can be served (ValueError naming the field), without
        registering an id for it."""
        if self.config is None:
            raise ValueError("LoRA adapters need --enable-lora (LLM(enable_lora=True))")
        assert self.arch is not None, "the engine was built without the model's shapes"
        return check_adapter(path, self.arch, self.config.max_lora_rank)

    def check(self, request: LoRARequest) -> PeftLoRAConfig:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if self.config is None:
            raise ValueError("lora_request: LoRA adapters need --enable-lora "
                             "(LLM(enable_lora=True))")
        with self._lock:
            known = self._checked.get(request)
            other = self._by_id.get(request.lora_int_id)
        if known is not None:
            return known
        if other is not None and other.lora_path != request.lora_path:
            raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter "
                             f"{other.lora_name!r} at {other.lora_path}; give each adapter its "
                             "own id")
        peft = self.check_path(request.lora_path)
        with self._lock:
            self._checked[request] = peft
            self._by_id.setdefault(request.lora_int_id, request)
        return peft
