"""The CUDA paths, where a GPU is present (marked `cuda`; skipped without one): paged attention
against dense attention, quantized GGUF weights dequantized at load (no kernel runs them on a
GPU: `quantization.py` says why), and greedy decoding equal to transformers' on the CPU.

Float32 throughout: torch does not use TF32 for float32 matmuls unless asked to, so the GPU's
numbers differ from the CPU's by summation order only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.models.loader import load_model
from slotserve.models.quantization import dense_parameters, quantized_names
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.helpers import ManualScheduler, TinyModel, build_tiny, hf_greedy
from tests.models.test_paged_attention import STEP, run_step

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]
CUDA = torch.device("cuda")
NEW_TOKENS = 16
PROMPTS = [[5, 9, 20, 7], list(range(10, 41)), [100, 3, 3, 250, 17, 60, 61]]


@pytest.mark.parametrize("window", [None, 6, 3])
@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [(4, 4, 1, 32), (8, 6, 2, 16)])
def test_attention_matches_dense_on_cuda(window: int | None, block_size: int, heads: int,
                                         kv_heads: int, head_dim: int) -> None:
    # native=False: the C kernel is CPU-only; run_step asserts the backend did not pick it.
    got, refs = run_step(False, window, block_size, heads, kv_heads, head_dim, device=CUDA)
    for (nc, n), g, ref in zip(STEP, got, refs, strict=True):
        torch.testing.assert_close(g, ref, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, nc=nc, n=n: f"({nc}, {n}): {m}")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_quantized_weights_are_dequantized_on_cuda(tmp_path: Path, qtype: Q,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    model = build_tiny("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512)
    path = tmp_path / "m.gguf"
    to_gguf(model.hf, path, qtype)
    with caplog.at_level(logging.INFO, logger="slotserve.models.quantization"):
        gpu, _ = load_model(path, dtype="float32", device="cuda")  # quantization "auto"
    assert any("dequantized at load: on cuda" in r.getMessage() for r in caplog.records)
    assert not quantized_names(gpu)
    assert all(p.device.type == "cuda" for p in gpu.parameters())
    cpu, _ = load_model(path, dtype="float32", device="cpu", quantization="none")
    a, b = dense_parameters(gpu), dense_parameters(cpu)
    assert a.keys() == b.keys()
    for name in a:  # gguf's dequantized values, moved to the GPU unchanged
        assert torch.equal(a[name].cpu(), b[name]), name


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_greedy_matches_transformers_on_cuda(tiny_models: dict[str, TinyModel],
                                             name: str) -> None:
    model = tiny_models[name]
    runner = ModelRunner(model.path, SchedulerConfig(max_num_seqs=4, max_model_len=128),
                         CacheConfig(block_size=4, num_blocks=256), dtype="float32",
                         device="cuda")
    assert not runner.native_decode
    sched = ManualScheduler(block_size=4)
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=NEW_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
    sched.run(runner, chunk=5)  # chunked prefills after a cached prefix, mixed with decodes
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = hf_greedy(model.hf, prompt, NEW_TOKENS)  # on the CPU
        req = sched.requests[f"r{i}"]
        assert req.outputs == tokens, f"prompt {i}"
        for tok, entry, ref in zip(tokens, req.logprobs, logprobs, strict=True):
            assert abs(entry[tok] - ref[tok].item()) < 1e-3
    assert len(runner.slots) == 0
