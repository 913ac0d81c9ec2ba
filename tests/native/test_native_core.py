"""The native runner (slotserve/native): an engine core without torch for GGUF files on the CPU.

- Its steps are the torch model's decode path: with torch's RoPE tables, every token and
  logprob of a native engine equals a torch engine's that runs each token as a decode (one
  token a step), for the same weights in K-quant and 8-bit blocks.
- A prompt's rows attend as decodes: a prefill in one pass is the same, bit for bit, as the
  prompt fed one token at a time.
- An engine built with it holds no torch, and `--model-impl` picks it or refuses clearly.
(Against the float32 reference on the real Gemma file: tests/checkpoint/test_gemma_quantized.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from slotserve import LLM, SamplingParams
from slotserve.engine.args import DEFAULT_MODEL, EngineArgs
from slotserve.engine.core import EngineCore
from slotserve.errors import ConfigError
from slotserve.model_config import RopeConfig
from slotserve.models.layers import rope_tables
from slotserve.native import model as native_model
from slotserve.native.model import NativeModel
from slotserve.native.runner import NativeRunner
from slotserve.worker.model_runner import ModelRunner
from tests.checkpoint.conftest import BundledGGUF
from tests.checkpoint.gguf_convert import Q
from tests.helpers import REPO
from tests.native.conftest import NativeGGUF

PROMPTS = ["To be, or not", "My lord, the king doth", "O Romeo, Romeo, wherefore"]


def torch_tables(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                 positions: int) -> tuple[np.ndarray, np.ndarray]:
    cos, sin = rope_tables(rope, head_dim, max_position_embeddings, positions, torch.float32,
                           torch.device("cpu"))
    return cos.numpy().copy(), sin.numpy().copy()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_native_engine_is_the_torch_decode_path(native_gguf: NativeGGUF, arch: str, qtype: Q,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_model, "rope_tables", torch_tables)
    path = str(native_gguf(arch, qtype))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    common = dict(model=path, kv_cache_dtype="float32", num_blocks=64, max_model_len=128,
                  check=True)
    native = LLM(**common, model_impl="native", max_num_seqs=4)
    assert isinstance(native.llm_engine.engine_core.engine_core.model_runner, NativeRunner)
    got = native.generate(PROMPTS, params)
    # One token a step: every prompt token runs as a decode (the native layers' call).
    reference = LLM(**common, model_impl="torch", max_num_seqs=1, max_num_batched_tokens=1)
    want = reference.generate(PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        # The same logits; each sampler's log-softmax rounds its own way (numpy's, torch's).
        for mine, theirs in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or [],
                                strict=True):
            assert mine.keys() == theirs.keys()
            assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prompt_rows_attend_as_decodes(native_gguf: NativeGGUF, arch: str) -> None:
    path = native_gguf(arch, Q.Q8_0)
    ids = np.array([1, 320, 1011, 30, 355, 436, 355, 1183, 7, 15, 88, 3, 19, 200, 17, 5, 9, 41],
                   dtype=np.int64)
    n, bs = len(ids), 4
    table = np.arange(1, 8, dtype=np.int64)[None, :]
    slot = table[0][np.arange(n) // bs] * bs + np.arange(n) % bs

    def fresh() -> NativeModel:
        m = NativeModel(path, max_positions=64)
        m.allocate_kv_cache(16, bs, "float16")
        return m

    whole = fresh()
    pos = np.arange(n, dtype=np.int64)
    h = whole.forward(ids, pos, slot, np.repeat(table, n, axis=0), pos + 1)
    at_once = whole.compute_logits(np.ascontiguousarray(h[-1:]))
    stepped = fresh()
    for p in range(n):
        one = np.array([p], dtype=np.int64)
        h = stepped.forward(ids[p:p + 1].copy(), one, slot[p:p + 1].copy(), table.copy(),
                            one + 1)
    assert np.array_equal(stepped.compute_logits(h), at_once)


CORE = """
import json, sys
from slotserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], num_blocks=64, max_model_len=128, max_num_seqs=2)
out = llm.generate(["To be, or not"], SamplingParams(temperature=0.0, max_tokens=8))
runner = llm.llm_engine.engine_core.engine_core.model_runner
print(json.dumps({"runner": type(runner).__name__, "torch": "torch" in sys.modules,
                  "tokens": len(out[0].outputs[0].token_ids)}))
"""


@pytest.mark.timeout(300)
def test_an_engine_on_a_gguf_file_holds_no_torch(tmp_path: Path,
                                                 native_gguf: NativeGGUF) -> None:
    res = subprocess.run([sys.executable, "-c", CORE, str(native_gguf("gemma3", Q.Q4_K))],
                         cwd=REPO,
                         check=True, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=str(REPO),
                                  SLOTSERVE_CACHE_DIR=str(tmp_path / "cache")))
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"runner": "NativeRunner", "torch": False, "tokens": 8}


def test_model_impl_chooses_or_refuses(native_gguf: NativeGGUF,
                                       bundled_gguf: BundledGGUF) -> None:
    gguf = str(native_gguf("llama", Q.Q8_0))
    small = dict(num_blocks=16, max_model_len=32, max_num_seqs=1)
    # The bundled model's 688-wide MLP rows are no whole blocks: stored F16, no int8 kernel.
    dense = str(bundled_gguf(Q.Q8_0))
    with pytest.raises(ConfigError, match="model-impl native: .*F16.* has no int8 kernel"):
        EngineCore.from_engine_args(EngineArgs.from_kwargs(model=dense, model_impl="native",
                                                           **small))
    core = EngineCore.from_engine_args(EngineArgs.from_kwargs(model=dense, **small))
    assert type(core.model_runner) is ModelRunner
    with pytest.raises(ConfigError, match="model-impl native: not a GGUF file"):
        EngineCore.from_engine_args(EngineArgs.from_kwargs(model=DEFAULT_MODEL,
                                                           model_impl="native", **small))
    with pytest.raises(ConfigError, match="model_impl must be one of"):
        EngineArgs.from_kwargs(model=gguf, model_impl="jax")
    for kwargs, runner in ((dict(), NativeRunner), (dict(model_impl="torch"), ModelRunner),
                           (dict(quantization="exact"), ModelRunner),
                           (dict(model=DEFAULT_MODEL), ModelRunner)):
        core = EngineCore.from_engine_args(EngineArgs.from_kwargs(**{"model": gguf, **small,
                                                                     **kwargs}))
        assert type(core.model_runner) is runner, kwargs
