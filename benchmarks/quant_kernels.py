"""The candidates for running a quantized matmul on the CPU, measured on Gemma 3 270M's shapes.

For each weight shape of the Gemma 3 270M Q4_K_M file and each number of activation rows M
(1 = one decoding sequence, 32 = 32 of them, 512 = a prefill chunk), one thread, CPU time,
median of `--repeats`:

- sgemm on the weight dequantized to float32 (`F.linear`, MKL): the `none` path;
- torch's grouped int4 kernel `_weight_int4pack_mm_for_cpu` (group 32, float scale + zero: what
  Q4_K maps onto), with float32 and with bfloat16 activations;
- torch's `_weight_int8pack_mm` (one scale per output row only: Q8_0 / Q5_0 / Q6_K do not fit
  it), float32 and bfloat16 activations;
- torch's `_dyn_quant_matmul_4bit` (quantizes the activations to int8 on the fly);
- slotserve's native kernel on the file's own type, `auto` (int8 activations, llama.cpp's
  scheme: `csrc/q8dot.h`) and `exact` (float32 activations: `csrc/qmatmul.c`), each built for
  the best CPU level here and for AVX2 (v3), so the AVX2 code is measured on this machine too.

It prints GFLOP/s (2 * M * N * K per call) and, per candidate, whether it keeps the model's
numbers: only float32 activations with the format's exact values do (bfloat16 activations or
scales, per-row scales and int8 activations change them beyond the format; `auto` changes
them exactly as llama.cpp does). The torch
kernels run on random data of the right shape; their numerics do not matter for their speed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quant_kernels.py [--repeats 5] [--m 1,32,512]
        [--slotserve-only]   # slotserve's kernels alone, GGUF layout and packed (q8repack.h)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from slotserve.models import native_build  # noqa: E402
from slotserve.models.native_qmatmul import (  # noqa: E402
    QuantWeight,
    level_library,
    qmatmul_available,
)

Q = GGMLQuantizationType
# (rows N, columns K, the file's type): Gemma 3 270M Q4_K_M's matrices
SHAPES = [(262144, 640, Q.Q8_0), (4096, 640, Q.Q5_0), (1024, 640, Q.Q5_0), (640, 1024, Q.Q4_K),
          (640, 2048, Q.Q6_K)]


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return 1e3 * statistics.median(times)


def candidates(n: int, k: int, qtype: Q, m: int, only_slotserve: bool
               ) -> list[tuple[str, bool, Callable[[], object]]]:
    """(name, keeps the model's numbers, one call)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    if only_slotserve:
        return slotserve_candidates(n, k, qtype, x)
    xb = x.bfloat16()
    dense = torch.randn(n, k, generator=gen)
    dense_t = dense.t().contiguous().t()  # the layout slotserve's `none` path uses
    out: list[tuple[str, bool, Callable[[], object]]] = [
        ("sgemm float32 (none)", True, lambda: F.linear(x, dense_t))]
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 1)
    sz = torch.randn(k // 32, n, 2, generator=gen)
    out.append(("int4pack fp32 act", qtype == Q.Q4_K, lambda: torch.ops.aten
                ._weight_int4pack_mm_for_cpu(x, int4, 32, sz)))
    szb = sz.bfloat16()
    out.append(("int4pack bf16 act", False, lambda: torch.ops.aten
                ._weight_int4pack_mm_for_cpu(xb, int4, 32, szb)))
    int8 = torch.randint(-128, 127, (n, k), dtype=torch.int8, generator=gen)
    s8 = torch.randn(n, generator=gen)
    out.append(("int8pack fp32 act", False, lambda: torch.ops.aten
                ._weight_int8pack_mm(x, int8, s8)))
    out.append(("int8pack bf16 act", False, lambda: torch.ops.aten
                ._weight_int8pack_mm(xb, int8, s8.bfloat16())))
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(  # two 4-bit values per byte
        torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
        torch.randn(n, k // 32, generator=gen), None, 32, k, n)
    out.append(("dyn_quant 4bit (int8 act)", False, lambda: torch.ops.aten
                ._dyn_quant_matmul_4bit(x, packed, 32, k, n)))
    return out + slotserve_candidates(n, k, qtype, x)


def slotserve_candidates(n: int, k: int, qtype: Q, x: torch.Tensor
                         ) -> list[tuple[str, bool, Callable[[], object]]]:
    """slotserve's kernels at the best level here and at v3 (AVX2), GGUF and packed layouts."""
    out: list[tuple[str, bool, Callable[[], object]]] = []
    if not qmatmul_available():
        return out
    m = x.shape[0]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // block * size), dtype=np.uint8)
    for off in {Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qtype]:
        blocks = raw.reshape(n, k // block, size)
        blocks[:, :, off:off + 2] = np.array([1e-3], np.float16).view(np.uint8)
    y = torch.empty(m, n)
    levels = native_build.supported_levels()
    for level in dict.fromkeys([levels[0], *(lv for lv in levels if lv.name == "v3")]):
        lib = level_library(level)
        for int8 in (True, False):
            w = QuantWeight(torch.from_numpy(raw), int(qtype), k, int8, lib)
            mode = "auto int8" if int8 else "exact f32"
            out.append((f"slotserve {mode} {level.name}", not int8,
                        lambda w=w: w.matmul(x, y)))  # type: ignore[misc]
            if w.can_repack:  # what the loader runs: the interleaved layout (q8repack.h)
                p = w.repacked()
                out.append((f"slotserve {mode} {level.name} packed", False,
                            lambda p=p: p.matmul(x, y)))  # type: ignore[misc]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--m", default="1,32,512")
    p.add_argument("--skip-lm-head", action="store_true", help="leave out 262144 x 640")
    p.add_argument("--slotserve-only", action="store_true",
                   help="only slotserve's kernels (GGUF and packed layouts), not torch's")
    args = p.parse_args()
    torch.set_num_threads(1)
    ms = [int(v) for v in args.m.split(",")]
    print(f"GFLOP/s, 1 thread, CPU time, median of {args.repeats}; * = keeps the numbers")
    for n, k, qtype in SHAPES:
        if args.skip_lm_head and n == 262144:
            continue
        rows: dict[str, list[str]] = {}
        keeps: dict[str, bool] = {}
        for m in ms:
            if n == 262144 and m > 32:
                continue  # the output projection only runs for the rows that sample
            for name, exact, fn in candidates(n, k, qtype, m, args.slotserve_only):
                reps = 1 if name.startswith(("int4pack fp32", "int8pack fp32")) else args.repeats
                ms_ = cpu_ms(fn, reps)
                rows.setdefault(name, []).append(f"M={m}: {2 * m * n * k / ms_ / 1e6:7.1f}")
                keeps[name] = exact
        print(f"\n{n} x {k} ({qtype.name} in the file)")
        for name, cells in rows.items():
            print(f"  {'*' if keeps[name] else ' '} {name:28} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
