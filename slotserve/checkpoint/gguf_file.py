"""A GGUF file: its metadata and tensor index (parsed once with the `gguf` package, then
cached), and its tensors as raw GGUF data read through a memory map.

Parsing the header of a file with a 262k-token vocabulary takes `gguf.GGUFReader` about 14 s
(every string becomes numpy views); the index that results (metadata scalars, each tensor's
name, type, shape and byte range, the derived model config) is a few kB of JSON, so later
starts read that and map the tensor bytes directly.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    quant_shape_to_byte_shape,
)

from slotserve.checkpoint import cache
from slotserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
INDEX_FILE = "index.json"
# Tensor types slotserve can load (each dequantized at load for now; tests cover every one).
SUPPORTED_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
})
_TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
# Metadata arrays longer than this (the vocabulary, scores, merges) stay out of the index.
_MAX_ARRAY = 4096


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: (rows, columns); GGUF lists dimensions reversed
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(slots=True)
class GGUFTensor:
    """One tensor as stored: `data` is typed for F32/F16 and rows of blocks (uint8) for the
    block types, exactly as `gguf.GGUFReader` presents it; dequantizing is a separate step."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _CheckedReader(GGUFReader):
    """GGUFReader that names the offending tensor when the file is truncated or holds a type
    it cannot handle, instead of failing inside numpy."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise ModelLoadError(f"tensor {name} has unknown GGUF type id "
                                     f"{int(raw_dtype[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(dims)) * type_size // block
            end = int(start_offs + offset[0]) + nbytes
            if end > size:
                raise ModelLoadError(f"tensor {name} ends at byte {end} but the file has only "
                                     f"{size} bytes: the file is truncated")
        super()._build_tensors(start_offs, fields)


def _field_value(field: Any) -> Any:
    if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > _MAX_ARRAY:
        return None
    return field.contents()


def _parse(path: Path) -> tuple[GGUFReader, dict[str, Any], list[GGUFTensorInfo]]:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, "
                             f"not {GGUF_MAGIC!r})")
    try:
        reader = _CheckedReader(path)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{str(path)!r}: {exc}") from exc
    except Exception as exc:  # the gguf package raises ValueError/IndexError/KeyError/...
        raise ModelLoadError(f"{str(path)!r}: cannot parse the GGUF header ({exc!r}); the file "
                             "is truncated or corrupt") from exc
    metadata = {name: _field_value(field) for name, field in reader.fields.items()
                if not name.startswith("GGUF.")}
    metadata = {k: v for k, v in metadata.items() if v is not None}
    tensors = []
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{str(path)!r}: tensor {t.name} has type {t.tensor_type.name}, which slotserve "
                f"cannot load; supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))}")
        tensors.append(GGUFTensorInfo(t.name, t.tensor_type,
                                      tuple(int(d) for d in reversed(t.shape.tolist())),
                                      int(t.data_offset), int(t.n_bytes)))
    return reader, metadata, tensors


def token_ids_of(reader: GGUFReader, texts: set[str]) -> dict[str, int]:
    """Ids of the given token texts in the file's vocabulary (a scan, on a cache miss only)."""
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return {}
    wanted = {t.encode("utf-8") for t in texts}
    found: dict[str, int] = {}
    for token_id, part in enumerate(field.data):
        raw = field.parts[part].tobytes()
        if raw in wanted:
            found.setdefault(raw.decode("utf-8"), token_id)
    return found


class GGUFFile:
    """An opened GGUF file. `metadata`, `tensors` and `config` come from the cached index."""

    def __init__(self, path: Path, index: Mapping[str, Any]) -> None:
        self.path = path
        self.metadata: dict[str, Any] = dict(index["metadata"])
        self.config: dict[str, Any] = dict(index["config"])
        self.tensors: dict[str, GGUFTensorInfo] = {
            t[0]: GGUFTensorInfo(t[0], GGMLQuantizationType(t[1]), tuple(t[2]), t[3], t[4])
            for t in index["tensors"]}
        size = path.stat().st_size
        for info in self.tensors.values():
            if info.offset + info.nbytes > size:
                raise ModelLoadError(f"{str(path)!r}: tensor {info.name} ends at byte "
                                     f"{info.offset + info.nbytes} but the file has only {size} "
                                     "bytes: the file is truncated")

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))

    @cached_property
    def _map(self) -> np.memmap:
        return np.memmap(self.path, mode="r")

    def read(self, name: str) -> GGUFTensor:
        info = self.tensors[name]
        raw = self._map[info.offset:info.offset + info.nbytes]
        typed = _TYPED.get(info.ggml_type)
        if typed is not None:
            data = raw.view(typed).reshape(info.shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(info.shape, info.ggml_type))
        return GGUFTensor(name, info.ggml_type, info.shape, data)


def open_gguf(path: Path, derive_config: Any) -> GGUFFile:
    """Open `path`, parsing its header (and deriving the model config with
    `derive_config(metadata, tensors, reader, source)`) only when the cache has no index."""

    def build(folder: Path) -> None:
        reader, metadata, tensors = _parse(path)
        config = derive_config(metadata, {t.name: t for t in tensors}, reader, str(path))
        cache.write_json(folder / INDEX_FILE, {
            "metadata": metadata,
            "config": config,
            "tensors": [[t.name, int(t.ggml_type), list(t.shape), t.offset, t.nbytes]
                        for t in tensors],
        })
        logger.info("indexed %s: %d tensors, architecture %s", path, len(tensors),
                    metadata.get("general.architecture"))

    try:
        key = cache.file_key(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}") from exc
    folder = cache.get_or_build(cache.entry_dir("gguf", key) / "index", build)
    return GGUFFile(path, cache.read_json(folder / INDEX_FILE))


def drop_pages(data: np.ndarray) -> None:
    """Unmap the whole pages under `data` from this process (MADV_DONTNEED on a read-only
    file map: they stay in the page cache, and a later read faults them back in), so bytes
    that were copied are not resident twice while the rest of the map serves as weights."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return  # not a POSIX system: the copy is resident twice until the map closes
    page = mmap.PAGESIZE
    start = -(-data.ctypes.data // page) * page
    end = (data.ctypes.data + data.nbytes) // page * page
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                        mmap.MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
