"""Which engines the native runner serves, and building its half of an engine core
(`EngineCore.from_engine_args` asks here before it imports torch).

`--model-impl auto` (the default) takes the native runner for a GGUF file on the CPU with
`--quantization auto` in float32, the path whose steps already ran in the native kernels,
and keeps torch for the rest: Hugging Face folders, `exact` / `none`, other dtypes, a GPU,
LoRA adapters. Without torch the engine core holds the weights, the KV cache and the Python
around them (about 150 MB less resident memory for Gemma 3 270M; docs/MEMORY.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np

from slotserve.checkpoint import find_gguf
from slotserve.config import EngineConfig, kv_cache_dtype_name, kv_row_elems
from slotserve.engine.args import EngineArgs
from slotserve.engine.loading import load_model_config
from slotserve.native.model import KV_DTYPES, NativeModel
from slotserve.native.runner import NativeRunner
from slotserve.worker import kv_budget

logger = logging.getLogger(__name__)


def gpu_present() -> bool:
    """Whether `--device auto` would pick a GPU (an NVIDIA device node that
    CUDA_VISIBLE_DEVICES does not hide), without importing torch to ask."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def default_threads() -> int:
    """The threads torch would use: OMP_NUM_THREADS, else the cores this process may run on."""
    try:
        forced = int(os.environ.get("OMP_NUM_THREADS", "0"))
    except ValueError:
        forced = 0
    if forced > 0:
        return forced
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def native_why_not(args: EngineArgs) -> str | None:
    """Why these arguments need the torch model (None: the native runner serves them)."""
    if args.model_impl == "torch":
        return "--model-impl torch"
    if args.quantization != "auto":
        return f"--quantization {args.quantization} runs on the torch model"
    if args.dtype not in ("auto", "float32"):
        return f"--dtype {args.dtype}: the native kernels run float32 activations"
    if args.device not in ("auto", "cpu") or (args.device == "auto" and gpu_present()):
        return "the model runs on a GPU"
    if args.enable_lora:
        return "LoRA adapters run on the torch model"
    if not args.native_attention:
        return "decode attention is kept on the torch path"
    if find_gguf(args.model_path()) is None:
        return "not a GGUF file"
    return None


def build_native(args: EngineArgs, threads: int | None) -> tuple[EngineConfig, NativeRunner]:
    """The engine's config and its native runner (NativeUnsupported: the model or machine
    has none; the caller falls back to torch under `--model-impl auto`)."""
    path = args.model_path()
    cfg = load_model_config(path)
    bound = args.max_model_len_bound(cfg.max_position_embeddings)
    model = NativeModel(path, max_positions=bound + 1, threads=threads or default_threads())
    kv = kv_cache_dtype_name(args.kv_cache_dtype, "float32", gguf=True)
    storage = np.dtype(KV_DTYPES[kv])
    per_block = kv_budget.block_bytes(cfg, args.block_size,
                                      kv_row_elems(cfg.head_dim, kv) * storage.itemsize)
    # Sized after the weights are in memory, as the torch path does.
    num_blocks = kv_budget.determine_num_blocks(
        per_block, args.block_size, args.num_blocks, args.kv_cache_memory, args.max_num_seqs,
        bound, kv_budget.available_host_memory, cuda=False)
    config = args.create_engine_config(cfg.max_position_embeddings, num_blocks)
    config = dataclasses.replace(
        config, cache_config=dataclasses.replace(config.cache_config, cache_dtype=kv),
        dtype="float32", device="cpu", model_config=cfg)
    model.allocate_kv_cache(num_blocks, args.block_size, kv)
    logger.info("native runner (no torch): weights %.1f MiB, KV cache %.1f MiB for %d "
                "blocks, %d thread(s)", model.weight_bytes() / 2**20,
                model.kv_cache_bytes() / 2**20, num_blocks, model.threads)
    return config, NativeRunner(model, config)
