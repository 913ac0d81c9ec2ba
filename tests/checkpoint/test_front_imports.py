"""What the front of an engine whose core runs in a child process (the server's front) holds
in memory: it tokenizes and streams, so it imports neither torch nor the checkpoint readers
(numpy, gguf) nor the grammar library until a request needs one. The model's config comes
from the core, which read it with the weights, and equals what the checkpoint says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.conftest import BundledGGUF
from tests.checkpoint.gguf_convert import Q
from tests.helpers import REPO

# A fresh interpreter, as `slotserve serve`'s front is.
CODE = """
import asyncio, dataclasses, json, sys
import slotserve.entrypoints.openai.api_server  # the server's own modules, all of them
from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams

HEAVY = ("torch", "numpy", "gguf", "llguidance")
llm = AsyncLLM.from_engine_args(engine_mode="process", threads=1, model=sys.argv[1],
                                num_blocks=32, max_num_seqs=2, max_model_len=128)

async def main():
    async def last(params, rid):
        parts = [o.outputs[0].text async for o in llm.generate("To be, or not", params, rid)]
        return "".join(parts)  # the stream's deltas

    plain = await last(SamplingParams(max_tokens=4, temperature=0), "plain")
    held = sorted(m for m in HEAVY if m in sys.modules)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    constrained = await last(SamplingParams(max_tokens=4, temperature=0,
                                            structured_outputs=choice), "choice")
    return plain, held, constrained

try:
    plain, after_plain, constrained = asyncio.run(main())
    config = dataclasses.asdict(llm.engine.model_config)
finally:
    llm.shutdown()
print(json.dumps({"plain": plain, "after_plain": after_plain, "constrained": constrained,
                  "llguidance": "llguidance" in sys.modules, "config": config}))
"""


@pytest.mark.timeout(300)
def test_the_front_imports_only_what_it_uses(tmp_path: Path,
                                            bundled_gguf: BundledGGUF) -> None:
    import dataclasses

    from slotserve.checkpoint import resolve_checkpoint

    path = bundled_gguf(Q.Q8_0)
    res = subprocess.run([sys.executable, "-c", CODE, str(path)], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=str(REPO),
                                  SLOTSERVE_CACHE_DIR=str(tmp_path / "cache")))
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["plain"]  # it served a request ...
    assert out["after_plain"] == []  # ... holding none of them
    # A constraint imports the grammar library where it is checked, and is kept.
    assert out["llguidance"] is True
    assert out["constrained"] in ("yes", "no")
    # The config the core sent is the checkpoint's.
    assert out["config"] == json.loads(json.dumps(
        dataclasses.asdict(resolve_checkpoint(path).config)))
