"""Microbenchmark of the native paged decode kernel (csrc/paged_decode.c) per KV storage type.

Gemma 3 270M's attention shape by default (4 query heads over 1 KV head, head_dim 256, block
size 16). `--source` builds another copy of the kernel (e.g. main's checkout) so two versions
are timed in one run, as ratios: `python benchmarks/attention_kernel_bench.py --source
/work/main/slotserve/models/csrc/paged_decode.c`. Prints the median of `--reps` calls.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from slotserve.models import native_attention, native_build
from slotserve.models.kv_storage import quantize_rows, row_elems

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8}


def caches(num_blocks: int, bs: int, kvh: int, dim: int, dtype: torch.dtype,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for _ in range(2):
        x = torch.randn(num_blocks, bs, kvh, dim, generator=gen)
        out.append(quantize_rows(x) if dtype == torch.int8 else x.to(dtype))
    assert out[0].shape[-1] == row_elems(dim, dtype)
    return out[0].contiguous(), out[1].contiguous()


def time_kernel(fn: native_attention.KernelFn, args: argparse.Namespace, dtype: torch.dtype
                ) -> float:
    native_attention._native_fn = fn
    gen = torch.Generator().manual_seed(0)
    nblk_seq = -(-args.ctx // args.block_size)
    num_blocks = args.batch * nblk_seq
    k_cache, v_cache = caches(num_blocks, args.block_size, args.kv_heads, args.head_dim,
                              dtype, gen)
    table = torch.randperm(num_blocks, generator=gen).reshape(args.batch, nblk_seq)
    ctx = torch.full((args.batch,), args.ctx, dtype=torch.int64)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen)
    out = torch.empty(args.batch, args.heads * args.head_dim)
    scratch = torch.empty(1, args.heads * args.ctx)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        native_attention.paged_decode(q, k_cache, v_cache, table, ctx, None,
                                      args.head_dim ** -0.5, out, scratch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--source", type=Path, help="another paged_decode.c to time beside this one")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=21)
    args = p.parse_args()
    torch.set_num_threads(1)
    cc = native_build.find_compiler()
    assert cc is not None, "no C compiler"
    kernels = {"this": native_attention.KERNEL}
    if args.source is not None:
        kernels["other"] = replace(native_attention.KERNEL, source=args.source.resolve())
    with tempfile.TemporaryDirectory() as tmp:
        fns = {name: native_attention._load(native_build.compile_library(k, cc, Path(tmp)))
               for name, k in kernels.items()}
        print(f"level {native_build.cpu_level().name}, batch {args.batch}, ctx {args.ctx}, "
              f"heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}: median ms")
        for name, dtype in DTYPES.items():
            ms = {k: time_kernel(fn, args, dtype) for k, fn in fns.items()}
            ratio = f"  other/this {ms['other'] / ms['this']:.2f}x" if "other" in ms else ""
            print(f"{name:>9}: " + "  ".join(f"{k} {v:.3f}" for k, v in ms.items()) + ratio)


if __name__ == "__main__":
    main()
