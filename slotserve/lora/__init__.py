"""Many LoRA adapters on one base model (issue 19); see docs/LORA.md.

`request` (the user's record and the engine's settings) imports no torch: the scheduler's
adapter-slot ledger (core/lora_slots.py) and the front use it. `adapters` reads PEFT folders,
`layers` applies a step's adapters to the batch (torch, worker side).
"""

from slotserve.lora.request import LoRAAdapterError, LoRAConfig, LoRARequest

__all__ = ["LoRAAdapterError", "LoRAConfig", "LoRARequest"]
