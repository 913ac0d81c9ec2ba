"""Tiny random Llama and Qwen3 checkpoints with three random PEFT adapters each (peft writes
them, init_lora_weights=False so they change the tokens), and transformers + PEFT with each
adapter merged as the reference."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slotserve.lora import LoRARequest
from tests.tiny_models import build_tiny, hf_greedy

# (r, lora_alpha, use_rslora, target modules): every target, rsLoRA, partial targets.
ADAPTERS = [
    (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj"]),
    (4, 8, True, ["q_proj", "v_proj", "down_proj"]),
    (16, 24, False, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
]


@dataclass
class LoRASetup:
    path: str
    loras: list[LoRARequest]
    models: list[Any]  # the base, then each adapter merged into a copy of it

    def reference(self, prompt: list[int], lora: LoRARequest | None, n: int) -> list[int]:
        model = self.models[0 if lora is None else lora.lora_int_id]
        return hf_greedy(model, prompt, n)[0]


def write_adapters(hf: Any, root: Path, seed: int) -> tuple[list[LoRARequest], list[Any]]:
    import torch
    from peft import LoraConfig, get_peft_model

    loras, merged = [], []
    for i, (r, alpha, rslora, targets) in enumerate(ADAPTERS, start=1):
        torch.manual_seed(seed * 10 + i)
        peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(
            r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
            init_lora_weights=False))
        with torch.no_grad():  # B's default random init is too small to move greedy tokens
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(40.0 / r)
        folder = root / f"adapter{i}"
        peft_model.save_pretrained(folder)
        loras.append(LoRARequest(f"adapter{i}", i, str(folder)))
        merged.append(peft_model.merge_and_unload().eval())
    return loras, merged


def build_setup(name: str, root: Path, tokenizer: Any, seed: int) -> LoRASetup:
    tiny = build_tiny(name, root / "base", seed=seed, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(root / "base")
    loras, merged = write_adapters(tiny.hf, root, seed)
    return LoRASetup(str(tiny.path), loras, [tiny.hf, *merged])


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def lora_setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               tokenizer: Any) -> LoRASetup:
    return build_setup(request.param, tmp_path_factory.mktemp(f"lora_{request.param}"),
                       tokenizer, seed=3)
