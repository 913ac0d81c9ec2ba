/* The float32-activation kernels (`--quantization exact`) of qmatmul.c: the fused
 * decode-in-registers path for one or two rows of x (AVX-512) and the MR x NR register tiles
 * over a dequantized scratch tile (every level). qmatmul.c's header comment says how they are
 * driven. Included by qmatmul.c only, after qblocks.h. */
#ifndef SLOTSERVE_QMATMUL_F32_H
#define SLOTSERVE_QMATMUL_F32_H

/* The multiply-add of the dot products is fused on purpose (one rounding, as in any sgemm);
   spelled out because the file is compiled with -ffp-contract=off for the dequantizers. */
#if defined(__AVX512F__)
static inline v16 fma16(v16 a, v16 b, v16 c) {
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#elif defined(__FMA__) && defined(__AVX__)
typedef float v8 __attribute__((vector_size(32), aligned(4)));
static inline v16 fma16(v16 a, v16 b, v16 c) {
    union { v16 v; __m256 h[2]; } ua = {a}, ub = {b}, uc = {c};
    uc.h[0] = _mm256_fmadd_ps(ua.h[0], ub.h[0], uc.h[0]);
    uc.h[1] = _mm256_fmadd_ps(ua.h[1], ub.h[1], uc.h[1]);
    return uc.v;
}
#else
static inline v16 fma16(v16 a, v16 b, v16 c) { return a * b + c; }
#endif

#include "qblocks.h"

#ifdef QMM_AVX512
/* Few rows of x (decoding one or two sequences): the scratch round trip costs as much as the
   multiply-adds, so blocks are decoded in registers and multiplied with x right away, four
   weight rows at a time (their bytes prefetched as the tiles do). The values multiplied are
   the dequantizers' own; only the order of the float32 sums differs from the tile path. */
#define FUSED_MAX_M 2
#define FMA_INTO_ACC(v, off) do {                                                             \
    for (int i_ = 0; i_ < m; i_++) {                                                          \
        const float* xb_ = x + i_ * ldx + kb + (off);                                         \
        acc[j][i_] = _mm512_fmadd_ps((v).a, _mm512_loadu_ps(xb_), acc[j][i_]);                \
        acc[j][i_] = _mm512_fmadd_ps((v).b, _mm512_loadu_ps(xb_ + 16), acc[j][i_]);           \
    }                                                                                         \
} while (0)
#define FUSED(NAME, FOR, VALUES, BYTES)                                                       \
static inline __attribute__((always_inline)) void NAME##_rows(                               \
        const uint8_t* w, int64_t row_bytes, int64_t nb, const float* x, int64_t ldx,        \
        const int m, float* y, int64_t ldy, int64_t r, const int nr) {                       \
    __m512 acc[4][FUSED_MAX_M];                                                               \
    for (int j = 0; j < nr; j++)                                                              \
        for (int i = 0; i < m; i++) acc[j][i] = _mm512_setzero_ps();                          \
    const uint8_t* row = w + r * row_bytes;                                                   \
    for (int64_t p = 0; p < nr * row_bytes; p += 64)                                          \
        __builtin_prefetch(row + p + PREFETCH_BYTES, 0, 0);                                   \
    for (int64_t bi = 0; bi < nb; bi++) {                                                     \
        int64_t kb = (VALUES) * bi;                                                           \
        for (int j = 0; j < nr; j++) {                                                        \
            const uint8_t* blk = row + j * row_bytes + (BYTES) * bi;                          \
            FOR(blk, FMA_INTO_ACC);                                                           \
        }                                                                                     \
    }                                                                                         \
    for (int i = 0; i < m; i++) {                                                             \
        if (nr == 4)                                                                          \
            hsum4((v16)acc[0][i], (v16)acc[1][i], (v16)acc[2][i], (v16)acc[3][i],             \
                  y + i * ldy + r);                                                           \
        else                                                                                  \
            for (int j = 0; j < nr; j++) y[i * ldy + r + j] = hsum((v16)acc[j][i]);         \
    }                                                                                         \
}                                                                                             \
static void NAME##_fused(const uint8_t* w, int64_t row_bytes, int64_t k, const float* x,      \
                         int64_t ldx, int64_t m, float* y, int64_t ldy, int64_t n0,           \
                         int64_t n1) {                                                        \
    int64_t nb = k / (VALUES), r = n0;                                                        \
    for (; r + 4 <= n1; r += 4) {                                                             \
        if (m == 1) NAME##_rows(w, row_bytes, nb, x, ldx, 1, y, ldy, r, 4);                   \
        else NAME##_rows(w, row_bytes, nb, x, ldx, 2, y, ldy, r, 4);                          \
    }                                                                                         \
    for (; r < n1; r++) {                                                                     \
        if (m == 1) NAME##_rows(w, row_bytes, nb, x, ldx, 1, y, ldy, r, 1);                   \
        else NAME##_rows(w, row_bytes, nb, x, ldx, 2, y, ldy, r, 1);                          \
    }                                                                                         \
}
#define FUSED_ARGS const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t, float*, \
                   int64_t, int64_t, int64_t
#endif

/* ---- the register tiles ------------------------------------------------------------------ */

#define MR 4
#define NR 4
#ifndef X_BLOCK_BYTES
#define X_BLOCK_BYTES (256 * 1024)  /* rows of x per block: they stay in L2 */
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 16384
#endif
#ifndef TILE_ROWS
#define TILE_ROWS 4               /* weight rows dequantized at a time: they stay in L1 */
#endif

/* A load into a register of its own: left alone, gcc folds the loads into each multiply-add
   that uses them, and the tile becomes bound by loads instead of multiply-adds. */
#if defined(__AVX512F__) && defined(__x86_64__) && !defined(__clang__)
static inline __attribute__((always_inline)) v16 LOAD16(const float* p) {
    v16 v;
    __asm__("vmovups %1, %0" : "=v"(v) : "m"(*(const v16*)p));
    return v;
}
#else
#define LOAD16(p) (*(const v16*)(p))
#endif

static inline __attribute__((always_inline)) void tile(
        const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy,
        const int mr, const int nr) {
    v16 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = (v16){0};
    for (int64_t kk = 0; kk < k; kk += 16) {
        v16 xv[MR], wv[NR];
        for (int i = 0; i < mr; i++) xv[i] = *(const v16*)(x + i * ldx + kk);
        for (int j = 0; j < nr; j++) wv[j] = *(const v16*)(w + j * k + kk);
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) acc[i][j] = fma16(xv[i], wv[j], acc[i][j]);
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[i * ldy + j] = hsum(acc[i][j]);
}

typedef void (*tile_fn)(const float*, int64_t, const float*, int64_t, float*, int64_t);
#define TILE(a, b) \
    static void tile_##a##_##b(const float* x, int64_t ldx, const float* w, int64_t k, \
                               float* y, int64_t ldy) { tile(x, ldx, w, k, y, ldy, a, b); }
#define TILE_ROW(a) TILE(a, 1) TILE(a, 2) TILE(a, 3) TILE(a, 4)
TILE_ROW(1) TILE_ROW(2) TILE_ROW(3)
TILE(4, 1) TILE(4, 2) TILE(4, 3)

/* y[j] = hsum(cj) for four vectors: their 128-bit quarters are summed pairwise across the
   four (two shuffle-and-add rounds), then the four lanes of each quarter. */
static inline void hsum4(v16 c0, v16 c1, v16 c2, v16 c3, float* y) {
#ifdef QMM_AVX512
    __m512 a0 = (__m512)c0, a1 = (__m512)c1, a2 = (__m512)c2, a3 = (__m512)c3;
    __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44),
                               _mm512_shuffle_f32x4(a0, a1, 0xee));
    __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44),
                               _mm512_shuffle_f32x4(a2, a3, 0xee));
    /* quarter j now holds 4 partial sums of cj */
    __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, 0x88),
                             _mm512_shuffle_f32x4(p01, p23, 0xdd));
    q = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4e));
    q = _mm512_add_ps(q, _mm512_permute_ps(q, 0xb1));
    __m512 r = _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                       12, 8, 4, 0), q);
    _mm_storeu_ps(y, _mm512_castps512_ps128(r));
#else
    y[0] = hsum(c0); y[1] = hsum(c1); y[2] = hsum(c2); y[3] = hsum(c3);
#endif
}

/* The full 4 x 4 tile, written out so that its 16 accumulators and 8 operands live in
   registers and every operand is loaded once per step (LOAD16). */
static void tile_4_4(const float* x, int64_t ldx, const float* w, int64_t k, float* y,
                     int64_t ldy) {
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
    const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    v16 c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0}, c10 = {0}, c11 = {0}, c12 = {0}, c13 = {0};
    v16 c20 = {0}, c21 = {0}, c22 = {0}, c23 = {0}, c30 = {0}, c31 = {0}, c32 = {0}, c33 = {0};
    for (int64_t kk = 0; kk < k; kk += 16) {
        v16 b0 = LOAD16(w0 + kk), b1 = LOAD16(w1 + kk), b2 = LOAD16(w2 + kk);
        v16 b3 = LOAD16(w3 + kk), a;
        a = LOAD16(x0 + kk);
        c00 = fma16(a, b0, c00); c01 = fma16(a, b1, c01); c02 = fma16(a, b2, c02);
        c03 = fma16(a, b3, c03);
        a = LOAD16(x1 + kk);
        c10 = fma16(a, b0, c10); c11 = fma16(a, b1, c11); c12 = fma16(a, b2, c12);
        c13 = fma16(a, b3, c13);
        a = LOAD16(x2 + kk);
        c20 = fma16(a, b0, c20); c21 = fma16(a, b1, c21); c22 = fma16(a, b2, c22);
        c23 = fma16(a, b3, c23);
        a = LOAD16(x3 + kk);
        c30 = fma16(a, b0, c30); c31 = fma16(a, b1, c31); c32 = fma16(a, b2, c32);
        c33 = fma16(a, b3, c33);
    }
    hsum4(c00, c01, c02, c03, y);
    hsum4(c10, c11, c12, c13, y + ldy);
    hsum4(c20, c21, c22, c23, y + 2 * ldy);
    hsum4(c30, c31, c32, c33, y + 3 * ldy);
}

static const tile_fn TILES[MR][NR] = {
    {tile_1_1, tile_1_2, tile_1_3, tile_1_4}, {tile_2_1, tile_2_2, tile_2_3, tile_2_4},
    {tile_3_1, tile_3_2, tile_3_3, tile_3_4}, {tile_4_1, tile_4_2, tile_4_3, tile_4_4},
};

#ifdef QMM_AVX512
FUSED(q4_0, FOR_Q4_0, 32, 18)
FUSED(q4_1, FOR_Q4_1, 32, 20)
FUSED(q5_0, FOR_Q5_0, 32, 22)
FUSED(q5_1, FOR_Q5_1, 32, 24)
FUSED(q8_0, FOR_Q8_0, 32, 34)
FUSED(q4_k, FOR_Q4_K, 256, 144)
FUSED(q5_k, FOR_Q5_K, 256, 176)
FUSED(q6_k, FOR_Q6_K, 256, 210)
typedef void (*fused_fn)(FUSED_ARGS);
static fused_fn fused_kernel(int32_t type) {
    switch (type) {
        case 2: return q4_0_fused;
        case 3: return q4_1_fused;
        case 6: return q5_0_fused;
        case 7: return q5_1_fused;
        case 8: return q8_0_fused;
        case 12: return q4_k_fused;
        case 13: return q5_k_fused;
        case 14: return q6_k_fused;
        default: return 0;
    }
}
#else  /* the portable build always goes through the scratch */
#define FUSED_MAX_M 0
typedef void (*fused_fn)(const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t,
                         float*, int64_t, int64_t, int64_t);
static fused_fn fused_kernel(int32_t type) { (void)type; return 0; }
#endif

#endif
