"""`LoRARequest` (vLLM's fields) and the engine's LoRA settings; no torch here."""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.errors import ConfigError


class LoRAAdapterError(ConfigError):
    """An adapter cannot be used with this model (its rank, its target modules, its shapes,
    its files); the message names the adapter."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """One adapter: a PEFT folder. `lora_int_id` (>= 1) identifies it everywhere inside the
    engine (slot ledger, prefix-cache hashes); `lora_name` is what clients call it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAAdapterError(f"adapter {self.lora_name!r}: lora_int_id must be an "
                                   f"integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise LoRAAdapterError("lora_name must be a non-empty string")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """max_loras: worker slots (distinct adapters in one step); max_lora_rank: every slot's
    rank; max_cpu_loras: adapters kept read in host memory (an LRU cache)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError("max_loras must be >= 1")
        if self.max_lora_rank < 1:
            raise ConfigError("max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras={self.max_cpu_loras} must be >= "
                              f"max_loras={self.max_loras}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


def parse_lora_modules(specs: list[str] | tuple[str, ...] | None) -> list[LoRARequest]:
    """`--lora-modules name=path ...` -> LoRARequests with ids 1, 2, ... in order."""
    out: list[LoRARequest] = []
    for i, spec in enumerate(specs or (), start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules takes name=path, got {spec!r}")
        if any(r.lora_name == name for r in out):
            raise ConfigError(f"--lora-modules names {name!r} twice")
        out.append(LoRARequest(name, i, path))
    return out
