"""The tokenizer for a model path: a Hugging Face folder's own, or one built from a GGUF
file's metadata by transformers (the reference the prompt ids must equal), cached.

Building Gemma 3's 262k-token tokenizer from GGUF metadata takes transformers 5-30 s (merges
are rebuilt from the vocabulary); loading the saved tokenizer.json takes about 2 s. So the
first start saves it into the cache entry of the file, with the chat template: the file's own,
or the architecture's known turn format when it has none (logged on every start).

transformers' GGUF conversion imports torch (about 180 MB resident, for good). A process that
has no torch yet (the server's front) builds the entry in a child interpreter and only loads
the saved tokenizer.json itself, without transformers (`SavedTokenizer`).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from slotserve.checkpoint import cache
from slotserve.checkpoint.chat_render import check_template_syntax
from slotserve.checkpoint.chat_templates import fallback_chat_template
from slotserve.checkpoint.resolve import find_gguf
from slotserve.checkpoint.saved_tokenizer import SavedTokenizer
from slotserve.errors import ModelLoadError
from slotserve.memory import trim_heap

if TYPE_CHECKING:  # transformers takes a while to import; it is loaded on first use
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_TOKENIZER = "tokenizer.json"
_NOTES = "slotserve.json"  # special tokens and chat template; what slotserve decided


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer (or itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"a fast (Rust-backed) tokenizer is needed, not {type(tokenizer)}")
    return backend


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase | SavedTokenizer:
    """The tokenizer of a model path (Hugging Face folder, .gguf file or folder holding one).
    A chat template that is not valid Jinja is a ModelLoadError here, not each client's 400."""
    gguf_path = find_gguf(path)
    tokenizer: PreTrainedTokenizerBase | SavedTokenizer = (
        load_gguf_tokenizer(gguf_path) if gguf_path is not None
        else _load_folder_tokenizer(Path(path).expanduser()))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        check_template_syntax(template, str(gguf_path or path))
    return tokenizer


def _load_folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """A plain tokenizer.json tokenizer is loaded directly: going through AutoTokenizer costs
    seconds of imports that `slotserve generate` would pay."""
    import transformers

    try:
        config_file = folder / "tokenizer_config.json"
        if (folder / "tokenizer.json").is_file() and config_file.is_file():
            declared = json.loads(config_file.read_text()).get("tokenizer_class")
            if declared in (None, "PreTrainedTokenizerFast"):
                tokenizer: PreTrainedTokenizerBase = (
                    transformers.PreTrainedTokenizerFast.from_pretrained(str(folder)))
                return tokenizer
        auto: PreTrainedTokenizerBase = transformers.AutoTokenizer.from_pretrained(str(folder))
        return auto
    except Exception as exc:  # transformers raises many types for a bad folder
        raise ModelLoadError(f"could not load a tokenizer from {str(folder)!r}: {exc}") from exc


def load_gguf_tokenizer(path: Path) -> SavedTokenizer:
    try:
        key = cache.file_key(path)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}") from exc
    folder = cache.get_or_build(cache.entry_dir("gguf", key) / "tokenizer",
                                lambda out: _build_gguf_tokenizer(path, out))
    try:
        notes = cache.read_json(folder / _NOTES)
        if notes.get("chat_template_fallback"):
            logger.warning("%s has no chat template; using the %s turn format for chat", path,
                           notes["chat_template_fallback"])
        return _load_saved(folder / _TOKENIZER, notes)
    except Exception as exc:
        raise ModelLoadError(f"could not load the cached tokenizer of {str(path)!r} from "
                             f"{str(folder)!r}: {exc}") from exc


def _load_saved(tokenizer_file: Path, notes: dict[str, Any]) -> SavedTokenizer:
    """The saved backend tokenizer (its post-processor adds BOS, its added tokens know which
    are special) with the special tokens and chat template noted beside it, without
    transformers (saved_tokenizer.py): 0.6 s for Gemma's vocabulary, against 1.5 s for
    `from_pretrained` of a saved folder."""
    tok = SavedTokenizer(tokenizer_file, notes["special_tokens"], notes["chat_template"])
    trim_heap()  # the parsed tokenizer.json: ~190 MB of Gemma's, freed but kept by malloc
    return tok


def _build_gguf_tokenizer(path: Path, out: Path) -> None:
    if "torch" in sys.modules:  # nothing to keep out of this process: build it here
        _build_here(path, out)
        return
    code = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
            "from slotserve.checkpoint.tokenizer import build_child_main; "
            "build_child_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))")
    rc = subprocess.run([sys.executable, "-c", code, json.dumps(sys.path), str(path), str(out),
                         str(logger.getEffectiveLevel())], stdin=subprocess.DEVNULL).returncode
    error = out / _CHILD_ERROR
    if error.is_file():
        message = error.read_text()
        error.unlink()
        raise ModelLoadError(message)
    if rc != 0:
        raise ModelLoadError(f"could not build a tokenizer from the metadata of {str(path)!r}: "
                             f"the building process exited with code {rc}")


_CHILD_ERROR = "error.txt"  # what build_child_main failed with, for the parent to raise


def build_child_main(path: str, out: str, log_level: int) -> None:
    """The child of _build_gguf_tokenizer: build the entry into `out`; a ModelLoadError's
    text goes back through a file (stderr carries transformers' own warnings)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        _build_here(Path(path), Path(out))
    except ModelLoadError as exc:
        (Path(out) / _CHILD_ERROR).write_text(str(exc))
        sys.exit(3)


def _build_here(path: Path, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from slotserve.checkpoint.gguf_config import derive_config
    from slotserve.checkpoint.gguf_file import open_gguf

    # The architecture decides the fallback chat template; indexing the file here also means
    # the engine process (which needs the index) finds it cached.
    file = open_gguf(path, derive_config)
    if "tokenizer.ggml.model" not in file.metadata:
        raise ModelLoadError(f"{str(path)!r} has no tokenizer (GGUF key tokenizer.ggml.model is "
                             "missing)")
    logger.info("building the tokenizer of %s from its metadata (once; cached in %s)", path,
                out.parent)
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      local_files_only=True)
    except Exception as exc:  # transformers raises many types for metadata it cannot use
        raise ModelLoadError(f"could not build a tokenizer from the metadata of "
                             f"{str(path)!r}: {exc}") from exc
    notes: dict[str, Any] = {"chat_template_fallback": None, "chat_template": tok.chat_template}
    if not tok.chat_template:
        fallback = fallback_chat_template(file.architecture, tok.get_vocab())
        if fallback is not None:
            notes["chat_template_fallback"], notes["chat_template"] = fallback
    notes["special_tokens"] = {name: str(value) for name, value in
                               tok.special_tokens_map.items() if isinstance(value, str)}
    tok.backend_tokenizer.save(str(out / _TOKENIZER))
    cache.write_json(out / _NOTES, notes)
