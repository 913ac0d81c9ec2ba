"""A model path -> its format, config and weights reader.

A path is a Hugging Face folder (config.json + safetensors), a `.gguf` file, or a folder
holding exactly one `.gguf` file and no config.json.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from slotserve.errors import ModelLoadError
from slotserve.model_config import ModelConfig

if TYPE_CHECKING:  # torch stays unimported until weights are read
    from slotserve.checkpoint.dequant import CheckpointTensor

# The readers (numpy, gguf, safetensors) are imported when a checkpoint is resolved, not
# here: the server's front finds the GGUF file and its cached tokenizer through this module
# and never reads weights (numpy and gguf are ~20 MB resident there).


class WeightsReader(Protocol):
    source: str

    def tensor_types(self, names: Collection[str]) -> dict[str, int]:
        """Hugging Face name -> GGML type id, for the tensors stored in a GGUF type."""
        ...

    def weights(self, names: Collection[str]) -> Iterator[tuple[str, CheckpointTensor]]:
        """(Hugging Face name, tensor) pairs; `names` are the ones the model loads."""
        ...


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path  # the folder, or the .gguf file
    format: Literal["safetensors", "gguf"]
    config: ModelConfig
    reader: WeightsReader


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names (itself, or the one .gguf in a folder without config.json);
    None for a Hugging Face folder. A missing path or an ambiguous folder is a ModelLoadError."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return p
        from slotserve.checkpoint.gguf_file import GGUF_MAGIC

        with p.open("rb") as f:
            if f.read(4) == GGUF_MAGIC:
                return p
        raise ModelLoadError(f"{str(p)!r} is a file but not a GGUF file; give a .gguf file or "
                             "a Hugging Face model folder")
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} does not exist (give a Hugging Face model "
                             "folder or a .gguf file)")
    if (p / "config.json").is_file():
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        raise ModelLoadError(f"{str(p)!r} holds several GGUF files "
                             f"({', '.join(f.name for f in found)}); give one of them")
    return found[0] if found else None


def resolve_checkpoint(path: str | Path) -> Checkpoint:
    from slotserve.checkpoint.gguf_config import derive_config
    from slotserve.checkpoint.gguf_file import open_gguf
    from slotserve.checkpoint.gguf_reader import GGUFWeightsReader
    from slotserve.checkpoint.safetensors_reader import SafetensorsReader

    gguf_path = find_gguf(path)
    if gguf_path is None:
        folder = Path(path).expanduser()
        config = ModelConfig.from_pretrained(folder)
        return Checkpoint(folder, "safetensors", config, SafetensorsReader(folder))
    file = open_gguf(gguf_path, derive_config)
    config = ModelConfig.from_dict(file.config, source=f"{gguf_path} (GGUF metadata)")
    return Checkpoint(gguf_path, "gguf", config, GGUFWeightsReader(file, config))
