"""PEFT adapter folders read and checked without torch (the front checks requests with it).

A folder holds adapter_config.json (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern,
target_modules) and adapter_model.safetensors with `...layers.{i}.{self_attn|mlp}.{module}
.lora_A.weight` [r, in] and `lora_B.weight` [out, r]. Shapes and dtypes come from the
safetensors header (`safe_open(framework="numpy")` reads no tensor), so checking an adapter
costs no torch import and no weight read; the worker reads the tensors (adapters.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from slotserve.lora.gguf_adapter import read_gguf_halves
from slotserve.lora.request import LoRAAdapterError, LoRARequest
from slotserve.model_config import ModelConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)((?:[\w.]*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))"
                  r"\.lora_([AB])\.weight$")
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of every module an adapter may target."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    """One targeted module: its tensors' names, its rank and its scaling (alpha / r)."""

    layer: int
    module: str
    rank: int
    scaling: float
    a_key: str
    b_key: str


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter: where its weights are and what they are; `rank` is the largest."""

    lora_request: LoRARequest
    weights_file: Path
    rank: int
    modules: tuple[ModuleSpec, ...]
    format: str = "peft"  # or "gguf": llama.cpp's adapter file (gguf_adapter.py)


def pattern_key(patterns: dict[str, Any], name: str) -> str | None:
    """The rank_pattern / alpha_pattern key that applies to module `name`, as PEFT matches
    them: a key matches a name that ends with it at a dot boundary (keys may be regexes)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def _number(meta: dict[str, Any], key: str, default: Any, fail: Any) -> Any:
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(f"adapter_config.json: {key} must be a number, got {value!r}")
    return value


def read_adapter_spec(req: LoRARequest, cfg: ModelConfig, max_rank: int) -> AdapterSpec:
    """Check a PEFT folder against the base model (config and header only); a
    LoRAAdapterError naming the adapter and the field says what does not fit."""
    name = req.lora_name
    folder = Path(req.lora_path).expanduser()

    def fail(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r} ({folder}): {why}")

    if folder.suffix == ".gguf":
        return _read_gguf_spec(req, cfg, max_rank, fail, folder)
    weights_file = folder / "adapter_model.safetensors"
    try:
        meta = json.loads((folder / "adapter_config.json").read_text())
        with safe_open(str(weights_file), framework="numpy") as f:
            header = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype())
                      for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise fail(f"cannot read it: {exc}") from exc
    except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
        raise fail(f"cannot read {weights_file.name}: {exc}") from exc
    if not isinstance(meta, dict):
        raise fail("adapter_config.json is not an object")
    base_rank = meta.get("r")
    if isinstance(base_rank, bool) or not isinstance(base_rank, int) or base_rank < 1:
        raise fail(f"adapter_config.json: r must be an integer >= 1, got {base_rank!r}")
    base_alpha = _number(meta, "lora_alpha", base_rank, fail)
    patterns: dict[str, dict[str, Any]] = {}
    for key in ("rank_pattern", "alpha_pattern"):
        value = meta.get(key) or {}
        if not isinstance(value, dict):
            raise fail(f"adapter_config.json: {key} must be an object")
        patterns[key] = value
    if meta.get("modules_to_save"):
        raise fail("modules_to_save (fully trained modules) is not supported")
    if meta.get("bias", "none") != "none":
        raise fail(f"bias={meta['bias']!r} is not supported (only 'none')")
    if meta.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out is not supported")
    rslora = bool(meta.get("use_rslora"))
    shapes = module_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, str]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key, (shape, dtype) in header.items():
        m = _KEY.search(key)
        if m is None:
            raise fail(f"unexpected tensor {key!r}")
        path, layer, module, half = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        path = path.removeprefix("base_model.model.")  # the name PEFT matches patterns on
        if module not in shapes:
            raise fail(f"targets {module!r}, which the model lacks (it has "
                       f"{', '.join(TARGET_MODULES)})")
        if layer >= cfg.num_hidden_layers:
            raise fail(f"targets layer {layer}; the model has {cfg.num_hidden_layers}")
        if dtype not in _FLOAT_DTYPES or len(shape) != 2:
            raise fail(f"{key}: a 2-D float tensor expected, got {dtype} {list(shape)}")
        halves.setdefault((layer, module), {})[half] = key
        paths[(layer, module)] = path
    modules: list[ModuleSpec] = []
    for (layer, module), ab in sorted(halves.items()):
        where = f"layer {layer} {module}"
        if "A" not in ab or "B" not in ab:
            raise fail(f"{where} lacks lora_{'A' if 'A' not in ab else 'B'}")
        r_key = pattern_key(patterns["rank_pattern"], paths[(layer, module)])
        a_key = pattern_key(patterns["alpha_pattern"], paths[(layer, module)])
        rank = patterns["rank_pattern"][r_key] if r_key is not None else base_rank
        alpha = patterns["alpha_pattern"][a_key] if a_key is not None else base_alpha
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise fail(f"rank_pattern[{r_key!r}] must be an integer >= 1, got {rank!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise fail(f"alpha_pattern[{a_key!r}] must be a number, got {alpha!r}")
        origin = f" (rank_pattern[{r_key!r}])" if r_key is not None else ""
        _check_fit(fail, shapes, max_rank, where, module, rank,
                   (tuple(header[ab["A"]][0]), tuple(header[ab["B"]][0])), origin)
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        modules.append(ModuleSpec(layer, module, rank, scaling, ab["A"], ab["B"]))
    if not modules:
        raise fail("it holds no LoRA weights")
    return AdapterSpec(req, weights_file, max(m.rank for m in modules), tuple(modules))


def _check_fit(fail: Callable[[str], LoRAAdapterError], shapes: dict[str, tuple[int, int]],
               max_rank: int, where: str, module: str, rank: int,
               ab_shapes: tuple[tuple[int, ...], tuple[int, ...]], origin: str = "") -> None:
    if rank > max_rank:
        raise fail(f"rank {rank} exceeds max_lora_rank={max_rank} ({where})")
    n_in, n_out = shapes[module]
    a_shape, b_shape = ab_shapes
    if a_shape != (rank, n_in) or b_shape != (n_out, rank):
        raise fail(f"{where}: A {a_shape} and B {b_shape} do not fit the base "
                   f"({n_out} x {n_in}) at rank {rank}{origin}")


def _read_gguf_spec(req: LoRARequest, cfg: ModelConfig, max_rank: int,
                    fail: Callable[[str], LoRAAdapterError], path: Path) -> AdapterSpec:
    """llama.cpp's scale: alpha / rank, or 1 when the file's alpha is 0 or absent."""
    alpha, halves = read_gguf_halves(path, cfg, fail)
    shapes = module_shapes(cfg)
    modules: list[ModuleSpec] = []
    for (layer, module), ab in sorted(halves.items()):
        where = f"layer {layer} {module}"
        if layer >= cfg.num_hidden_layers:
            raise fail(f"targets layer {layer}; the model has {cfg.num_hidden_layers}")
        if "A" not in ab or "B" not in ab:
            raise fail(f"{where} lacks lora_{'a' if 'A' not in ab else 'b'}")
        rank = ab["A"][1][0] if len(ab["A"][1]) == 2 else 0
        _check_fit(fail, shapes, max_rank, where, module, rank, (ab["A"][1], ab["B"][1]))
        modules.append(ModuleSpec(layer, module, rank, alpha / rank if alpha else 1.0,
                                  ab["A"][0], ab["B"][0]))
    if not modules:
        raise fail("it holds no LoRA weights")
    return AdapterSpec(req, path, max(m.rank for m in modules), tuple(modules), "gguf")


class AdapterChecker:
    """The front's check of a request's adapter: read once per adapter, and one id never
    names two adapters (the engine keys slots and prefix-cache hashes by the id)."""

    def __init__(self, cfg: ModelConfig, max_rank: int) -> None:
        self.cfg, self.max_rank = cfg, max_rank
        self.checked: dict[int, LoRARequest] = {}

    def __call__(self, req: LoRARequest) -> None:
        known = self.checked.get(req.lora_int_id)
        if known == req:
            return
        if known is not None:
            raise LoRAAdapterError(f"lora_int_id {req.lora_int_id} already names adapter "
                                   f"{known.lora_name!r} ({known.lora_path})")
        read_adapter_spec(req, self.cfg, self.max_rank)
        self.checked[req.lora_int_id] = req
