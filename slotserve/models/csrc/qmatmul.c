/* Block-quantized matmul for the CPU: y = x @ W^T with float32 activations and W kept in one
 * of GGUF's block formats (see slotserve/models/native_qmatmul.py for why, and for how this
 * file is built and called).
 *
 * The model's numbers stay those of dequantize-then-matmul: every weight is dequantized to
 * exactly the float32 value `gguf`'s reference dequantizer gives (qblocks.h: same operations
 * in the same order; the file is compiled with -ffp-contract=off so no multiply-add is fused
 * there), and only the order of the float32 sums in the dot products differs. Activations are never
 * quantized.
 *
 * One call computes the output columns [n0, n1) for every row of x. Per tile of `nb` weight
 * rows (as many as fit the scratch, at most TILE_BYTES): the rows are dequantized into the
 * scratch once, then every row block of x (MB rows, kept in L2) runs against them in MR x NR
 * register tiles: MR rows of x times NR weight rows, 16 lanes of k at a time, MR * NR
 * accumulators, one horizontal sum per output at the end. Each weight is dequantized once per
 * MB rows of x, so decode steps (a few dozen rows) dequantize it once.
 *
 * The Python caller checks dtypes, devices and strides; this file checks the type, the shape
 * against the type's block layout, the row range, the scratch size and row ids before any
 * memory is touched. Nothing is allocated: the caller hands in `scratch` and `y`.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum {
    QMM_OK = 0,
    QMM_BAD_TYPE = 1,       /* a GGML type id without a kernel here */
    QMM_BAD_SHAPE = 2,      /* k not whole blocks, row_bytes not the type's, bad row range */
    QMM_SMALL_SCRATCH = 3,  /* scratch holds fewer than NR * k floats */
    QMM_BAD_ROW = 4,        /* a row id outside [0, n) */
};

#include "simd.h"

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

typedef void (*dequant_fn)(const uint8_t*, int64_t, float*);
typedef struct { int32_t type; int32_t block; int32_t bytes; dequant_fn fn; } qtype_info;

/* GGML type ids (ggml.h's enum ggml_type), values per block, bytes per block. */
static const qtype_info QTYPES[] = {
    {2, 32, 18, deq_q4_0}, {3, 32, 20, deq_q4_1}, {6, 32, 22, deq_q5_0}, {7, 32, 24, deq_q5_1},
    {8, 32, 34, deq_q8_0}, {12, 256, 144, deq_q4_k}, {13, 256, 176, deq_q5_k},
    {14, 256, 210, deq_q6_k},
};

static const qtype_info* find_type(int32_t type) {
    for (size_t i = 0; i < sizeof QTYPES / sizeof QTYPES[0]; i++)
        if (QTYPES[i].type == type) return &QTYPES[i];
    return 0;
}

static int check_layout(const qtype_info* t, int64_t n, int64_t k, int64_t row_bytes) {
    if (n < 0 || k <= 0 || k % t->block || row_bytes != k / t->block * t->bytes)
        return QMM_BAD_SHAPE;
    return QMM_OK;
}

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

/* x [m, k] (rows ldx floats apart), W [n, k] as n rows of `row_bytes` bytes of blocks,
   y [m, n] (rows ldy floats apart): y[:, n0:n1] = x @ W[n0:n1]^T. */
int slotserve_qmatmul_f32(int32_t type, const uint8_t* w, int64_t n, int64_t k,
        int64_t row_bytes, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
        int64_t n0, int64_t n1, float* scratch, int64_t scratch_len) {
    const qtype_info* t = find_type(type);
    if (!t) return QMM_BAD_TYPE;
    if (check_layout(t, n, k, row_bytes) || m < 0 || n0 < 0 || n1 > n || n0 > n1
        || (m > 1 && (ldx < k || ldy < n1)))
        return QMM_BAD_SHAPE;
    if (scratch_len < TILE_ROWS * k) return QMM_SMALL_SCRATCH;
    fused_fn fused = fused_kernel(type);
    if (fused && m >= 1 && m <= FUSED_MAX_M) {
        fused(w, row_bytes, k, x, ldx, m, y, ldy, n0, n1);
        return QMM_OK;
    }
    int64_t mb = X_BLOCK_BYTES / (4 * k) / MR * MR;
    mb = mb < 4 * MR ? 4 * MR : mb;
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
        int64_t m1 = m - m0 < mb ? m : m0 + mb;
        for (int64_t t0 = n0; t0 < n1; t0 += TILE_ROWS) {
            int64_t rows = n1 - t0 < TILE_ROWS ? n1 - t0 : TILE_ROWS;
            /* The weight is read once per step, from DRAM: ask now for the bytes that lie
               PREFETCH_BYTES beyond this tile, so they arrive while this one is multiplied. */
            {
                const uint8_t* lo = w + t0 * row_bytes + PREFETCH_BYTES;
                const uint8_t* hi = w + n1 * row_bytes;
                const uint8_t* end = lo + rows * row_bytes < hi ? lo + rows * row_bytes : hi;
                for (const uint8_t* p = lo; p < end; p += 64) __builtin_prefetch(p, 0, 0);
            }
            for (int64_t r = 0; r < rows; r++)
                t->fn(w + (t0 + r) * row_bytes, k / t->block, scratch + r * k);
            for (int64_t j = 0; j < rows; j += NR) {
                int nr = rows - j < NR ? (int)(rows - j) : NR;
                for (int64_t i = m0; i < m1; i += MR) {
                    int mr = m1 - i < MR ? (int)(m1 - i) : MR;
                    TILES[mr - 1][nr - 1](x + i * ldx, ldx, scratch + j * k, k,
                                          y + i * ldy + t0 + j, ldy);
                }
            }
        }
    }
    return QMM_OK;
}

/* out[i, :] = W[rows[i], :] dequantized (an embedding lookup); out rows ldo floats apart. */
int slotserve_dequant_rows_f32(int32_t type, const uint8_t* w, int64_t n, int64_t k,
        int64_t row_bytes, const int64_t* rows, int64_t num_rows, float* out, int64_t ldo) {
    const qtype_info* t = find_type(type);
    if (!t) return QMM_BAD_TYPE;
    if (check_layout(t, n, k, row_bytes) || num_rows < 0 || (num_rows > 1 && ldo < k))
        return QMM_BAD_SHAPE;
    for (int64_t i = 0; i < num_rows; i++)
        if (rows[i] < 0 || rows[i] >= n) return QMM_BAD_ROW;
    for (int64_t i = 0; i < num_rows; i++)
        t->fn(w + rows[i] * row_bytes, k / t->block, out + i * ldo);
    return QMM_OK;
}

/* Values per block and bytes per block of a type (0, 0 when it has no kernel here): the
   Python side reads them once, when the library is loaded, and sizes weight rows by them. */
void slotserve_qtype_layout(int32_t type, int32_t* block, int32_t* bytes) {
    const qtype_info* t = find_type(type);
    *block = t ? t->block : 0;
    *bytes = t ? t->bytes : 0;
}

/* ---- int8 activations (`--quantization auto`): q8act.h, q8dot.h ------------------------ */

#include "q8dot.h"

/* The weight streams from DRAM once per step: the rows 4 KiB ahead are asked for into every
   cache level (prefetcht0). Measured on the 262k x 640 Q8_0 output projection at one row:
   prefetchnta, or 16 KiB and more ahead, left a third to half of the read bandwidth unused. */
#ifndef Q8_PREFETCH_BYTES
#define Q8_PREFETCH_BYTES 4096
#endif
#ifndef Q8_X_BLOCK_BYTES
#define Q8_X_BLOCK_BYTES (256 * 1024)  /* quantized rows of x per pass: they stay in L2 */
#endif

/* The activation quantization each weight type's dot product takes (-1: no int8 kernel). */
int32_t slotserve_q8_act_kind(int32_t type) {
    switch (type) {
        case 2: case 6: case 8: return ACT_Q8_0;
        case 3: case 7: return ACT_Q8_1;
        case 12: case 13: case 14: return ACT_Q8_K;
        default: return -1;
    }
}

/* Bytes of one quantized activation row (-1: bad kind or k not whole blocks). */
int64_t slotserve_q8_act_row_bytes(int32_t kind, int64_t k) {
    if (kind < ACT_Q8_0 || kind > ACT_Q8_K || k <= 0 || k % act_block(kind)) return -1;
    return act_row_bytes(kind, k);
}

/* Rows of x [m, k] (ldx floats apart) quantized into `out`, rows act_row_bytes apart. */
int slotserve_q8_quantize(int32_t kind, const float* x, int64_t ldx, int64_t m, int64_t k,
                          uint8_t* out, int64_t out_len) {
    int64_t rb = slotserve_q8_act_row_bytes(kind, k);
    if (rb < 0 || m < 0 || (m > 1 && ldx < k)) return QMM_BAD_SHAPE;
    if (out_len < m * rb) return QMM_SMALL_SCRATCH;
    for (int64_t i = 0; i < m; i++) quantize_act_row(kind, x + i * ldx, k, out + i * rb);
    return QMM_OK;
}

/* The instructions the integer dot products use in this build (logs, tests). */
const char* slotserve_q8_isa(void) { return Q8_ISA; }

#ifdef Q8_SIMD
/* Four weight rows at a time against the activation rows of a pass, Q8_MR at a time; the
   rows' bytes, and those Q8_PREFETCH_BYTES further on, requested first (the weight streams from
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
        for (int64_t p = 0; p < 4 * row_bytes; p += 64)                                       \
            __builtin_prefetch(row + p + Q8_PREFETCH_BYTES, 0, 3);                             \
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
        for (int64_t p = 0; p < nr * row_bytes; p += 64)                                      \
            __builtin_prefetch(row + p + Q8_PREFETCH_BYTES, 0, 3);                            \
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

/* y[:, n0:n1] = x @ W[n0:n1]^T with x given as m rows quantized by slotserve_q8_quantize with
   the kind slotserve_q8_act_kind(type) names (`act`, act_len bytes); y rows ldy floats apart.
   `threads` > 1 splits [n0, n1) into that many ranges of whole 4-row tiles run by one OpenMP
   team (the process's one pool, the one torch's own operators use: no second set of threads,
   and a hand-off of a few microseconds instead of a Python pool's tens). */
int slotserve_qmatmul_q8(int32_t type, const uint8_t* w, int64_t n, int64_t k,
        int64_t row_bytes, const uint8_t* act, int64_t act_len, int64_t m, float* y,
        int64_t ldy, int64_t n0, int64_t n1, int32_t threads) {
    const qtype_info* t = find_type(type);
    int32_t kind = slotserve_q8_act_kind(type);
    if (!t || kind < 0) return QMM_BAD_TYPE;
    if (check_layout(t, n, k, row_bytes) || m < 0 || n0 < 0 || n1 > n || n0 > n1
        || (m > 1 && ldy < n1))
        return QMM_BAD_SHAPE;
    int64_t arb = act_row_bytes(kind, k), nb = k / t->block;
    if (act_len < m * arb) return QMM_SMALL_SCRATCH;
    int64_t mb = Q8_X_BLOCK_BYTES / arb;
    mb = mb < 1 ? 1 : mb;
    int64_t tiles = (n1 - n0 + 3) / 4;
    int parts = threads < 1 ? 1 : threads > tiles ? (int)(tiles < 1 ? 1 : tiles) : threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
#endif
    for (int part = 0; part < parts; part++) {
        int64_t lo = n0 + tiles * part / parts * 4, hi = n0 + tiles * (part + 1) / parts * 4;
        hi = hi < n1 ? hi : n1;
        for (int64_t m0 = 0; m0 < m; m0 += mb) {
            int64_t m1 = m - m0 < mb ? m : m0 + mb;
#ifdef Q8_SIMD
            q8_kernel(type)(w, row_bytes, nb, act, arb, k, m0, m1, y, ldy, lo, hi);
#else
            for (int64_t r = lo; r < hi; r++)
                for (int64_t i = m0; i < m1; i++)
                    y[i * ldy + r] = dot_row_portable(type, w + r * row_bytes, nb,
                                                      act + i * arb, k);
#endif
        }
    }
    return QMM_OK;
}

/* ---- weights repacked at load into 16 interleaved rows (q8repack.h) ------------------- */

#include "q8repack.h"

/* Rows per packed group when this build multiplies `type` in the packed layout, else 0 (the
   weight then stays in its GGUF layout). */
int32_t slotserve_q8_repack_rows(int32_t type) {
#ifdef RP_SIMD
    return rp_type_ok(type) ? RP_ROWS : 0;
#else
    (void)type;
    return 0;
#endif
}

static int rp_check(int32_t type, int64_t n, int64_t k, int64_t row_bytes,
                    const qtype_info** t) {
    *t = find_type(type);
    if (!*t || !rp_type_ok(type)) return QMM_BAD_TYPE;
    if (check_layout(*t, n, k, row_bytes) || n % RP_ROWS) return QMM_BAD_SHAPE;
    return QMM_OK;
}

/* W [n, k] (rows row_bytes apart, n a multiple of 16) into the packed layout in `out` (n *
   row_bytes bytes, not overlapping w). */
int slotserve_q8_repack(int32_t type, const uint8_t* w, int64_t n, int64_t k,
                        int64_t row_bytes, uint8_t* out, int64_t out_len) {
    const qtype_info* t;
    int rc = rp_check(type, n, k, row_bytes, &t);
    if (rc) return rc;
    if (out_len < n * row_bytes) return QMM_SMALL_SCRATCH;
    int64_t nb = k / t->block, rec = (int64_t)RP_ROWS * t->bytes;
    for (int64_t g = 0; g < n / RP_ROWS; g++)
        for (int64_t b = 0; b < nb; b++)
            rp_pack_block(type, t->bytes, w + g * RP_ROWS * row_bytes + b * t->bytes, row_bytes,
                          out + g * RP_ROWS * row_bytes + b * rec);
    return QMM_OK;
}

/* out[i, :] = row rows[i] of a packed W dequantized: each block put back in its GGUF form,
   then the type's own dequantizer, so the values are those of slotserve_dequant_rows_f32. */
int slotserve_dequant_rows_packed(int32_t type, const uint8_t* wp, int64_t n, int64_t k,
        int64_t row_bytes, const int64_t* rows, int64_t num_rows, float* out, int64_t ldo) {
    const qtype_info* t;
    int rc = rp_check(type, n, k, row_bytes, &t);
    if (rc) return rc;
    if (num_rows < 0 || (num_rows > 1 && ldo < k)) return QMM_BAD_SHAPE;
    for (int64_t i = 0; i < num_rows; i++)
        if (rows[i] < 0 || rows[i] >= n) return QMM_BAD_ROW;
    int64_t nb = k / t->block, rec = (int64_t)RP_ROWS * t->bytes;
    uint8_t blk[256];  /* one block in its GGUF form */
    for (int64_t i = 0; i < num_rows; i++) {
        const uint8_t* grp = wp + rows[i] / RP_ROWS * RP_ROWS * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            rp_unpack_block(type, grp + b * rec, (int)(rows[i] % RP_ROWS), blk);
            t->fn(blk, 1, out + i * ldo + b * t->block);
        }
    }
    return QMM_OK;
}

/* slotserve_qmatmul_q8 for a weight packed by slotserve_q8_repack: y[:, 0:n] = x @ W^T, the
   groups of 16 rows split over `threads` as that function splits its tiles. */
int slotserve_qmatmul_q8_packed(int32_t type, const uint8_t* wp, int64_t n, int64_t k,
        int64_t row_bytes, const uint8_t* act, int64_t act_len, int64_t m, float* y,
        int64_t ldy, int32_t threads) {
#ifdef RP_SIMD
    const qtype_info* t;
    int rc = rp_check(type, n, k, row_bytes, &t);
    if (rc) return rc;
    if (m < 0 || (m > 1 && ldy < n)) return QMM_BAD_SHAPE;
    int64_t arb = act_row_bytes(slotserve_q8_act_kind(type), k), nb = k / t->block;
    if (act_len < m * arb) return QMM_SMALL_SCRATCH;
    int64_t mb = Q8_X_BLOCK_BYTES / arb;
    mb = mb < RP_MR ? RP_MR : mb / RP_MR * RP_MR;
    int64_t groups = n / RP_ROWS;
    int parts = threads < 1 ? 1 : threads > groups ? (int)(groups < 1 ? 1 : groups) : threads;
    rp_mm_fn fn = rp_kernel(type);
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
#endif
    for (int part = 0; part < parts; part++) {
        int64_t lo = groups * part / parts, hi = groups * (part + 1) / parts;
        for (int64_t m0 = 0; m0 < m; m0 += mb) {
            int64_t m1 = m - m0 < mb ? m : m0 + mb;
            fn(wp, nb, act, arb, k, m0, m1, y, ldy, lo, hi);
        }
    }
    return QMM_OK;
#else
    (void)type; (void)wp; (void)n; (void)k; (void)row_bytes; (void)act; (void)act_len;
    (void)m; (void)y; (void)ldy; (void)threads;
    return QMM_BAD_TYPE;
#endif
}
