"""Where a served token's time goes: the CPU time each process of `slotserve serve` (the front,
the engine core child, the chat-template child) spends per output token while streaming
greedy completions of the real Gemma 3 270M GGUF file, against the CPU time of one decode
step of the same model measured in the same run (`decode_step_profile.py`'s execute_model).

CPU time, not wall time, so a loaded machine (other processes taking the cores) does not
hide the serving path's own cost: `core / step` is what the core spends per token beyond the
model step (scheduling, input preparation, sampling, output building, the pipe; the prompt's
prefill is included, spread over the output tokens), and `front` is what the HTTP side
spends per token (uvicorn, the OpenAI layer, detokenizing, SSE), which a second core absorbs.
The wall TPOT is printed too, with the load average it was measured under.

    .venv/bin/python benchmarks/serve_cpu.py [--concurrency 1] [--requests 4]
        [--output-len 128] [--threads 1] [--skip-step]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from procs import free_port, gemma_file, stop, wait_healthy  # noqa: E402

from slotserve.entrypoints import bench_serve  # noqa: E402

SLOTSERVE = Path(sys.executable).parent / "slotserve"
PROMPT_LEN = 128


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes(pid: int) -> dict[str, int]:
    """The server's processes by role."""
    out = {"front": pid}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            role = ("chat-render" if "chat_render" in cmd else "core" if "core_process" in cmd
                    else None)
            if role is not None:
                out[role] = int(child)
    return out


def step_ms(threads: int) -> float:
    """Median CPU ms of one decode step (batch 1, ctx 256) of the same file."""
    res = subprocess.run([sys.executable, str(REPO / "benchmarks/decode_step_profile.py"),
                          "--gemma", "--batch", "1", "--ctx", "256", "--threads", str(threads)],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    match = re.search(r"execute_model\s+([\d.]+) ms", res.stdout)
    if match is None:
        raise SystemExit(f"no step time in decode_step_profile's output:\n{res.stdout}")
    return float(match.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-step", action="store_true", help="do not measure the decode step")
    args = p.parse_args()
    model, port = gemma_file(), free_port()
    per_seq = PROMPT_LEN + args.output_len + 16
    cmd = [str(SLOTSERVE), "serve", "--model", model, "--port", str(port),
           "--threads", str(args.threads), "--max-num-seqs", str(args.concurrency),
           "--max-model-len", str(per_seq), "--block-size", "16",
           "--num-blocks", str(args.concurrency * math.ceil(per_seq / 16) + 1),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)),
                            stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 600.0)
        requests = bench_serve.make_dataset(args.requests + 1, PROMPT_LEN, args.output_len, 0.0,
                                            bench_serve.model_vocab_size(model), 0)
        served = bench_serve.served_model(url, None)
        client = argparse.Namespace(max_concurrency=args.concurrency, seed=0, temperature=0.0,
                                    api_key=None)
        bench_serve.run_http(url, served, requests[:1], math.inf, client, "warmup")
        pids = processes(proc.pid)
        before = {role: cpu_s(pid) for role, pid in pids.items()}
        load = os.getloadavg()[0]
        result = bench_serve.run_http(url, served, requests[1:], math.inf, client,
                                      f"c={args.concurrency}")
        used = {role: cpu_s(pid) - before[role] for role, pid in pids.items()}
    finally:
        stop(proc)
    tokens = args.requests * args.output_len
    tpot = result["tpot_ms"]["median"]
    print(f"concurrency {args.concurrency}, {args.requests} requests of {PROMPT_LEN} + "
          f"{args.output_len} tokens, {args.threads} thread(s), load average {load:.1f}")
    for role, seconds in used.items():
        print(f"  {role:12s} {seconds * 1000 / tokens:7.2f} ms CPU per output token")
    print(f"  TPOT (wall)  {tpot:7.2f} ms median")
    if not args.skip_step:
        step = step_ms(args.threads)
        core = used["core"] * 1000 / tokens
        print(f"  decode step  {step:7.2f} ms CPU (batch 1, ctx 256)")
        if args.concurrency == 1:
            print(f"  core CPU per token / step: {core / step:.2f}x; "
                  f"TPOT / step: {tpot / step:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
