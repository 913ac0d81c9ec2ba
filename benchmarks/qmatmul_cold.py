"""One packed int8 product read hot (the same weight again and again: in cache) and cold
(cycling through copies that together pass the last-level cache, as a decode step reads its
layers after the output projection evicted them), per Gemma 3 270M's layer shapes. What it
shows: whether a kernel overlaps its arithmetic with the read from DRAM (cold close to hot)
or waits for it (cold about hot + the read). Compare prefetch policies with
`SLOTSERVE_PREFETCH=BYTES,ROWS,Q4K_L2_BYTES` in alternating runs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/qmatmul_cold.py [--rows 1] [--mib 80]

Random blocks (scales set to small float16 values); 1 thread; the best of 5 passes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slotserve.models.native_qmatmul import (  # noqa: E402
    KERNEL_TYPES,
    QuantWeight,
    block_layout,
    prefetch_policy,
    qmatmul_available,
)
from slotserve.models.native_qmatmul_plan import QMatmulPlan  # noqa: E402

# GGML type -> byte offsets of its float16 scales in a block (the block's size and values
# come from the kernel: block_layout).
F16_SCALES = {12: (0, 2), 14: (208,), 6: (0,)}
SHAPES = [(12, 640, 1024), (12, 640, 2048), (14, 640, 2048), (6, 4096, 640)]


def make(rng: np.random.Generator, qtype: int, n: int, k: int) -> QMatmulPlan:
    block, size = block_layout(qtype)
    b = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for o in F16_SCALES[qtype]:  # 2^-7: finite scales
        b[:, :, o], b[:, :, o + 1] = 0x00, 0x20
    w = QuantWeight(torch.from_numpy(b.reshape(n, -1).copy()), qtype, k).repacked()
    return QMatmulPlan([(w, 0)], n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1, help="activation rows")
    parser.add_argument("--mib", type=float, default=80, help="bytes of copies read cold")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not qmatmul_available():
        print("the quantized matmul kernel did not build")
        return 1
    print(f"prefetch policy {prefetch_policy()}, {args.rows} row(s)")
    rng = np.random.default_rng(0)
    for qtype, n, k in SHAPES:
        block, size = block_layout(qtype)
        nbytes = n * k // block * size
        plans = [make(rng, qtype, n, k) for _ in range(max(8, int(args.mib * 2**20 // nbytes)))]
        x, y = torch.randn(args.rows, k), torch.empty(args.rows, n)
        line = f"{KERNEL_TYPES[qtype]} {n:5d} x {k:5d}"
        for mode in ("hot", "cold"):
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for i in range(len(plans)):
                    plans[0 if mode == "hot" else i].run(x, y)
                best = min(best, (time.perf_counter() - t) / len(plans))
            line += f"  {mode} {best * 1e6:6.1f} us ({nbytes / best / 1e9:4.1f} GB/s)"
        print(line, flush=True)
        del plans
    return 0


if __name__ == "__main__":
    sys.exit(main())
