"""What building a GGUF file's tokenizer leaves in a process without torch (the server's
front): transformers' GGUF conversion imports torch, so such a process builds the cache entry
in a child and only loads the saved tokenizer (without transformers), and still raises the
build's ModelLoadError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.conftest import BundledGGUF
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.helpers import REPO, build_tiny

# A fresh interpreter, as `slotserve serve`'s front is: torch is not imported before.
CODE = """
import json, sys
from slotserve.checkpoint import load_tokenizer
from slotserve.errors import ModelLoadError
out = {}
try:
    out["ids"] = load_tokenizer(sys.argv[1])("To be, or not")["input_ids"]
except ModelLoadError as exc:
    out["error"] = str(exc)
out["torch"] = "torch" in sys.modules
out["transformers"] = "transformers" in sys.modules
print(json.dumps(out))
"""


def load_in_fresh_process(path: Path, cache: Path) -> dict[str, object]:
    res = subprocess.run([sys.executable, "-c", CODE, str(path)], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=str(REPO),
                                  SLOTSERVE_CACHE_DIR=str(cache)))
    result: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(600)
def test_cold_build_keeps_torch_out(tmp_path: Path, bundled_gguf: BundledGGUF) -> None:
    from slotserve.checkpoint import load_tokenizer

    path = bundled_gguf(Q.Q8_0)
    cold = load_in_fresh_process(path, tmp_path / "cache")  # builds the entry
    warm = load_in_fresh_process(path, tmp_path / "cache")  # loads it
    assert cold["torch"] is False and warm["torch"] is False
    # Nor transformers: the front tokenizes with the saved Rust tokenizer (SavedTokenizer).
    assert cold["transformers"] is False and warm["transformers"] is False
    # The same ids as a tokenizer built here, in a process that has torch.
    expected = load_tokenizer(path)("To be, or not")["input_ids"]
    assert cold["ids"] == warm["ids"] == expected


@pytest.mark.timeout(600)
def test_cold_build_error_reaches_the_parent(tmp_path: Path) -> None:
    model = build_tiny("llama_tied", tmp_path / "hf")
    to_gguf(model.hf, tmp_path / "good.gguf", Q.Q8_0)  # no tokenizer in its metadata
    result = load_in_fresh_process(tmp_path / "good.gguf", tmp_path / "cache")
    assert result["torch"] is False
    assert "good.gguf" in str(result["error"])
    assert "has no tokenizer (GGUF key tokenizer.ggml.model is missing)" in str(result["error"])
    # The failed build left no cache entry behind.
    assert not list((tmp_path / "cache").glob("gguf/*/tokenizer"))
