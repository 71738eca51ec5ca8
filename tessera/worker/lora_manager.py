"""The worker's LoRA adapters: read from disk into a CPU cache, made ready for the model when a
step needs them, and described to the model as row segments of the step's flat batch.

    disk (PEFT dir) --load_adapter--> CPU cache: float32 A/B as stored, LRU, --max-cpu-loras
                    --LoRABank.write--> active: a slot of the bank (stacked per projection,
                                        TP-sharded, scaled, on the device); LRU, --max-loras
                                        slots (the scheduler never puts more distinct adapters
                                        in one step)

The step's `LoRAMapping` (segments of rows by slot, and their int64 table for the kernel) is
built here once per step; every layer of the model reuses it.

Each rank of a tensor-parallel group runs its own manager from the same `LoRARequest`s (they
travel in `NewRequestData`), so no weights cross processes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from tessera.config import LoRAConfig
from tessera.lora.mapping import LoRAMapping, row_segments
from tessera.lora.peft import LoRAAdapter, load_adapter
from tessera.lora.request import LoRARequest
from tessera.model.lora_layers import LoRABank, LoRAWeights, attach_lora

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model, config: LoRAConfig) -> None:
        attach_lora(model)
        self.config = config
        self.arch = model.cfg
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.device
        tp = getattr(model, "tp", None)
        self.plan = None if tp is None else tp.plan
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by lora_int_id, LRU first
        self.bank = LoRABank(self.arch, config.max_loras, config.max_lora_rank, self.dtype,
                             self.device, self.plan)
        self._active: OrderedDict[int, LoRAWeights] = OrderedDict()  # by lora_int_id, LRU first
        self.num_loads = 0  # adapters read from disk (tests and benchmarks read it)

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        lid = request.lora_int_id
        adapter = self._cpu.get(lid)
        if adapter is None:
            adapter = load_adapter(request.lora_path, self.arch, self.config.max_lora_rank)
            self.num_loads += 1
            logger.info("LoRA adapter %s (id %d) loaded from %s", request.lora_name, lid,
                        request.lora_path)
            self._cpu[lid] = adapter
            while len(self._cpu) > self.config.num_cpu_loras:
                self._cpu.popitem(last=False)
        self._cpu.move_to_end(lid)
        return adapter

    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, LoRAWeights]:
        """The device weights of this step's adapters (by lora_int_id), loading what is missing
        and evicting the least recently used others beyond --max-loras."""
        assert len(requests) <= self.config.max_loras, (
            f"{len(requests)} adapters in one step, more than --max-loras")
        for lid in requests:  # the step's adapters are the most recently used: never evicted
            if lid in self._active:
                self._active.move_to_end(lid)
                if lid in self._cpu:
                    self._cpu.move_to_end(lid)
        for lid, request in requests.items():
            if lid in self._active:
                continue
            adapter = self._adapter(request)
            free = set(range(self.config.max_loras)) - {w.slot for w in self._active.values()}
            if free:
                slot = min(free)
            else:  # the least recently used adapter not in this step gives up its slot
                victim = next(v for v in self._active if v not in requests)
                slot = self._active.pop(victim).slot
            self._active[lid] = LoRAWeights(lid, slot, self.bank.write(slot, adapter))
        return {lid: self._active[lid] for lid in requests}

    def mapping(self, runs: list[tuple[int, int]],
                requests: dict[int, LoRARequest]) -> LoRAMapping | None:
        """The step's mapping from its (adapter id, number of rows) runs in flat-batch order
        (one per request); None when every row runs the base model."""
        if not requests:
            return None
        weights = self.activate(requests)
        segments = [(a, b, weights[lid].slot) for a, b, lid in row_segments(runs)]
        table = torch.tensor(segments, dtype=torch.long).view(-1, 3)  # [S, 3], host
        return LoRAMapping(segments, table, self.bank)
