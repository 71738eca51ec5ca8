"""Disaggregated prefill/decode's config (`--kv-transfer-config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.config.common import config_dict

KV_CONNECTORS = ("TcpConnector", "NixlConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KV_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config")
_KV_EXTRA_KEYS = ("transfer_timeout", "hold_timeout")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill/decode (vLLM's names): a `kv_producer` prefills and serves each
    finished request's KV blocks on `kv_ip:kv_port`; a `kv_consumer` pulls them from the address
    the producer's response named (`kv_transfer_params`), so it needs no address of its own;
    `kv_both` does either per request. `kv_connector_extra_config`: `transfer_timeout` (seconds a
    consumer waits for one pull before it prefills locally) and `hold_timeout` (seconds a
    producer keeps a finished request's blocks for a peer that never comes)."""

    kv_connector: str = "TcpConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector must be one of "
                             f"{', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config: kv_ip must be a host name or address, "
                             f"got {self.kv_ip!r}")
        port = self.kv_port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"kv_transfer_config: kv_port must be an integer in [0, 65535], "
                             f"got {port!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
        unknown = sorted(set(extra) - set(_KV_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config: unknown key(s) "
                             f"{', '.join(unknown)}; known: {', '.join(_KV_EXTRA_KEYS)}")
        for key in _KV_EXTRA_KEYS:
            value = extra.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not value > 0):
                raise ValueError(f"kv_transfer_config: kv_connector_extra_config.{key} must be a "
                                 f"number of seconds > 0, got {value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transfer_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("transfer_timeout", 30.0))

    @property
    def hold_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("hold_timeout", 120.0))

    @classmethod
    def from_dict(cls, value: dict | str | KVTransferConfig | None) -> KVTransferConfig | None:
        """From `LLM(kv_transfer_config={...})` or the JSON of `--kv-transfer-config`."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = config_dict(value, "kv_transfer_config", _KV_KEYS)
        for key in ("kv_connector", "kv_role"):
            if key not in value:
                raise ValueError(f"kv_transfer_config: {key} is required")
        return cls(**value)
