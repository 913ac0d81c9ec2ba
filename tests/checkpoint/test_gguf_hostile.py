"""Hostile GGUF metadata: every value that would hang, divide by zero, allocate terabytes or be
taken silently is a ModelLoadError naming the file and the key, raised while the file is
indexed (before any parameter is allocated), and `slotserve serve` exits with status 2."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGUFValue, GGUFValueType, GGUFWriter

from slotserve.checkpoint import load_tokenizer, resolve_checkpoint
from slotserve.engine.args import DEFAULT_MODEL
from slotserve.entrypoints import cli
from slotserve.errors import ModelLoadError
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.helpers import build_tiny

Edit = Callable[[GGUFWriter], None]
U32, I32, U64, F32 = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64,
                      GGUFValueType.FLOAT32)


def setting(key: str, value: object, kind: GGUFValueType) -> Edit:
    def edit(w: GGUFWriter) -> None:
        w.kv_data[0][key] = GGUFValue(value, kind)
    return edit


def hostile(tmp_path: Path, edit: Edit, name: str = "hostile.gguf") -> Path:
    model = build_tiny("llama_tied", tmp_path / "hf")
    to_gguf(model.hf, tmp_path / name, Q.Q8_0, edit=edit)
    return tmp_path / name


@pytest.mark.parametrize(("key", "value", "kind", "message"), [
    ("llama.block_count", 10 ** 6, U32,
     r"llama\.block_count is 1000000 but the file has tensors for 2 blocks; missing the "
     r"tensors of blk\.2\.\*.* and 999995 more"),
    ("llama.block_count", 1, U32, r"llama\.block_count is 1 but the file has tensors of blocks "
                                  r"beyond it \(blk\.1\.\*\)"),
    ("llama.context_length", -5, I32, r"llama\.context_length is -5, expected an integer"),
    ("llama.context_length", 2 ** 62, U64, r"llama\.context_length is 4611686018427387904"),
    ("llama.attention.head_count", 0, U32, r"llama\.attention\.head_count is 0"),
    ("llama.attention.head_count_kv", 3, U32,
     r"llama\.attention\.head_count_kv is 3, expected a divisor"),
    ("llama.feed_forward_length", 2 ** 31, U32,
     r"llama\.feed_forward_length is 2147483648, expected an integer from 1"),
    ("llama.feed_forward_length", 4096, U32,
     r"llama\.feed_forward_length is 4096 but tensor blk\.0\.ffn_up\.weight has shape"),
    ("llama.embedding_length", 48, U32,
     r"llama\.embedding_length is 48 but tensor token_embd\.weight has shape"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), F32,
     r"layer_norm_rms_epsilon is nan, expected a finite positive number"),
    ("llama.rope.freq_base", "ten thousand", GGUFValueType.STRING,
     r"llama\.rope\.freq_base is 'ten thousand', expected one number"),
    ("tokenizer.ggml.eos_token_id", 10 ** 6, U32,
     r"tokenizer\.ggml\.eos_token_id is 1000000, expected a token id below"),
    ("tokenizer.ggml.bos_token_id", 10 ** 6, U32, r"tokenizer\.ggml\.bos_token_id is 1000000"),
])
def test_bad_metadata_value(tmp_path: Path, key: str, value: object, kind: GGUFValueType,
                            message: str) -> None:
    path = hostile(tmp_path, setting(key, value, kind))
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"hostile\.gguf.*" + message):
        resolve_checkpoint(path)
    assert time.monotonic() - start < 30  # at once: nothing was allocated for the layers


def test_tokenizer_without_tokens(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    # Written here, not by the bundled_gguf fixture: its folders are named by count, and a
    # second edited file of the same type in one session would reuse one.
    hf = LlamaForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    path = tmp_path / "notokens.gguf"
    to_gguf(hf, path, Q.Q8_0, tokenizer_dir=Path(DEFAULT_MODEL),
            edit=lambda w: w.kv_data[0].pop("tokenizer.ggml.tokens"))
    with pytest.raises(ModelLoadError, match=r"notokens\.gguf: GGUF metadata key "
                                             r"tokenizer\.ggml\.tokens is missing"):
        load_tokenizer(path)


def test_serve_exits_2_naming_the_key(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = hostile(tmp_path, setting("llama.block_count", 10 ** 6, U32))
    code = cli.main(["serve", "--model", str(path), "--engine-mode", "thread", "--threads",
                     "1", "--port", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(path) in err and "llama.block_count is 1000000" in err
    assert "Traceback" not in err
