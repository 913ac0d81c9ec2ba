"""llama.cpp's int8-activation scheme written plainly in numpy, the reference the native
int8 kernel (`csrc/q8act.h`, `csrc/q8dot.h`) is checked against: activation rows quantized to
Q8_0 / Q8_1 / Q8_K (ggml-quants.c's quantize_row_q8_*_ref rounding), then
sum over k of w * (d_a * q_a) with the weights as gguf dequantizes them, plus Q8_1's rounded
block sums for the formats with a min (Q4_1, Q5_1)."""

from __future__ import annotations

import numpy as np

Q8_0, Q8_1, Q8_K = 0, 1, 2


def round_away(v: np.ndarray) -> np.ndarray:
    """C's roundf (half away from zero), exact: float32 -> float64 is exact, so is + 0.5."""
    w = v.astype(np.float64)
    return np.sign(w) * np.floor(np.abs(w) + 0.5)


def quantize_row(x: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8 [k], d float32 per block, s float32 per block: Q8_1's float16(sum(q) * d),
    Q8_K's bsums per 16 values, Q8_0's unused zeros)."""
    x = x.astype(np.float32)
    if kind == Q8_K:
        blocks = x.reshape(-1, 256)
        qs, ds = [], []
        for b in blocks:
            at = int(np.argmax(np.abs(b)))  # the first of largest magnitude, as ggml's loop
            if b[at] == 0:
                qs.append(np.zeros(256, np.int8))
                ds.append(np.float32(0))
                continue
            iscale = np.float32(-127.0) / b[at]
            q = np.minimum(np.rint(iscale * b), 127).astype(np.int8)
            qs.append(q)
            ds.append(np.float32(1.0) / iscale)
        q = np.concatenate(qs)
        bsums = q.astype(np.int32).reshape(-1, 16).sum(axis=1)
        return q, np.array(ds, np.float32), bsums.astype(np.float32)
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    d = amax / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(
        np.float32)
    q = round_away(blocks * inv[:, None]).astype(np.int8)
    d16 = d.astype(np.float16).astype(np.float32)
    s = np.zeros_like(d16)
    if kind == Q8_1:
        s = (q.astype(np.int32).sum(axis=1).astype(np.float32) * d).astype(np.float16)
        s = s.astype(np.float32)
    return q.reshape(-1), d16, s


def dequantized_row(q: np.ndarray, d: np.ndarray, kind: int) -> np.ndarray:
    block = 256 if kind == Q8_K else 32
    return (q.astype(np.float64).reshape(-1, block) * d.astype(np.float64)[:, None]).reshape(-1)


def matmul(x: np.ndarray, weight: np.ndarray, mins: np.ndarray | None, kind: int) -> np.ndarray:
    """y [m, n] in float64: x [m, k] float32, weight [n, k] (gguf's dequantized values),
    mins [n, k / 32] (Q4_1 / Q5_1: each block's m) or None."""
    out = np.empty((x.shape[0], weight.shape[0]))
    w64 = weight.astype(np.float64)
    for i, row in enumerate(x):
        q, d, s = quantize_row(row, kind)
        a = dequantized_row(q, d, kind)
        out[i] = w64 @ a
        if mins is not None:  # the min term uses Q8_1's float16-rounded s, not sum(d * q)
            exact_s = (q.astype(np.float64).reshape(-1, 32).sum(axis=1) * d.astype(np.float64))
            out[i] += mins.astype(np.float64) @ (s.astype(np.float64) - exact_s)
    return out


def bound(x: np.ndarray, weight: np.ndarray, kind: int) -> np.ndarray:
    """Float rounding allowed per output: a few float32 roundings per block, each at most
    eps * sum |w| |a| over the whole row."""
    eps = float(np.finfo(np.float32).eps)
    block = 256 if kind == Q8_K else 32
    blocks = weight.shape[1] // block
    mag = np.empty((x.shape[0], weight.shape[0]))
    w64 = np.abs(weight.astype(np.float64))
    for i, row in enumerate(x):
        q, d, _ = quantize_row(row, kind)
        mag[i] = w64 @ np.abs(dequantized_row(q, d, kind))
    return 4 * (blocks + 4) * eps * mag + 1e-30
