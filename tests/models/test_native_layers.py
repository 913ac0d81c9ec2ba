"""A decode step's layers in one native call (models/native_layers.py, csrc/q8layers.h) give
bit for bit the module path's results: the same greedy tokens and the same logprobs, on
Gemma 3 (sandwich norms, sliding windows that start mid-block, two RoPE kinds), Llama and
Qwen 3 (per-head q/k norms), on one and two threads, on float32 and int8 KV caches, through
batched steps whose decodes run natively and whose prefill chunks take the modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.models import native_build
from slotserve.models.native_attention import NativeKernelError
from slotserve.models.native_layers import DecodeLayers
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.checkpoint.test_gguf_weights import GGUF_OVERRIDES
from tests.helpers import ManualScheduler, build_tiny

# Rows of 256 values (hidden 256, intermediate 512) so the k-quants fit where k allows.
SHAPE = dict(hidden_size=256, intermediate_size=512)
TYPES = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
PROMPTS = [[5, 9, 20, 7], list(range(10, 41)), [100, 3, 3, 250, 17, 60, 61]]


@pytest.fixture(scope="module", params=["gemma3", "llama", "qwen3"])
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Path:
    if native_build.find_compiler() is None:
        pytest.skip("no C compiler: no native kernels")
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = build_tiny(name, folder / "hf", **{**SHAPE, **GGUF_OVERRIDES.get(name, {})})
    layers = model.hf.config.num_hidden_layers
    types = {f"blk.{i}.{t}.weight": q for i in range(layers) for t, q in TYPES.items()}
    to_gguf(model.hf, folder / "m.gguf", Q.Q8_0, types=types)
    return folder / "m.gguf"


def generate(path: Path, native: bool, threads: int, kv: str = "auto", copies: int = 1
             ) -> tuple[ManualScheduler, int]:
    """Greedy tokens and top-5 logprobs of the prompts (each `copies` times), batched with
    chunked prefills; and how many steps the native call ran."""
    prompts = PROMPTS * copies
    runner = ModelRunner(path, SchedulerConfig(max_num_seqs=max(4, len(prompts)),
                                               max_model_len=128),
                         CacheConfig(block_size=4, num_blocks=256 * copies, cache_dtype=kv),
                         dtype="float32", device="cpu", quantization="auto")
    ran = 0
    layers = runner.model.decode_layers
    assert isinstance(layers, DecodeLayers), "the native glue and attention were chosen"
    if not native:
        runner.model.decode_layers = None
    else:
        run = layers.run

        def counted(*args: object) -> bool:
            nonlocal ran
            took = run(*args)  # type: ignore[arg-type]
            ran += took
            return took

        layers.run = counted  # type: ignore[method-assign]
    sched = ManualScheduler(block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, params, max_tokens=12)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sched.run(runner, chunk=5)
    finally:
        torch.set_num_threads(before)
    return sched, ran


# copies=12: 36 sequences a step, so the threads also share the row-wise glue and the
# activations' quantization (csrc/q8layers.h, q8call.h: from 16 and 32 rows).
@pytest.mark.parametrize("threads,kv,copies", [(1, "auto", 1), (2, "auto", 1), (1, "int8", 1),
                                               (2, "auto", 12)])
def test_native_layers_equal_the_modules(gguf_file: Path, threads: int, kv: str,
                                         copies: int) -> None:
    ref, _ = generate(gguf_file, native=False, threads=threads, kv=kv, copies=copies)
    got, ran = generate(gguf_file, native=True, threads=threads, kv=kv, copies=copies)
    assert ran >= 8, "the decode steps ran natively"
    for rid, want in ref.requests.items():
        assert got.requests[rid].outputs == want.outputs, rid
        assert got.requests[rid].logprobs == want.logprobs, rid  # bit for bit


def test_a_bad_block_id_is_an_error_not_a_read(gguf_file: Path) -> None:
    """The kernels' own checks of what only the data can tell still run, and name the call."""
    runner = ModelRunner(gguf_file, SchedulerConfig(max_num_seqs=4, max_model_len=128),
                         CacheConfig(block_size=4, num_blocks=64), dtype="float32",
                         device="cpu", quantization="auto")
    sched = ManualScheduler(block_size=4, num_blocks=64)
    sched.add("r0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
              max_tokens=4)
    sched.run(runner, chunk=None)
    layers = runner.model.decode_layers
    assert isinstance(layers, DecodeLayers)
    h = torch.zeros(1, runner.model.config.hidden_size)
    hd = runner.model.config.head_dim
    rope = tuple(torch.zeros(1, 1, hd) for _ in range(4))
    import numpy as np

    from slotserve.models.attention import BatchLayout

    table = np.full((1, 8), 10_000, dtype=np.int64)  # past the cache
    layout = BatchLayout(block_table=table, slots=np.array([0]), q_lens=np.array([1]),
                         num_computed=np.array([3]), num_decodes=1, block_size=4,
                         slot_mapping=torch.tensor([0]))
    meta = runner.model.build_attention_metadata(layout)
    with pytest.raises(NativeKernelError, match="layer 0, attention"):
        layers.run(runner.model, h, rope, runner.kv_caches, meta)


def test_lora_wrapped_projections_take_the_modules(gguf_file: Path) -> None:
    """With LoRA on, every projection is wrapped (adapters wrap at start, before the table is
    built): the native call, which knows no adapter deltas, must decline every step."""
    from slotserve.lora.request import LoRAConfig

    runner = ModelRunner(gguf_file, SchedulerConfig(max_num_seqs=4, max_model_len=128),
                         CacheConfig(block_size=4, num_blocks=64), dtype="float32",
                         device="cpu", quantization="auto",
                         lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))
    layers = runner.model.decode_layers
    assert isinstance(layers, DecodeLayers)
    took: list[bool] = []
    run = layers.run

    def counted(*args: object) -> bool:
        took.append(run(*args))  # type: ignore[arg-type]
        return took[-1]

    layers.run = counted  # type: ignore[method-assign]
    sched = ManualScheduler(block_size=4, num_blocks=64)
    sched.add("r0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              max_tokens=6)
    sched.run(runner, chunk=None)
    assert len(took) >= 5 and not any(took), "every decode step went through the modules"
    assert layers._failed is not None and "projection" in layers._failed
