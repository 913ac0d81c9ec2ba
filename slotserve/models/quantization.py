"""Weights kept in their GGUF block format (`--quantization auto|exact`), run by the native kernel.

`auto` multiplies them with activations quantized to 8 bits, llama.cpp's scheme; `exact` with
float32 activations (native_qmatmul explains both). Either keeps every linear layer and embedding whose checkpoint tensors all have a native kernel
(`native_qmatmul.KERNEL_TYPES`) in the file's blocks: the module is swapped, before loading,
for `QuantizedLinear` / `QuantizedEmbedding`, which hold the blocks (uint8 buffers, one per
shard: a fused q/k/v may mix types, as Gemma 3's files do) and route the checkpoint tensors
into them through the same `weight_loader` protocol as every fused layer. Everything else is
dequantized once at load (`checkpoint.dequant.materialize`), as `none` does for everything.
Only where the kernel runs float32 models on the CPU: on CUDA, in bfloat16/float16, or
without a C compiler, `auto` and `exact` dequantize (logged), because torch's kernels for grouped
low-bit weights take bfloat16 activations and scales there, which changes the numbers beyond
the format.

A tied embedding serves as the output projection too (`QuantizedEmbedding.project`): Gemma 3's
262k x 640 Q8_0 table is read as 178 MB of blocks per step instead of 671 MB of float32.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slotserve.checkpoint.dequant import (
    CheckpointTensor,
    copy_blocks,
    gguf_type,
    map_blocks,
)
from slotserve.checkpoint.gguf_file import drop_pages
from slotserve.config import QuantizationMode
from slotserve.errors import ModelLoadError
from slotserve.models.native_qmatmul import (
    KERNEL_TYPES,
    QuantWeight,
    block_layout,
    kernel_isa,
    qmatmul_available,
)
from slotserve.models.native_qmatmul_plan import QMatmulPlan
from slotserve.models.qmatmul_lib import MAX_WEIGHTS_PER_CALL
from slotserve.models.weight_utils import ShardedLinear, checkpoint_names, default_weight_loader

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class QuantShard:
    """Output rows [start, start + rows) of a layer, held as `qtype` blocks."""

    shard_id: str | int | None
    start: int
    rows: int
    qtype: int


@dataclass(frozen=True, slots=True)
class QuantSegment:
    """Adjacent shards of one type, held in one block buffer: one kernel call for all of
    them (Gemma 3's gate and up; q and k, and v too where it has their type)."""

    start: int
    rows: int
    qtype: int


def _segments(shards: list[QuantShard]) -> list[QuantSegment]:
    out: list[QuantSegment] = []
    for s in shards:
        last = out[-1] if out else None
        if last is not None and last.qtype == s.qtype and last.start + last.rows == s.start:
            out[-1] = QuantSegment(last.start, last.rows + s.rows, s.qtype)
        else:
            out.append(QuantSegment(s.start, s.rows, s.qtype))
    return out


def _row_bytes(qtype: int, cols: int) -> int:
    block, size = block_layout(qtype)
    return cols // block * size


def _load_blocks(buffer: torch.Tensor, loaded: CheckpointTensor, qtype: int, cols: int,
                 name: str, whole: bool = False) -> torch.Tensor | None:
    """Check `loaded` and put its blocks into `buffer`. `whole`: it fills the whole buffer,
    which is then better replaced by the returned view of the file's map (None: copied)."""
    rows = buffer.shape[0]
    if gguf_type(loaded) != qtype:
        raise ModelLoadError(f"tensor {name} was planned as {KERNEL_TYPES[qtype]} blocks but "
                             f"arrived as {type(loaded).__name__}")
    if tuple(loaded.shape) != (rows, cols):
        raise ModelLoadError(f"tensor {name} has shape {tuple(loaded.shape)}, expected "
                             f"{(rows, cols)}")
    # gguf_type() checked that it is blocks, a GGUFTensor.
    mapped = map_blocks(loaded, (rows, buffer.shape[1])) if whole else None  # type: ignore[arg-type]
    if mapped is None:
        copy_blocks(loaded, buffer)  # type: ignore[arg-type]
    return mapped


class _QuantModule(nn.Module):
    """The kernel's view of the block buffers (`QuantWeight`s) and, with int8 activations,
    the one native call that multiplies them all (`QMatmulPlan`): made at load
    (`prepare_kernels`), or on first use, and again after anything (`to_empty`, `to`, a
    weight loaded) replaced the buffers.

    Each buffer whose kernel multiplies it faster interleaved (`QuantWeight.repacked`: Q4_0 /
    Q5_0 / Q8_0 / Q4_K / Q6_K with AVX-512 VNNI or AVX2) is then replaced by its packed copy, and the
    file's pages under a mapped original are dropped, so the weight is resident once either
    way."""

    def __init__(self, int8: bool) -> None:
        super().__init__()
        self.int8 = int8  # 8-bit activations (`auto`), else float32 (`exact`)
        self._views: list[QuantWeight] | None = None
        self._plan: QMatmulPlan | None = None
        self._packed: set[str] = set()  # buffers in the kernel's packed layout
        self._mapped: set[str] = set()  # buffers that are views of the file's map

    def _buffer_names(self) -> list[str]:
        raise NotImplementedError

    def _make_views(self) -> list[QuantWeight]:
        raise NotImplementedError

    def _columns(self) -> list[int]:
        """The first output column of each view's rows."""
        return [0]

    def _loaded(self, name: str, mapped: torch.Tensor | None) -> None:
        """Buffer `name` was (partly) loaded in the GGUF layout; `mapped`: it is now this
        view of the file's map."""
        self._packed.discard(name)
        if mapped is not None:
            setattr(self, name, mapped)
            self._mapped.add(name)
        self._views = self._plan = None

    def views(self) -> list[QuantWeight]:
        if self._views is None:
            views = self._make_views()
            for i, (name, view) in enumerate(zip(self._buffer_names(), views, strict=True)):
                packed = view.repacked()
                if packed is view:
                    continue
                setattr(self, name, packed.blocks)
                self._packed.add(name)
                if name in self._mapped:
                    self._mapped.discard(name)
                    drop_pages(view.blocks.numpy())
                views[i] = packed
            self._views = views
        return self._views

    def plan(self) -> QMatmulPlan:
        """The int8 product of x with every view, one native call (`auto` only)."""
        if self._plan is None:
            views = self.views()
            self._plan = QMatmulPlan(list(zip(views, self._columns(), strict=True)),
                                     sum(v.n for v in views))
        return self._plan

    def prepare(self) -> None:
        """Repack and plan now (at load), not at the first step."""
        self.views()
        if self.int8:
            self.plan()

    def _apply(self, fn: Any, recurse: bool = True) -> _QuantModule:
        self._views = self._plan = None
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        return self


class QuantizedLinear(_QuantModule):
    """y = x @ W^T (+ bias) with W's rows in GGUF blocks, one buffer per run of same-type
    shards. `weight` is an empty placeholder that gives checkpoint tensors a parameter to be
    routed to (`load_packed_weights`); `weight_loader` puts them into their buffer's rows."""

    def __init__(self, in_features: int, out_features: int, shards: list[QuantShard],
                 bias: bool, dtype: torch.dtype, int8: bool = True) -> None:
        super().__init__(int8)
        self.in_features, self.out_features = in_features, out_features
        self.shards = shards
        self.segments = _segments(shards)
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        for i, seg in enumerate(self.segments):
            self.register_buffer(f"qweight_{i}", torch.empty(
                seg.rows, _row_bytes(seg.qtype, in_features), dtype=torch.uint8))

    def _buffer_names(self) -> list[str]:
        return [f"qweight_{i}" for i in range(len(self.segments))]

    def blocks(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._buffer_names()]

    def _make_views(self) -> list[QuantWeight]:
        return [QuantWeight(getattr(self, name), seg.qtype, self.in_features, self.int8,
                            packed=name in self._packed)
                for name, seg in zip(self._buffer_names(), self.segments, strict=True)]

    def _columns(self) -> list[int]:
        return [seg.start for seg in self.segments]

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor,
                      shard_id: str | int | None, name: str) -> None:
        shard = next((s for s in self.shards if s.shard_id == shard_id), None)
        if shard is None:
            raise ModelLoadError(f"tensor {name}: no shard {shard_id!r} in this layer")
        if param is self.bias:
            if not isinstance(loaded, torch.Tensor):
                raise ModelLoadError(f"tensor {name}: a bias must be dequantized")
            default_weight_loader(param[shard.start:shard.start + shard.rows], loaded, name)
            return
        i, seg = next((i, g) for i, g in enumerate(self.segments)
                      if g.start <= shard.start < g.start + g.rows)
        rows = self.blocks()[i][shard.start - seg.start:shard.start - seg.start + shard.rows]
        # A buffer that is one checkpoint tensor is that tensor's bytes in the file's map.
        mapped = _load_blocks(rows, loaded, shard.qtype, self.in_features, name,
                              whole=seg.rows == shard.rows)
        self._loaded(f"qweight_{i}", mapped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)

    def project(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias) into `out` [rows, out_features] float32 (new when None)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if self.int8 and len(self.segments) <= MAX_WEIGHTS_PER_CALL:
            self.plan().run(x, out)  # x quantized once per kind for all segments, one call
        else:
            for seg, view in zip(self.segments, self.views(), strict=True):
                view.matmul(x, out[:, seg.start:seg.start + seg.rows])
        if self.bias is not None:
            out += self.bias
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight [out_features, in_features] as float32 (what `none` would hold)."""
        w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        for seg, view in zip(self.segments, self.views(), strict=True):
            view.rows(torch.arange(seg.rows), w[seg.start:seg.start + seg.rows])
        return w

    def extra_repr(self) -> str:
        types = ", ".join(KERNEL_TYPES[s.qtype] for s in self.shards)
        return (f"in_features={self.in_features}, out_features={self.out_features}, {types}, "
                f"{'int8' if self.int8 else 'float32'} activations")


class QuantizedEmbedding(_QuantModule):
    """An embedding table in GGUF blocks: lookups dequantize only the rows asked for, and
    `project` multiplies by the table (the output projection of a tied model)."""

    qweight: torch.Tensor

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: int,
                 dtype: torch.dtype, int8: bool = True) -> None:
        super().__init__(int8)
        self.num_embeddings, self.embedding_dim, self.qtype = num_embeddings, embedding_dim, qtype
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.register_buffer("qweight", torch.empty(
            num_embeddings, _row_bytes(qtype, embedding_dim), dtype=torch.uint8))

    def _buffer_names(self) -> list[str]:
        return ["qweight"]

    def _make_views(self) -> list[QuantWeight]:
        return [QuantWeight(self.qweight, self.qtype, self.embedding_dim, self.int8,
                            packed="qweight" in self._packed)]

    def weight_loader(self, param: torch.Tensor, loaded: CheckpointTensor,
                      shard_id: str | int | None, name: str) -> None:
        del param, shard_id
        mapped = _load_blocks(self.qweight, loaded, self.qtype, self.embedding_dim, name,
                              whole=True)
        self._loaded("qweight", mapped)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # A step's ids come flat, int64 and contiguous: no operators to make them so (each a
        # few microseconds of dispatch with its code out of the caches, at every step).
        ids = input_ids
        if ids.dim() != 1 or ids.dtype != torch.int64 or not ids.is_contiguous():
            ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.embedding_dim, dtype=torch.float32)
        self.views()[0].rows(ids, out)
        return out if input_ids.dim() == 1 else out.view(*input_ids.shape, self.embedding_dim)

    def project(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ table^T: [rows, embedding_dim] -> `out` [rows, num_embeddings] float32 (new
        when None)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty(x.shape[0], self.num_embeddings, dtype=torch.float32)
        if self.int8:
            self.plan().run(x, out)
        else:
            self.views()[0].matmul(x, out)
        return out

    def dequantized(self) -> torch.Tensor:
        """The table [num_embeddings, embedding_dim] as float32 (what `none` would hold)."""
        table: torch.Tensor = self(torch.arange(self.num_embeddings))
        return table

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {KERNEL_TYPES[self.qtype]}, "
                f"{'int8' if self.int8 else 'float32'} activations")


def _why_not(mode: QuantizationMode, dtype: torch.dtype, device: torch.device) -> str | None:
    if mode == "none":
        return "--quantization none"
    if device.type != "cpu":
        return (f"on {device.type} torch's grouped low-bit kernels take bfloat16 activations "
                "and scales, which would change the model's numbers")
    if dtype != torch.float32:
        return f"the native kernel runs float32 activations, the model dtype is {dtype}"
    if not qmatmul_available():
        return "the native quantized matmul kernel is not available"
    return None


def quantize_modules(model: nn.Module, tensor_types: Mapping[str, int],
                     mode: QuantizationMode, dtype: torch.dtype, device: torch.device
                     ) -> frozenset[str]:
    """Swap the model's linear layers and embeddings whose checkpoint tensors (HF name ->
    GGML type id in `tensor_types`; absent: not a block type) all have a kernel for their
    quantized forms. Returns the checkpoint names that must reach the model as stored."""
    quantizable = {name: t for name, t in tensor_types.items() if t in KERNEL_TYPES}
    if not quantizable:
        return frozenset()
    why = _why_not(mode, dtype, device)
    if why is not None:
        logger.info("quantized weights dequantized at load: %s", why)
        return frozenset()
    sources = checkpoint_names(model)  # type: ignore[arg-type]  # any module with the mapping
    int8 = mode == "auto"
    logger.info("quantized weights multiplied with %s", f"8-bit activations ({kernel_isa()})"
                if int8 else "float32 activations")
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear | nn.Embedding):
            continue
        parts = sources.get(f"{name}.weight", [])
        types = [quantizable.get(ckpt) for ckpt, _ in parts]
        cols = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
        if not parts or any(t is None or cols % block_layout(t)[0] for t in types):
            continue
        qtypes = [t for t in types if t is not None]
        new: nn.Module
        if isinstance(module, nn.Embedding):
            new = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, qtypes[0],
                                     dtype, int8)
        else:
            spans = (module.shards if isinstance(module, ShardedLinear)
                     else {None: (0, module.out_features)})
            by_shard = {shard: t for (_, shard), t in zip(parts, qtypes, strict=True)}
            shards = [QuantShard(s, start, rows, by_shard[s])
                      for s, (start, rows) in spans.items()]
            new = QuantizedLinear(module.in_features, module.out_features, shards,
                                  module.bias is not None, dtype, int8)
        model.set_submodule(name, new)
        kept.update(ckpt for ckpt, _ in parts)
    return frozenset(kept)


def prepare_kernels(model: nn.Module) -> None:
    """Repack every quantized weight the kernel multiplies faster interleaved and make its
    call's plan, once, at load: the first decode step then costs what the others do, and the
    packed copies are allocated while the loader still trims the heap."""
    for module in model.modules():
        if isinstance(module, _QuantModule):
            module.prepare()


def weight_memory(model: nn.Module) -> tuple[int, int]:
    """(bytes of quantized blocks, bytes of dense parameters and buffers) the model holds."""
    quantized = dense = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.dtype == torch.uint8:
            quantized += t.numel()
        else:
            dense += t.numel() * t.element_size()
    return quantized, dense


def describe(model: nn.Module) -> str:
    """How many matrices of each type the model keeps quantized, e.g. "72 Q5_0, 1 Q8_0"."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            for s in module.shards:
                counts[KERNEL_TYPES[s.qtype]] = counts.get(KERNEL_TYPES[s.qtype], 0) + 1
        elif isinstance(module, QuantizedEmbedding):
            counts[KERNEL_TYPES[module.qtype]] = counts.get(KERNEL_TYPES[module.qtype], 0) + 1
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items())) or "none"


def quantized_names(model: nn.Module) -> Collection[str]:
    """Names of the modules running quantized (tests, logs)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, QuantizedLinear | QuantizedEmbedding)]


def dense_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name, a quantized module's weight dequantized: the values a
    model loaded with `none` holds (tests compare the two)."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            out[f"{name}.weight"] = module.dequantized()
    return out
