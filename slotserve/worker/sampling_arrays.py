"""What the sampler gets and gives for one step, as numpy arrays: torch-free, so a runner and a
sampler without torch (the native core) and the torch runner build and read the same records.

The torch runner converts `SamplingArrays` to its tensors (`worker/sampler.py`'s
`SamplingMetadata.from_arrays`) and its `SamplerOutput` back to `SampledArrays`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

# The runner mixes each seeded row's seed (`SamplingArrays.row_seeds`), so every sampler, with
# torch or without, draws a row from the same generator seed.
_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """A splitmix64-style hash of (seed, output index) -> a 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SamplingArrays:
    """Everything the sampler needs for N rows; optional parts are None when no row uses them
    (the same fields, with the same meaning, as `SamplingMetadata`)."""

    temperature: F32  # [N]; rows below 1e-5 are greedy
    all_greedy: bool
    top_k: I64 | None = None  # [N], 0 = off
    top_p: F32 | None = None  # [N], 1.0 = off
    min_p: F32 | None = None  # [N], 0.0 = off
    # row -> seed for the row's own generator (seed already mixed with the output index)
    row_seeds: dict[int, int] | None = None
    # Penalties: [N] floats, and the token histories as [N, L] int64 padded with vocab_size.
    repetition_penalty: F32 | None = None
    frequency_penalty: F32 | None = None
    presence_penalty: F32 | None = None
    prompt_output_ids: I64 | None = None  # for the repetition penalty
    output_ids: I64 | None = None  # for frequency / presence
    # min_tokens: (row, token id) pairs to mask to -inf.
    masked_rows: I64 | None = None
    masked_tokens: I64 | None = None
    # logit_bias: (row, token id, value) triples added to the logits.
    bias_rows: I64 | None = None
    bias_tokens: I64 | None = None
    bias_values: F32 | None = None
    # The largest logprobs count asked for by any row (None: no row wants logprobs).
    max_num_logprobs: int | None = None
    # Structured outputs: the rows under a grammar [M] int64 (None: every row) and their
    # packed token bitmasks [M, ceil(V'/32)] int32 (bit i of word w: token 32w + i allowed).
    grammar_rows: I64 | None = None
    grammar_bitmask: npt.NDArray[np.int32] | None = None


@dataclass(slots=True)
class SampledArrays:
    """The sampler's result for N rows."""

    sampled: I64  # [N]
    # When logprobs were asked for: the sampled token's raw logprob [N] and the raw top-k
    # ids/logprobs [N, max_num_logprobs] (a grammar's disallowed tokens at -inf).
    sampled_logprobs: F32 | None = None
    topk_ids: I64 | None = None
    topk_logprobs: F32 | None = None
