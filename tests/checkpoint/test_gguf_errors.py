"""Every way a GGUF file can be unusable is a ModelLoadError that names the file and the
offending key or tensor; `slotserve serve` refuses to start with that message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValue, GGUFValueType, GGUFWriter

from slotserve.checkpoint import load_tokenizer, resolve_checkpoint
from slotserve.errors import ModelLoadError
from slotserve.models.loader import load_model
from tests.checkpoint.conftest import BundledGGUF
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.helpers import REPO, build_tiny


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("good")
    model = build_tiny("llama_tied", root / "hf")
    to_gguf(model.hf, root / "good.gguf", Q.Q8_0)
    return root / "good.gguf"


def broken(tmp_path: Path, edit: object, name: str = "bad.gguf") -> Path:
    model = build_tiny("llama_tied", tmp_path / "hf")
    to_gguf(model.hf, tmp_path / name, Q.Q8_0, edit=edit)  # type: ignore[arg-type]
    return tmp_path / name


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelLoadError, match=r"model\.gguf.*is not a GGUF file"):
        resolve_checkpoint(path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"weights\.bin.*not a GGUF file"):
        resolve_checkpoint(other)


def test_truncated_in_the_header(tmp_path: Path, good: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(good.read_bytes()[:300])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(GGUF header|truncated)"):
        resolve_checkpoint(path)


def test_truncated_in_the_tensor_data(tmp_path: Path, good: Path) -> None:
    data = good.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-100])
    # The last tensor in the file (the final norm) is cut short, and it is named.
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*tensor output_norm\.weight ends at "
                                             r"byte \d+ but the file has only"):
        resolve_checkpoint(path)
    # After a good open (its index cached), a copy cut short is still caught.
    resolve_checkpoint(good)
    path.write_bytes(data[:len(data) - 5000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    def edit(w: GGUFWriter) -> None:
        w.kv_data[0]["general.architecture"] = GGUFValue("gpt2", GGUFValueType.STRING)

    path = broken(tmp_path, edit)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*unsupported architecture 'gpt2' "
                                             r"\(GGUF key general\.architecture\)"):
        resolve_checkpoint(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    def edit(w: GGUFWriter) -> None:
        rows = np.zeros((64, 2 * 40), dtype=np.uint8)  # 64 x 64 values in Q8_1 blocks
        w.add_tensor("blk.0.attn_extra.weight", rows, raw_dtype=Q.Q8_1)

    path = broken(tmp_path, edit)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*tensor blk\.0\.attn_extra\.weight has "
                                             r"type Q8_1"):
        resolve_checkpoint(path)


def test_missing_metadata_key(tmp_path: Path) -> None:
    path = broken(tmp_path, lambda w: w.kv_data[0].pop("llama.embedding_length"))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*llama\.embedding_length is missing"):
        resolve_checkpoint(path)


def test_missing_tensor(tmp_path: Path) -> None:
    path = broken(tmp_path, lambda w: w.tensors[0].pop("blk.1.ffn_up.weight"))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*blk\.1\.ffn_up\.weight "
                                             r"\(model\.layers\.1\.mlp\.up_proj\.weight\)"):
        load_model(path)


def test_misshapen_tensor(tmp_path: Path) -> None:
    def edit(w: GGUFWriter) -> None:
        info = w.tensors[0]["blk.0.ffn_down.weight"]
        w.tensors[0]["blk.0.ffn_down.weight"].tensor = info.tensor[:32]  # type: ignore[index]
        info.shape = [info.shape[0], 32]
        info.nbytes //= 2

    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*down_proj\.weight has shape"):
        load_model(broken(tmp_path, edit))


def test_folder_with_two_gguf_files(tmp_path: Path, good: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(good.read_bytes())
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        resolve_checkpoint(tmp_path)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.gguf")


def test_file_without_tokenizer(tmp_path: Path, good: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"good\.gguf.*has no tokenizer \(GGUF key "
                                             r"tokenizer\.ggml\.model is missing\)"):
        load_tokenizer(good)


def test_server_refuses_to_start(tmp_path: Path, bundled_gguf: BundledGGUF) -> None:
    # Truncated: caught before the engine starts (in either mode). Missing tensor: caught
    # while the engine loads the weights (in process mode in the child), reported the same
    # way. The CLI runs
    # as a user runs it, in a subprocess, with a deadline (side by side: each pays imports).
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(bundled_gguf(Q.Q8_0).read_bytes()[:-100])
    missing = bundled_gguf(Q.Q8_0, "missing.gguf",
                           edit=lambda w: w.tensors[0].pop("blk.0.attn_v.weight"))
    cases = [(cut, "truncated", "process"), (missing, "blk.0.attn_v.weight", "thread"),
             (missing, "blk.0.attn_v.weight", "process")]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "serve", "--model", str(path),
         "--engine-mode", mode, "--threads", "1", "--port", "1"], cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True) for path, _, mode in cases]
    try:
        for proc, (path, message, mode) in zip(procs, cases, strict=True):
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 2, (mode, err[-3000:])
            assert "error:" in err and str(path) in err and message in err, (mode, err[-3000:])
            assert "Traceback" not in err, (mode, err[-3000:])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
