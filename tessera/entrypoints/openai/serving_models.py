"""The names the server answers to: its base model and, with --enable-lora, LoRA adapters
(vLLM's `OpenAIServingModels`). A request's `model` picks one: the base name (or none) runs the
base model, an adapter's name runs that adapter, anything else is a 404.

Adapters come from `--lora-modules name=path ...` (or JSON `{"name", "path", "base_model_name"}`)
at start-up, and, with --allow-runtime-lora-updating, from POST /v1/load_lora_adapter and
/v1/unload_lora_adapter while serving. Each name gets a fresh `lora_int_id` (never reused: the
scheduler, the prefix cache and the workers' caches key on it). An adapter is checked before its
name is registered (tessera/engine/lora_registry.py), so a bad path is a 400 at load and the
server keeps serving; requests already running under an unloaded adapter finish under it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from tessera.entrypoints.openai.errors import OpenAIError, bad_request
from tessera.entrypoints.openai.protocol import ModelCard
from tessera.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """`name=path`, or JSON `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's
    forms); ValueError naming what is wrong."""
    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {value!r} is not valid JSON: {e}") from None
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules: {value!r} must be a JSON object with string "
                             "'name' and 'path' (and optionally 'base_model_name')")
        return LoRAModulePath(obj["name"], obj["path"], obj.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {value!r} must be name=path or a JSON object")
    return LoRAModulePath(name, path)


class ServingModels:
    def __init__(self, engine, base_model_name: str, max_model_len: int | None = None) -> None:
        self.engine = engine  # AsyncLLMEngine: checks adapters off the event loop
        self.base_model_name = base_model_name
        self.max_model_len = max_model_len
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.base_model_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is not None:
            return adapter
        names = ", ".join(repr(n) for n in [self.base_model_name, *self.adapters])
        raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {names}",
                          param="model", code="model_not_found")

    def _new_request(self, name: str, path: str, base: str | None = None) -> LoRARequest:
        if name == self.base_model_name or name in self.adapters:
            raise bad_request(f"lora_name: the name {name!r} is already served; unload it "
                              "first or choose another", "lora_name")
        try:
            return LoRARequest(name, next(self._ids), path, base)
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None

    def add_static(self, modules: list[LoRAModulePath]) -> None:
        """--lora-modules at start-up (before serving): a bad one is a ValueError."""
        for m in modules:
            if m.name == self.base_model_name or m.name in self.adapters:
                raise ValueError(f"--lora-modules: the name {m.name!r} is given twice")
            request = LoRARequest(m.name, next(self._ids), m.path, m.base_model_name)
            self.engine.check_lora_sync(request)
            self.adapters[m.name] = request

    async def load(self, name: str, path: str) -> str:
        request = self._new_request(name, path)
        try:
            await self.engine.check_lora(request)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from None
        if name in self.adapters:  # loaded meanwhile by a concurrent call
            raise bad_request(f"lora_name: the name {name!r} is already served", "lora_name")
        self.adapters[name] = request
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        if self.adapters.pop(name, None) is None:
            raise OpenAIError(404, f"the LoRA adapter {name!r} cannot be found",
                              param="lora_name", code="model_not_found")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self) -> list[ModelCard]:
        base = ModelCard(id=self.base_model_name, root=self.base_model_name,
                         max_model_len=self.max_model_len)
        return [base, *(ModelCard(id=a.lora_name, root=a.lora_path,
                                  parent=a.base_model_name or self.base_model_name,
                                  max_model_len=self.max_model_len)
                        for a in self.adapters.values())]
