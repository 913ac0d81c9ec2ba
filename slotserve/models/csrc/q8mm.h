/* The int8-activation drivers over GGUF-layout weights (`--quantization auto`): four weight
 * rows at a time against the quantized activation rows (q8dot.h's tiles), and, where the
 * build decodes ahead (q8dot512.h), each 4-row tile decoded once for many activation rows.
 * `q8_kernel(type)` is the entry qmatmul.c calls. Included by qmatmul.c only. */
#ifndef SLOTSERVE_Q8MM_H
#define SLOTSERVE_Q8MM_H
#include "q8dot.h"

/* The weight streams from DRAM once per step: where the CPU gains from it, the rows
   q8_prefetch bytes ahead are asked for into every cache level (qmatmul.c). */
#ifndef Q8_X_BLOCK_BYTES
#define Q8_X_BLOCK_BYTES (256 * 1024)  /* quantized rows of x per pass: they stay in L2 */
#endif

#ifdef Q8_SIMD
/* Four weight rows at a time against the activation rows of a pass, Q8_MR at a time; the
   rows' bytes, and those q8_prefetch further on, requested first (the weight streams from
   DRAM once per step). */
#define Q8_TILES(NAME, NR)                                                                    \
    for (int64_t i = m0; i < m1; i += Q8_MR) {                                                \
        const uint8_t* a_ = act + i * arb;                                                    \
        float* y_ = y + i * ldy + r;                                                          \
        switch (m1 - i < Q8_MR ? (int)(m1 - i) : Q8_MR) {                                     \
            case 1: NAME##_tile(row, row_bytes, nb, a_, arb, k, y_, ldy, 1, NR); break;       \
            case 2: NAME##_tile(row, row_bytes, nb, a_, arb, k, y_, ldy, 2, NR); break;       \
            case 3: NAME##_tile(row, row_bytes, nb, a_, arb, k, y_, ldy, 3, NR); break;       \
            default: NAME##_tile(row, row_bytes, nb, a_, arb, k, y_, ldy, Q8_MR, NR); break;  \
        }                                                                                     \
    }
#define Q8_MM(NAME, FN)                                                                       \
static void FN(const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* act,    \
                      int64_t arb, int64_t k, int64_t m0, int64_t m1, float* y, int64_t ldy,  \
                      int64_t n0, int64_t n1) {                                               \
    int64_t r = n0;                                                                           \
    for (; r + 4 <= n1; r += 4) {                                                             \
        const uint8_t* row = w + r * row_bytes;                                               \
        for (int64_t p = 0; q8_prefetch && p < 4 * row_bytes; p += 64)                        \
            __builtin_prefetch(row + p + q8_prefetch, 0, 3);                                  \
        Q8_TILES(NAME, 4)                                                                     \
    }                                                                                         \
    for (; r < n1; r++) {                                                                     \
        const uint8_t* row = w + r * row_bytes;                                               \
        Q8_TILES(NAME, 1)                                                                     \
    }                                                                                         \
}
Q8_MM(q4_1, q4_1_mm) Q8_MM(q5_1, q5_1_mm) Q8_MM(q4_k, q4_k_mm) Q8_MM(q5_k, q5_k_mm)
Q8_MM(q6_k, q6_k_mm)
#ifdef Q8_PREDECODE
/* More activation rows than one tile: each 4-row tile of weights decoded once (q8dot512.h). */
#define Q8_MM_PRE(NAME, SHIFT)                                                                \
Q8_MM(NAME, NAME##_mm_direct)                                                                 \
static void NAME##_mm(const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* act,    \
                      int64_t arb, int64_t k, int64_t m0, int64_t m1, float* y, int64_t ldy,  \
                      int64_t n0, int64_t n1) {                                               \
    int64_t pairs = (nb + 1) / 2;                                                             \
    if (m1 - m0 <= Q8_MR || pairs > Q8_PRE_PAIRS) {                                           \
        NAME##_mm_direct(w, row_bytes, nb, act, arb, k, m0, m1, y, ldy, n0, n1);              \
        return;                                                                               \
    }                                                                                         \
    __m512i u[4 * Q8_PRE_PAIRS];                                                              \
    __m512 dw[4 * Q8_PRE_PAIRS];                                                              \
    for (int64_t r = n0; r < n1; r += 4) {                                                    \
        const uint8_t* row = w + r * row_bytes;                                               \
        int nr = n1 - r < 4 ? (int)(n1 - r) : 4;                                              \
        for (int64_t p = 0; q8_prefetch && p < nr * row_bytes; p += 64)                       \
            __builtin_prefetch(row + p + q8_prefetch, 0, 3);                                  \
        NAME##_decode(row, row_bytes, nb, nr, u, dw);                                         \
        for (int64_t i = m0; i < m1; i += Q8_MR) {                                            \
            const uint8_t* a_ = act + i * arb;                                                \
            float* y_ = y + i * ldy + r;                                                      \
            int mr = m1 - i < Q8_MR ? (int)(m1 - i) : Q8_MR;                                  \
            if (nr == 4) {                                                                    \
                switch (mr) {                                                                 \
                    case 1: q8_512_tile_pre(u, dw, nb, a_, arb, k, y_, ldy, 1, 4, SHIFT); break;\
                    case 2: q8_512_tile_pre(u, dw, nb, a_, arb, k, y_, ldy, 2, 4, SHIFT); break;\
                    case 3: q8_512_tile_pre(u, dw, nb, a_, arb, k, y_, ldy, 3, 4, SHIFT); break;\
                    default: q8_512_tile_pre(u, dw, nb, a_, arb, k, y_, ldy, Q8_MR, 4, SHIFT);\
                }                                                                             \
            } else                                                                            \
                for (int j = 0; j < nr; j++)                                                  \
                    for (int i2 = 0; i2 < mr; i2++)                                           \
                        q8_512_tile_pre(u + j * pairs, dw + j * pairs, nb, a_ + i2 * arb,     \
                                        arb, k, y_ + i2 * ldy + j, ldy, 1, 1, SHIFT);         \
        }                                                                                     \
    }                                                                                         \
}
Q8_MM_PRE(q4_0, 3) Q8_MM_PRE(q5_0, 4) Q8_MM_PRE(q8_0, 7)
#else
Q8_MM(q4_0, q4_0_mm) Q8_MM(q5_0, q5_0_mm) Q8_MM(q8_0, q8_0_mm)
#endif
typedef void (*q8_mm_fn)(const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                         int64_t, int64_t, float*, int64_t, int64_t, int64_t);
static q8_mm_fn q8_kernel(int32_t type) {
    switch (type) {
        case 2: return q4_0_mm;
        case 3: return q4_1_mm;
        case 6: return q5_0_mm;
        case 7: return q5_1_mm;
        case 8: return q8_0_mm;
        case 12: return q4_k_mm;
        case 13: return q5_k_mm;
        case 14: return q6_k_mm;
        default: return 0;
    }
}
#endif

#endif
