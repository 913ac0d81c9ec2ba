/* Activation rows quantized to 8 bits once per matmul, with llama.cpp's rounding
 * (ggml-quants.c: quantize_row_q8_0_ref, quantize_row_q8_1_ref, quantize_row_q8_K_ref):
 *
 *   Q8_0 / Q8_1 (blocks of 32): d = amax / 127, q = roundf(x / d) (half away from zero), d kept
 *     as float16; Q8_1 also keeps s = float16(sum(q) * d).
 *   Q8_K (blocks of 256): with `max` the value of largest magnitude, iscale = -127 / max,
 *     q = min(127, nearest-even(iscale * x)), d = 1 / iscale kept as float32, plus the sums
 *     of every 16 q (bsums).
 *
 * The row layout is this project's own (the kernels read it, nothing else does): per row the
 * k int8 values, then float d per block, then (Q8_0) int32 -sum(q) per block (the offset
 * correction of q8dot512.h), (Q8_1) float s per block or (Q8_K) int16 bsums per 16 values,
 * the row padded to 64 bytes. The rounding loops are plain C that compilers
 * vectorize at every level; the float16 rounding is spelled out so the portable build (no
 * F16C) gives the same bits. Included by qmatmul.c only. */
#ifndef SLOTSERVE_Q8ACT_H
#define SLOTSERVE_Q8ACT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { ACT_Q8_0 = 0, ACT_Q8_1 = 1, ACT_Q8_K = 2 };

/* float -> float16 -> float, round to nearest even (what numpy and F16C do). */
static inline float round_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    uint16_t h;
    if (ax >= 0x7f800000u) {
        h = (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    } else if (ax >= 0x477ff000u) {  /* 65520 and above round to infinity */
        h = (uint16_t)(sign | 0x7c00u);
    } else if (ax < 0x38800000u) {  /* below 2^-14: a float16 subnormal, units of 2^-24 */
        float a;
        memcpy(&a, &ax, 4);
        h = (uint16_t)(sign | (uint32_t)rintf(a * 16777216.0f));
    } else {  /* rebias the exponent by -112, round the 13 dropped bits to nearest even */
        h = (uint16_t)(sign | ((ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13));
    }
    uint8_t b[2] = {(uint8_t)(h & 0xff), (uint8_t)(h >> 8)};
    return f16(b);
}

/* roundf without a libm call: exact for every float (the fraction v - trunc(v) is exact). */
static inline float round_away(float v) {
    float t = truncf(v), f = v - t;
    return t + (float)(f >= 0.5f) - (float)(f <= -0.5f);
}

static inline int64_t act_block(int32_t kind) { return kind == ACT_Q8_K ? 256 : 32; }

/* Bytes of one quantized row of k values (k a multiple of the kind's block). */
static inline int64_t act_row_bytes(int32_t kind, int64_t k) {
    int64_t nb = k / act_block(kind);
    int64_t extra = kind == ACT_Q8_K ? 4 * nb + 2 * (k / 16) : 8 * nb;
    return (k + extra + 63) / 64 * 64;
}

static void quantize_q8_0_row(const float* x, int64_t k, uint8_t* row, int with_sum) {
    int64_t nb = k / 32;
    int8_t* qs = (int8_t*)row;
    float* ds = (float*)(row + k);
    float* ss = ds + nb;
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + 32 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)round_away(xb[j] * id);
            qs[32 * b + j] = (int8_t)q;
            sum += q;
        }
        ds[b] = round_f16(d);
        if (with_sum) ss[b] = round_f16((float)sum * d);
        else { int32_t neg = -sum; memcpy(ss + b, &neg, 4); }
    }
}

static void quantize_q8_k_row(const float* x, int64_t k, uint8_t* row) {
    int64_t nb = k / 256;
    int8_t* qs = (int8_t*)row;
    float* ds = (float*)(row + k);
    int16_t* bsums = (int16_t*)(ds + nb);
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + 256 * b;
        int8_t* q = qs + 256 * b;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 256; j++) {
            float ax = fabsf(xb[j]);
            if (ax > amax) { amax = ax; max = xb[j]; }
        }
        if (amax == 0.0f) {
            ds[b] = 0.0f;
            memset(q, 0, 256);
            memset(bsums + 16 * b, 0, 32);
            continue;
        }
        float iscale = -127.0f / max;
        for (int j = 0; j < 256; j++) {
            float v = rintf(iscale * xb[j]);  /* ggml's nearest_int: nearest, ties to even */
            q[j] = (int8_t)(v < 127.0f ? v : 127.0f);
        }
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += q[16 * g + j];
            bsums[16 * b + g] = (int16_t)sum;
        }
        ds[b] = 1.0f / iscale;
    }
}

static void quantize_act_row(int32_t kind, const float* x, int64_t k, uint8_t* row) {
    if (kind == ACT_Q8_K) quantize_q8_k_row(x, k, row);
    else quantize_q8_0_row(x, k, row, kind == ACT_Q8_1);
}

#endif
