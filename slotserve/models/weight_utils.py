"""Per-parameter weight loading, as vLLM's and nano-vllm's `packed_modules_mapping` and
`weight_loader` do it.

A model class owns its checkpoint layout: `packed_modules_mapping` names the checkpoint modules
that it fuses (`q_proj` -> (`qkv_proj`, "q")), and a fused module's `weight_loader` knows where
each shard goes. Checkpoint readers (safetensors, GGUF) only deliver `(checkpoint name, tensor)`
pairs in the Hugging Face naming; `load_packed_weights` routes each to its parameter and reports
what is missing by the checkpoint's names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch
from torch import nn

from slotserve.checkpoint.dequant import CheckpointTensor
from slotserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

# checkpoint module name -> (our fused module name, shard id)
PackedMapping = Mapping[str, tuple[str, str | int]]
# A tensor is dequantized (torch) unless the module it goes to keeps it quantized.
NamedTensors = Iterable[tuple[str, CheckpointTensor]]


class LoadableModel(Protocol):
    packed_modules_mapping: PackedMapping

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]: ...
    def get_submodule(self, target: str) -> nn.Module: ...


def default_weight_loader(param: torch.Tensor, loaded: CheckpointTensor, name: str) -> None:
    if not isinstance(loaded, torch.Tensor):
        raise ModelLoadError(f"tensor {name} arrived quantized for a parameter that is not")
    if tuple(loaded.shape) != tuple(param.shape):
        raise ModelLoadError(f"tensor {name} has shape {tuple(loaded.shape)}, expected "
                             f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class ShardedLinear(nn.Linear):
    """A linear layer whose output rows are several checkpoint tensors stacked (q/k/v,
    gate/up): one matmul instead of several. `shards` maps a shard id to (first row, rows)."""

    def __init__(self, in_features: int, shards: dict[str | int, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards: dict[str | int, tuple[int, int]] = {}
        start = 0
        for shard_id, rows in shards.items():
            self.shards[shard_id] = (start, rows)
            start += rows

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor,
                      shard_id: str | int | None, name: str) -> None:
        if shard_id is None:  # not a checkpoint shard (a fused tensor): the whole parameter
            default_weight_loader(param, loaded, name)
            return
        start, rows = self.shards[shard_id]
        default_weight_loader(param[start:start + rows], loaded, name)


def route(name: str, mapping: PackedMapping) -> tuple[str, str | int | None]:
    """A checkpoint tensor name -> (our parameter name, shard id or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        packed = mapping.get(part)
        if packed is not None:
            fused, shard_id = packed
            return ".".join([*parts[:i], fused, *parts[i + 1:]]), shard_id
    return name, None


def checkpoint_names(model: LoadableModel) -> dict[str, list[tuple[str, str | int | None]]]:
    """Our parameter name -> the checkpoint tensors it is loaded from, with their shard ids."""
    sources: dict[str, list[tuple[str, str | int]]] = {}
    for ckpt, (fused, shard_id) in model.packed_modules_mapping.items():
        sources.setdefault(fused, []).append((ckpt, shard_id))
    out: dict[str, list[tuple[str, str | int | None]]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        expanded: list[tuple[str, str | int | None]] = [(name, None)]
        for i, part in enumerate(parts[:-1]):
            if part in sources:
                expanded = [(".".join([*parts[:i], ckpt, *parts[i + 1:]]), shard_id)
                            for ckpt, shard_id in sources[part]]
                break
        out[name] = expanded
    return out


def load_packed_weights(
    model: LoadableModel, weights: NamedTensors, *, source: str,
    skip: Callable[[str], bool] = lambda name: False,
    transform: Callable[[str, CheckpointTensor], CheckpointTensor] = lambda name, tensor: tensor,
) -> None:
    """Load every parameter of `model` from `weights`; `transform(name, tensor)` turns a
    checkpoint tensor into what the parameter holds (Gemma: 1 + w). A ModelLoadError names
    what is missing or misshapen; tensors the model has no parameter for are ignored."""
    params = dict(model.named_parameters())
    expected = checkpoint_names(model)
    pending = {name: {shard for _, shard in parts} for name, parts in expected.items()}
    for ckpt_name, tensor in weights:
        if skip(ckpt_name):
            continue
        target, shard_id = route(ckpt_name, model.packed_modules_mapping)
        param = params.get(target)
        if param is None:
            logger.debug("ignoring unexpected tensor %s in %s", ckpt_name, source)
            continue
        tensor = transform(ckpt_name, tensor)
        # A module with a weight_loader (fused layers, quantized ones) places the tensor itself.
        owner = target.rpartition(".")[0]
        loader = getattr(model.get_submodule(owner), "weight_loader", None) if owner else None
        try:
            if loader is not None:
                loader(param, tensor, shard_id, ckpt_name)
            elif shard_id is None:
                default_weight_loader(param, tensor, ckpt_name)
            else:
                raise ModelLoadError(f"tensor {ckpt_name} is a shard of {target}, whose module "
                                     "has no weight_loader")
        except ModelLoadError as exc:
            raise ModelLoadError(f"{source}: {exc}") from exc
        pending[target].discard(shard_id)
    missing = [ckpt for name, shards in pending.items() for ckpt, shard in expected[name]
               if shard in shards]
    if missing:
        raise ModelLoadError(f"weights missing from {source}: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
