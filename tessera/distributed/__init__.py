"""Engines that work together across processes or machines: KV transfer between a prefill and a
decode engine (kv_transfer/)."""
