"""An independent check of the GGUF path: the files `gguf_convert` writes are read by
transformers' own GGUF reader (`from_pretrained(folder, gguf_file=...)`: its own name map, its
own undoing of llama.cpp's q/k permutation, its own config keys), and slotserve's greedy tokens
and logprobs on the same file must be transformers'. The converter and slotserve's loader
mirror each other, so a mistake made in both shows only here.

Every architecture gets a k-quant (rows of 256 values, so every matrix is one), and Llama also
Q2_K and Q3_K (which slotserve dequantizes at load). What a GGUF file cannot say is set to
what llama.cpp and transformers assume: no Llama 3.1 RoPE scaling (transformers ignores the
`rope_freqs` tensor), Qwen 3's head_dim 128 (transformers does not read the key length for
it), Gemma 3's every-6th-layer-global pattern, query scale 256 and unscaled RoPE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slotserve.config import CacheConfig, SchedulerConfig
from slotserve.sampling_params import SamplingParams
from slotserve.worker.model_runner import ModelRunner
from tests.checkpoint.gguf_convert import Q, to_gguf
from tests.helpers import TOKENIZER_BOS, TOKENIZER_EOS, ManualScheduler, build_tiny, hf_greedy

NEW_TOKENS = 12
PROMPTS = [[5, 9, 20, 7], list(range(10, 41))]
WIDE = dict(hidden_size=256, intermediate_size=512)
GEMMA = dict(num_hidden_layers=6, query_pre_attn_scalar=256, head_dim=64,
             layer_types=["sliding_attention"] * 5 + ["full_attention"],
             rope_parameters={
                 "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
# case -> (tiny architecture, config overrides, tensor type of the matrices)
CASES: dict[str, tuple[str, dict[str, Any], Q]] = {
    "llama-Q4_K": ("llama", dict(rope_scaling=None), Q.Q4_K),  # GQA, untied
    "llama-Q2_K": ("llama_tied", {}, Q.Q2_K),
    "llama-Q3_K": ("llama_tied", {}, Q.Q3_K),
    "mistral-Q5_K": ("mistral", dict(head_dim=64), Q.Q5_K),  # GQA 4:1
    "qwen2-Q6_K": ("qwen2", {}, Q.Q6_K),  # qkv bias
    "qwen3-Q4_K": ("qwen3", dict(head_dim=128), Q.Q4_K),  # q/k norms
    "gemma3-Q6_K": ("gemma3", GEMMA, Q.Q6_K),
}
# The embeddings keep the model's own spread: random k-quant blocks (std cols ** -0.5) there
# would leave attention so little weight in the logits that undoing the q/k permutation
# wrongly on both sides moved them by 4e-3 only.
EMBEDDINGS = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0}
# slotserve keeps the k-quants in blocks and multiplies them in its own kernel (`exact`:
# float32 activations): equal to the dequantized matmul up to the order of the float32 sums.
LOGPROB_TOL = 1e-3


def greedy(path: Path) -> ManualScheduler:
    runner = ModelRunner(path, SchedulerConfig(max_num_seqs=4, max_model_len=128),
                         CacheConfig(block_size=4, num_blocks=128), dtype="float32",
                         device="cpu", quantization="exact")
    sched = ManualScheduler(block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=3)
    for i, prompt in enumerate(PROMPTS):
        sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
    sched.run(runner, chunk=5)
    return sched


@pytest.mark.parametrize("case", list(CASES))
def test_slotserve_generates_what_transformers_reads_from_the_file(
        case: str, tmp_path: Path, tokenizer_dir: Path, tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    arch, overrides, qtype = CASES[case]
    # transformers takes the vocabulary size from the file's token list: the test tokenizer's.
    model = build_tiny(arch, tmp_path / "hf", seed=1, **WIDE, **overrides,
                       vocab_size=len(tokenizer), bos_token_id=TOKENIZER_BOS,
                       eos_token_id=TOKENIZER_EOS, pad_token_id=2)
    path = tmp_path / "gguf" / "m.gguf"
    path.parent.mkdir()
    to_gguf(model.hf, path, qtype, tokenizer_dir=tokenizer_dir, types=EMBEDDINGS)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None
    sched = greedy(path)
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = hf_greedy(theirs, prompt, NEW_TOKENS)
        req = sched.requests[f"r{i}"]
        assert req.outputs == tokens, f"prompt {i}"
        for step, (tok, entry, ref) in enumerate(zip(tokens, req.logprobs, logprobs,
                                                     strict=True)):
            top = ref.topk(3)
            assert entry.keys() >= set(top.indices.tolist()), (i, step)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(entry[t] - v) < LOGPROB_TOL, (i, step, t)
            assert abs(entry[tok] - ref[tok].item()) < LOGPROB_TOL
