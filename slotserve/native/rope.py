"""RoPE tables in numpy: `models/layers.py`'s `rope_inv_freq` and `rope_tables` without torch.

The same float32 formulas, except the power: torch's float32 `theta ** x` is within an ulp
of the exact value, numpy's float32 power further off (the two disagreed on 19-26 of
Gemma 3's 128 frequencies, and a frequency an ulp off moves every rotation angle at position
p by p ulps). Here the power is computed in float64 and rounded once, which is what torch
gives on all but about one frequency in a hundred; cos and sin may still differ from torch's
in the last bit."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from slotserve.model_config import RopeConfig

F32 = npt.NDArray[np.float32]


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_positions: int) -> F32:
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    power = (np.float64(np.float32(rope.theta)) ** exps.astype(np.float64)).astype(np.float32)
    inv: F32 = (np.float32(1.0) / power).astype(np.float32)
    if rope.freq_factors is not None:
        return (inv / np.asarray(rope.freq_factors, dtype=np.float32)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type != "llama3":
        return inv
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between them
    # interpolated smoothly.
    orig = rope.original_max_position_embeddings or max_positions
    low_freq_wavelen = orig / rope.low_freq_factor
    high_freq_wavelen = orig / rope.high_freq_factor
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv / np.float32(rope.factor), inv)
    smooth = ((np.float32(orig) / wavelen - np.float32(rope.low_freq_factor))
              / np.float32(rope.high_freq_factor - rope.low_freq_factor))
    smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                positions: int) -> tuple[F32, F32]:
    """cos and sin [positions, head_dim / 2] float32, contiguous."""
    inv = rope_inv_freq(rope, head_dim, max_position_embeddings)
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv[None, :]
    return (np.ascontiguousarray(np.cos(freqs), dtype=np.float32),
            np.ascontiguousarray(np.sin(freqs), dtype=np.float32))
