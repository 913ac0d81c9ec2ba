"""The user cache for what is derived from a checkpoint file once (GGUF tensor index, config,
tokenizer), keyed by the file's content.

Folder: $SLOTSERVE_CACHE_DIR, else $XDG_CACHE_HOME/slotserve, else ~/.cache/slotserve. The key
hashes the file's size and sampled content (its first 16 MiB, where a GGUF header with a large
vocabulary lives, its last MiB and 32 evenly spaced 64 KiB pieces): cheap (a few ms for a
250 MB file), independent of path and mtime, so a copied file hits and a changed one misses.
Entries are written to a temporary folder and renamed into place under a file lock, so two
processes starting on the same file build it once and never see half an entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slotserve.config import cache_root

logger = logging.getLogger(__name__)

# Bump when what is cached changes (the index's fields, what gguf_config.derive_config or the
# tokenizer builder produce): old entries are then simply not found.
CACHE_FORMAT = 4
_HEAD = 16 << 20
_TAIL = 1 << 20
_SAMPLES = 32
_SAMPLE = 64 << 10


def file_key(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(f"slotserve-cache-v{CACHE_FORMAT}:{size}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(_HEAD))
        if size > _HEAD:
            step = max((size - _HEAD) // (_SAMPLES + 1), 1)
            for i in range(1, _SAMPLES + 1):
                f.seek(_HEAD + i * step)
                digest.update(f.read(_SAMPLE))
            f.seek(max(size - _TAIL, _HEAD))
            digest.update(f.read())
    return digest.hexdigest()[:32]


def entry_dir(kind: str, key: str) -> Path:
    return cache_root() / kind / key


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def get_or_build(target: Path, build: Callable[[Path], None]) -> Path:
    """`target` (a folder), built by `build(folder)` first if it does not exist yet.

    When the cache cannot be written (read-only home, full disk) the entry is built in a
    temporary folder instead: a slower start is better than none.
    """
    if target.is_dir():
        return target
    try:
        with _locked(target.parent / f"{target.name}.lock"):
            if target.is_dir():  # another process built it while we waited
                return target
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            try:
                build(tmp)
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as exc:
        logger.warning("cannot write the cache entry %s (%s); building it in a temporary "
                       "folder", target, exc)
        tmp = Path(tempfile.mkdtemp(prefix="slotserve-"))
        build(tmp)
        return tmp
    return target


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, separators=(",", ":")))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
