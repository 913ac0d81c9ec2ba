"""Mixed-adapter throughput: the same requests on the base model alone and spread over four
LoRA adapters, same run (issue 19's target: mixed >= 0.8x the base).

64 requests (prompts and outputs of uniform 32-128 random tokens, greedy, ignore_eos),
max_num_seqs 32 (concurrency 32), on the bundled model and on a random-weight model shaped like
SmolLM-135M. The base runs on an engine without LoRA (its layers unwrapped); the mixed run on
an engine with `enable_lora=True, max_loras=4`, request i under adapter i % 4 (random PEFT
adapters of rank 16 on all seven projections, written by peft), so every step batches four
adapters. The two engines run alternately for `--rounds` rounds (swapping which goes first);
the ratio is the median of the per-round ratios.

    .venv/bin/python benchmarks/lora_bench.py [--rounds 3] [--threads 1] [--quick]
        [--skip-smollm] [--skip-bundled]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import SMOLLM_SHAPE, build_smollm_shaped, make_workload  # noqa: E402

from slotserve import LoRARequest  # noqa: E402
from slotserve.engine.args import DEFAULT_MODEL  # noqa: E402
from slotserve.entrypoints.llm import LLM  # noqa: E402
from slotserve.model_config import ModelConfig  # noqa: E402
from slotserve.sampling_params import SamplingParams  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model_path: str, root: Path, n: int, rank: int) -> list[LoRARequest]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(1, n + 1):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_path)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                     target_modules=TARGETS,
                                                     init_lora_weights=False))
        peft_model.save_pretrained(root / f"adapter{i}")
        out.append(LoRARequest(f"adapter{i}", i, str(root / f"adapter{i}")))
    return out


def bench(name: str, path: str, vocab: int, n: int, lens: tuple[int, int], rounds: int,
          root: Path) -> float:
    loras = write_adapters(path, root, 4, 16)
    work = make_workload(n, vocab, lens, lens, seed=0)
    inputs = [{"prompt_token_ids": p} for p in work.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
              for k in work.output_lens]
    mixed = [loras[i % 4] for i in range(n)]
    common = dict(dtype="float32", device="cpu", max_num_seqs=32, max_model_len=work.max_len + 1)
    engines = {"base": (LLM(path, **common), None),
               "mixed": (LLM(path, enable_lora=True, max_loras=4, max_lora_rank=16, **common),
                         mixed)}
    for llm, lora in engines.values():  # warm-up: first steps, adapters read and loaded
        llm.generate(inputs[:8], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False, lora_request=lora[:8] if lora else None)
    tok_s: dict[str, list[float]] = {"base": [], "mixed": []}
    cpu_tok_s: dict[str, list[float]] = {"base": [], "mixed": []}
    for r in range(rounds):
        for key in (("base", "mixed") if r % 2 == 0 else ("mixed", "base")):
            llm, lora = engines[key]
            start, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            tok_s[key].append(tokens / wall)
            cpu_tok_s[key].append(tokens / cpu)
    ratios = [m / b for m, b in zip(tok_s["mixed"], tok_s["base"], strict=True)]
    ratio = statistics.median(ratios)
    # Tokens per CPU second of this process: steadier than wall time on a loaded machine.
    cpu_ratios = [m / b for m, b in zip(cpu_tok_s["mixed"], cpu_tok_s["base"], strict=True)]
    print(f"{name}: base {statistics.median(tok_s['base']):.1f} tok/s, 4 adapters mixed "
          f"{statistics.median(tok_s['mixed']):.1f} tok/s; mixed/base {ratio:.2f}x (median of "
          f"{rounds} rounds: {', '.join(f'{x:.2f}' for x in ratios)}); per CPU second "
          f"{statistics.median(cpu_ratios):.2f}x ({', '.join(f'{x:.2f}' for x in cpu_ratios)})")
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="32 requests of 16-64 tokens")
    parser.add_argument("--skip-bundled", action="store_true")
    parser.add_argument("--skip-smollm", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, lens = (32, (16, 64)) if args.quick else (64, (32, 128))
    print(f"torch threads {args.threads}; {n} requests, prompts and outputs uniform in "
          f"{list(lens)}; concurrency 32; {args.rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="slotserve-lora-bench-") as tmp:
        root = Path(tmp)
        if not args.skip_bundled:
            vocab = ModelConfig.from_pretrained(DEFAULT_MODEL).vocab_size
            bench("bundled model", DEFAULT_MODEL, vocab, n, lens, args.rounds, root / "bundled")
        if not args.skip_smollm:
            build_smollm_shaped(root / "smollm")
            bench("SmolLM-135M-shaped (random weights)", str(root / "smollm"),
                  SMOLLM_SHAPE["vocab_size"], n, lens, args.rounds, root / "smollm_adapters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
