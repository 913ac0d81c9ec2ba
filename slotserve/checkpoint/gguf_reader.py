"""Named tensors from a GGUF file, in the Hugging Face naming and layout the model expects
(llama.cpp's conversion undone by gguf_layout), still in their GGUF type."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator

from slotserve.checkpoint.gguf_file import GGUFFile, GGUFTensor
from slotserve.checkpoint.gguf_layout import gguf_names, undo_conversion
from slotserve.errors import ModelLoadError
from slotserve.model_config import ModelConfig

logger = logging.getLogger(__name__)


class GGUFWeightsReader:
    def __init__(self, file: GGUFFile, config: ModelConfig) -> None:
        self.file = file
        self.config = config
        self.source = str(file.path)

    def tensor_types(self, names: Collection[str]) -> dict[str, int]:
        """Hugging Face name -> GGML type id of the stored tensor, for the names given that
        the file holds (read from the index: no tensor data is touched)."""
        to_hf = gguf_names(self.file.architecture, self.config.num_hidden_layers, names)
        return {hf: int(self.file.tensors[g].ggml_type) for g, hf in to_hf.items()
                if g in self.file.tensors}

    def weights(self, names: Collection[str]) -> Iterator[tuple[str, GGUFTensor]]:
        arch = self.file.architecture
        to_hf = gguf_names(arch, self.config.num_hidden_layers, names)
        for gguf_name in self.file.tensors:
            hf_name = to_hf.get(gguf_name)
            if hf_name is None:
                logger.debug("ignoring tensor %s in %s", gguf_name, self.source)
                continue
            tensor = self.file.read(gguf_name)
            yield hf_name, undo_conversion(arch, self.config, hf_name, tensor)
        missing = [f"{g} ({hf})" for g, hf in to_hf.items() if g not in self.file.tensors]
        unmapped = sorted(set(names) - set(to_hf.values()))
        if missing or unmapped:
            listed = missing + [f"(no GGUF name for {n})" for n in unmapped]
            raise ModelLoadError(f"tensors missing from {self.source!r}: {', '.join(listed[:5])}"
                                 + (f" and {len(listed) - 5} more" if len(listed) > 5 else ""))
