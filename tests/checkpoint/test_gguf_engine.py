"""The bundled model as a GGUF file runs through every entry point exactly as its folder does:
tokenizer and chat template from the metadata, `LLM`, `slotserve generate`, the server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from slotserve import LLM, SamplingParams
from slotserve.checkpoint import load_tokenizer
from slotserve.engine.args import DEFAULT_MODEL
from slotserve.entrypoints import cli
from tests.checkpoint.conftest import BundledGGUF
from tests.checkpoint.gguf_convert import Q

TEXTS = ["To be, or not to be", " leading space and  two", "Héllo wörld 日本 🎉",
         "<|user|>\nhi<|eos|>", "", "line\n\nbreaks\t tabs"]
PROMPTS = ["To be, or not", "My lord, the king", "O Romeo"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", num_blocks=256, max_model_len=256, check=True)


def test_tokenizer_from_metadata(bundled_gguf: BundledGGUF) -> None:
    path = bundled_gguf()
    ours = load_tokenizer(path)
    folder = load_tokenizer(DEFAULT_MODEL)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        for special in (True, False):  # with and without the BOS the file asks for
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == folder.encode(text, add_special_tokens=special) == \
                reference.encode(text, add_special_tokens=special), text
    assert ours.encode("x")[0] == ours.bos_token_id == folder.bos_token_id
    assert ours.chat_template == folder.chat_template  # from tokenizer.chat_template
    # Cached: a second load reads the saved tokenizer, not the file's metadata.
    again = load_tokenizer(path)
    assert again.encode(TEXTS[2]) == ours.encode(TEXTS[2])
    assert list(Path(os.environ["SLOTSERVE_CACHE_DIR"]).glob("gguf/*/tokenizer/tokenizer.json"))


@pytest.fixture(scope="module")
def folder_outputs() -> tuple[list[str], list[str]]:
    llm = LLM(**ENGINE)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    chat = llm.chat([{"role": "user", "content": "Speak, friend."}], GREEDY, use_tqdm=False)
    return texts, [chat[0].outputs[0].text]


def test_llm_generate_and_chat_like_the_folder(bundled_gguf: BundledGGUF,
                                               folder_outputs: tuple[list[str], list[str]]
                                               ) -> None:
    llm = LLM(model=str(bundled_gguf()), **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == folder_outputs[0]
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    chat = llm.chat([{"role": "user", "content": "Speak, friend."}], GREEDY, use_tqdm=False)
    assert [chat[0].outputs[0].text] == folder_outputs[1]


def test_a_gguf_file_caches_kv_in_16_bits_as_llamacpp(bundled_gguf: BundledGGUF) -> None:
    """auto on a GGUF file run in float32 is float16 (llama.cpp's default cache type): the
    same --kv-cache-memory holds twice the blocks of the float32 cache; a given dtype wins."""
    budget = dict(ENGINE, num_blocks=None, kv_cache_memory=4 << 20)
    runners = {}
    for name in ("auto", "float32"):
        llm = LLM(model=str(bundled_gguf()), kv_cache_dtype=name, **budget)
        runners[name] = llm.llm_engine.engine_core.engine_core.model_runner
    assert runners["auto"].kv_caches[0][0].dtype == torch.float16
    assert runners["auto"].kv_cache_dtype == torch.float16
    assert runners["float32"].kv_caches[0][0].dtype == torch.float32
    assert runners["auto"].num_blocks >= 2 * runners["float32"].num_blocks - 1
    folder = LLM(kv_cache_dtype="auto", **budget)  # the same model as a folder: its dtype
    assert folder.llm_engine.engine_core.engine_core.model_runner.kv_caches[0][0].dtype == \
        torch.float32


def test_quantized_file_generates(bundled_gguf: BundledGGUF,
                                  folder_outputs: tuple[list[str], list[str]]) -> None:
    """Q8_0 changes the weights a little: the text is the model's, not the same to the token."""
    llm = LLM(model=str(bundled_gguf(Q.Q8_0)), **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    # Most leading words agree with the float32 model's.
    agree = sum(a.split()[:2] == b.split()[:2] for a, b in zip(texts, folder_outputs[0],
                                                                 strict=True))
    assert agree >= 2, (texts, folder_outputs[0])


def test_cli_generate(bundled_gguf: BundledGGUF, capsys: pytest.CaptureFixture[str],
                      folder_outputs: tuple[list[str], list[str]]) -> None:
    code = cli.main(["generate", PROMPTS[0], "--model", str(bundled_gguf()), "--max-tokens",
                     "32", "--temperature", "0", "--threads", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    # The CLI stops at EOS; the greedy text up to there is the folder's.
    generated = out[len(PROMPTS[0]):].rstrip("\n")
    assert out.startswith(PROMPTS[0]) and len(generated) > 10
    assert folder_outputs[0][0].startswith(generated)
