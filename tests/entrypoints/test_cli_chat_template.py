"""`slotserve generate --chat` on a model file whose chat template is hostile (nested huge
loops, gigabytes of output): the render runs in the bounded child (checkpoint/chat_render),
so the command ends within the bound with a one-line message and exit status 2, no
traceback; the same file with a plain template generates. A real GGUF file (tiny Llama,
trained byte-level BPE tokenizer, the template in `tokenizer.chat_template`) through the real
CLI in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGUFValue, GGUFValueType, GGUFWriter

from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.helpers import build_tiny

REPO = Path(__file__).resolve().parents[2]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = "{{ 'a' * 3000000000 }}"
PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")


def model_file(folder: Path, tokenizer_dir: Path, template: str) -> Path:
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))

    def edit(w: GGUFWriter) -> None:
        w.kv_data[0]["tokenizer.chat_template"] = GGUFValue(template, GGUFValueType.STRING)

    model = build_tiny("llama_tied", folder / "hf", vocab_size=vocab, bos_token_id=0,
                       eos_token_id=1, pad_token_id=2)
    path = folder / "chat.gguf"
    to_gguf(model.hf, path, Q.Q8_0, tokenizer_dir=tokenizer_dir, edit=edit)
    return path


def generate_chat(path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "generate", "--chat", "Hello",
         "--model", str(path), "--max-tokens", "3", "--threads", "1", "--check"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    return proc, time.monotonic() - start


@pytest.mark.parametrize(("template", "message"), [
    (LOOPS, r"took longer than 5 s"),
    (HUGE, r"memory|characters|longer than"),
])
def test_a_hostile_template_is_refused_with_a_message(tmp_path: Path, tokenizer_dir: Path,
                                                      template: str, message: str) -> None:
    import re

    proc, took = generate_chat(model_file(tmp_path, tokenizer_dir, template))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "chat template" in last, proc.stderr[-2000:]
    assert re.search(message, last), last
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout == ""  # nothing was generated
    # Unbounded, the loops would run for hours (or the output take 3 GB): the bound (5 s,
    # once the child has started) holds even on a loaded machine.
    assert took < 120


def test_the_same_file_with_a_plain_template_generates(tmp_path: Path,
                                                       tokenizer_dir: Path) -> None:
    proc, _ = generate_chat(model_file(tmp_path, tokenizer_dir, PLAIN))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[3 tokens in" in proc.stderr, proc.stderr[-2000:]
