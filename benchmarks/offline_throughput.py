"""Offline throughput: slotserve vs Hugging Face `generate`, same requests, same run.

64 requests (prompts of uniform 32-256 random token ids, outputs of uniform 32-256 tokens,
ignore_eos, greedy), `max_num_seqs` 32, on

- a random-weight model shaped like SmolLM-135M (built and saved into a temp dir), and
- the bundled Shakespeare model.

The baseline runs `transformers` `generate` in static batches of 32, left-padded with an
attention mask and `min_new_tokens = max_new_tokens` = the batch's longest output, so every
batch does the same work a real static batcher would; only each request's own output length
counts as useful tokens. Engine overhead is the share of slotserve's wall time spent outside
the model's forward pass and sampling (ModelRunner.last_forward_s, summed over steps).

    .venv/bin/python benchmarks/offline_throughput.py [--threads 1] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
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
class Result:
    slotserve_tok_s: float
    hf_tok_s: float
    ratio_vs_hf: float
    engine_overhead_frac: float
    slotserve_s: float
    hf_s: float
    output_tokens: int
    num_steps: int


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


def run_slotserve(path: str, work: Workload, max_num_seqs: int) -> tuple[float, float, int, int]:
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
              max_model_len=work.max_len + 1)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    inputs = [{"prompt_token_ids": p} for p in work.prompts]
    llm.generate(inputs[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    core = llm.llm_engine.engine_core
    core.total_forward_s, core.num_steps = 0.0, 0
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(work.output_lens), "slotserve did not produce every requested token"
    return elapsed, core.total_forward_s, produced, core.num_steps


def run_hf(path: str, work: Workload, batch_size: int) -> tuple[float, int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = 0

    def generate(prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=pad, eos_token_id=None)

    generate(work.prompts[:2], 4)  # warm-up
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(work.prompts), batch_size):
        lens = work.output_lens[i:i + batch_size]
        out = generate(work.prompts[i:i + batch_size], max(lens))
        assert out.shape[1] - max(len(p) for p in work.prompts[i:i + batch_size]) == max(lens)
        useful += sum(lens)
    return time.perf_counter() - start, useful


def bench_model(name: str, path: str, work: Workload, max_num_seqs: int) -> Result:
    print(f"\n== {name}: {len(work.prompts)} requests, "
          f"{sum(len(p) for p in work.prompts)} prompt / {sum(work.output_lens)} output tokens",
          flush=True)
    ss_s, forward_s, produced, steps = run_slotserve(path, work, max_num_seqs)
    ss_tok_s = produced / ss_s
    print(f"slotserve: {ss_s:7.1f} s  {ss_tok_s:8.1f} output tok/s  ({steps} steps, "
          f"forward {forward_s:.1f} s)", flush=True)
    hf_s, useful = run_hf(path, work, max_num_seqs)
    hf_tok_s = useful / hf_s
    print(f"HF generate (static batches of {max_num_seqs}): {hf_s:7.1f} s  {hf_tok_s:8.1f} "
          "useful output tok/s", flush=True)
    overhead = max(0.0, 1.0 - forward_s / ss_s)
    ratio = ss_tok_s / hf_tok_s
    print(f"ratio slotserve / HF: {ratio:.2f}x   engine overhead: {overhead:.1%} of wall time",
          flush=True)
    return Result(ss_tok_s, hf_tok_s, ratio, overhead, ss_s, hf_s, produced, steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--quick", action="store_true",
                        help="16 requests, prompts and outputs of 16-64 tokens")
    parser.add_argument("--skip-bundled", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    n = args.num_requests or (16 if args.quick else 64)
    lens = (16, 64) if args.quick else (32, 256)
    print(f"torch threads: {args.threads}; requests: {n}; prompt and output lengths uniform in "
          f"{list(lens)}; max_num_seqs {args.max_num_seqs}")
    report: dict[str, Any] = {"threads": args.threads, "num_requests": n,
                              "lengths": list(lens), "max_num_seqs": args.max_num_seqs}
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-") as tmp:
        build_smollm_shaped(Path(tmp))
        work = make_workload(n, SMOLLM_SHAPE["vocab_size"], lens, lens, args.seed)
        report.update(asdict(bench_model("SmolLM-135M-shaped (random weights)", tmp, work,
                                         args.max_num_seqs)))
    if not args.skip_bundled:
        from slotserve.models.config import ModelConfig

        vocab = ModelConfig.from_pretrained(DEFAULT_MODEL).vocab_size
        work = make_workload(n, vocab, lens, lens, args.seed)
        report["bundled"] = asdict(bench_model("bundled model", DEFAULT_MODEL, work,
                                               args.max_num_seqs))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
