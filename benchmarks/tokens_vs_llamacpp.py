"""Prompt token ids: slotserve's tokenizer (built from the GGUF file's metadata) against
llama.cpp's own (`llama-server`'s /tokenize, special tokens added and parsed) on the same file.

    bash benchmarks/setup_llamacpp.sh          # once: builds llama-server
    .venv/bin/python benchmarks/tokens_vs_llamacpp.py [--llama-server PATH] [--model PATH]

Prints each prompt's verdict and exits 1 if any differs. Not part of the test suite: CI has no
llama.cpp (tests/checkpoint compares the same ids with transformers').
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from procs import gemma_file  # noqa: E402
from vs_llamacpp import LLAMACPP_DIR, start_llamacpp  # noqa: E402

from slotserve.checkpoint import load_tokenizer  # noqa: E402

PROMPTS = [
    "To be, or not to be, that is the question:",
    "Hello world",
    " leading space and  double  spaces\n\nnew lines\ttab",
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé — “quotes” and emoji 🦙🚀 and 日本語のテキスト and العربية",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "1234567890 3.14159 1e-10 0x1F",
    "",
    "   ",
    "https://example.com/path?q=1&r=two#frag",
    "A" * 300,
    "The quick brown fox jumps over the lazy dog. " * 20,
]


def llamacpp_ids(port: int, text: str) -> list[int]:
    body = json.dumps({"content": text, "add_special": True, "parse_special": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return list(json.load(r)["tokens"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", default=str(LLAMACPP_DIR / "build/bin/llama-server"))
    p.add_argument("--model", default=None, help="GGUF file (default: the Gemma package's)")
    args = p.parse_args()
    args.model = args.model or gemma_file()
    tokenizer = load_tokenizer(args.model)
    # One sequence of 1024 tokens, one thread: only the tokenizer is used.
    server = start_llamacpp(argparse.Namespace(
        llama_server=args.llama_server, model=args.model, prompt_len=1000, output_len=8,
        threads=1), 1)
    try:
        server.wait_healthy()
        same = 0
        for text in PROMPTS:
            ref, got = llamacpp_ids(server.port, text), list(tokenizer(text)["input_ids"])
            same += ref == got
            verdict = "same" if ref == got else f"DIFF llama.cpp {ref[:10]} slotserve {got[:10]}"
            print(f"{len(ref):4d} tokens  {text[:40]!r:45s} {verdict}")
    finally:
        server.stop()
    print(f"{same}/{len(PROMPTS)} prompts: identical token ids (BOS included)")
    sys.exit(0 if same == len(PROMPTS) else 1)


if __name__ == "__main__":
    main()
