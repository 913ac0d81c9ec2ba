"""`--quantization auto` where the native kernels cannot be built: `slotserve generate` on a Q8_0
GGUF file, in a subprocess whose C compiler is hidden (PATH without gcc / cc, $CC a program
that is not a compiler) and whose kernel cache is empty. It must say why in a log line, fall
back to the dequantized weights (and the torch attention path), and write exactly what
`--quantization none` writes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slotserve import LLM, SamplingParams
from slotserve.engine.args import DEFAULT_MODEL
from tests.checkpoint.gguf_convert import Q, to_gguf

REPO = Path(__file__).resolve().parents[2]
# The CLI with INFO logging on: the loader's own "dequantized at load" line is INFO.
RUN_CLI = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
           "from slotserve.entrypoints.cli import main; sys.exit(main())")
PROMPT, MAX_TOKENS = "To be, or not", 12
ARGS = ["generate", PROMPT, "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
        "--device", "cpu", "--dtype", "float32", "--num-blocks", "64", "--max-model-len", "128"]


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model in Q8_0 (its 256-wide rows: every matrix but the MLP's down
    projection, whose 688 columns fall back to F16)."""
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("q8") / "model.gguf"
    to_gguf(hf, path, Q.Q8_0, tokenizer_dir=Path(DEFAULT_MODEL))
    return path


def generate(model: Path, quantization: str, env: dict[str, str]) -> tuple[str, str]:
    """`slotserve generate` in a subprocess: its stdout and stderr."""
    proc = subprocess.run([sys.executable, "-c", RUN_CLI, *ARGS, "--model", str(model),
                           "--quantization", quantization],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def _env(**changes: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **changes}


def test_auto_without_a_compiler_dequantizes_and_says_so(q8_file: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # PATH: nothing in it, so no gcc and no cc
    bin_dir.mkdir()
    fake_cc = tmp_path / "not-a-compiler"
    fake_cc.write_text("#!/bin/sh\necho 'not a compiler' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    cache = tmp_path / "cache"
    out, err = generate(q8_file, "auto", _env(PATH=str(bin_dir), CC=str(fake_cc),
                                              SLOTSERVE_CACHE_DIR=str(cache)))
    assert "native kernel qmatmul did not compile (quantized weights are dequantized at " \
           "load): not a compiler" in err, err[-3000:]
    assert "quantized weights dequantized at load: the native quantized matmul kernel is " \
           "not available" in err, err[-3000:]
    assert not list(cache.glob("*.so"))  # nothing was built, nothing stale was reused
    # The dequantized model: exactly what `--quantization none` writes (run here, in-process).
    llm = LLM(model=str(q8_file), quantization="none", device="cpu", dtype="float32",
              num_blocks=64, max_model_len=128)
    (ref,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                          use_tqdm=False)
    assert out == PROMPT + ref.outputs[0].text + "\n"
