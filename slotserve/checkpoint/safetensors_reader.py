"""Named tensors from a Hugging Face folder's safetensors files (one or sharded)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from slotserve.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read {str(index)!r}: {exc!r}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        single = folder / "model.safetensors"
        files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no model.safetensors (or {INDEX_FILE}) in {str(folder)!r}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing weights file {str(f)!r} (listed in {INDEX_FILE})")
    return files


class SafetensorsReader:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.source = str(folder)
        self.files = weight_files(folder)

    def tensor_types(self, names: Collection[str]) -> dict[str, int]:
        """No tensor of a safetensors folder is in a GGUF block type."""
        del names
        return {}

    def weights(self, names: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of every file (the names a model wants do not narrow it: the model
        ignores what it has no parameter for)."""
        del names
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        yield key, f.get_tensor(key)
            except ModelLoadError:
                raise
            except Exception as exc:  # safetensors raises its own types for corrupt files
                raise ModelLoadError(f"cannot read weights file {str(file)!r}: {exc}") from exc
