/* Block-quantized matmul for the CPU: y = x @ W^T with W kept in one of GGUF's block formats
 * (see slotserve/models/native_qmatmul.py for why, and for how this file is built and called).
 * This file holds the entry points and their argument checks; the kernels live in headers by
 * concept: qmatmul_f32.h (float32 activations), q8act.h (activations quantized to 8 bits),
 * q8dot.h / q8dot512.h / q8mm.h (integer dots over GGUF-layout blocks), q8repack.h (the
 * interleaved layout weights are repacked into at load; its kernels q8repack512.h, AVX-512
 * VNNI, and q8repack256.h, AVX2 / AVX-VNNI).
 *
 * Float32 activations (`exact`): every weight is dequantized to exactly the float32 value
 * `gguf`'s reference dequantizer gives (qblocks.h: same operations in the same order; the file
 * is compiled with -ffp-contract=off so no multiply-add is fused there), and only the order of
 * the float32 sums in the dot products differs from dequantize-then-matmul. Per tile of weight
 * rows: the rows are dequantized into the scratch once, then every row block of x (kept in L2)
 * runs against them in MR x NR register tiles, one horizontal sum per output at the end.
 *
 * Int8 activations (`auto`): the rows of x are quantized as llama.cpp does (q8act.h) and
 * multiplied with integer dot products per block, then the scales. `slotserve_qmatmul_q8_x`
 * does both for a list of weights sharing x in one call (the decode step's path).
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

#include "qblocks.h"

/* How many bytes ahead the int8 kernels ask for a streamed weight's bytes (prefetcht0), and
   from how many activation rows a call over a light type (Q4_0 / Q5_0 / Q8_0: little
   arithmetic per byte) does: chosen per CPU at load (native_qmatmul.py: prefetch_policy). On
   the Intel Xeon this project ran on, 4 KiB ahead filled the read bandwidth that the 262k x
   640 Q8_0 output projection left unused at one row (prefetchnta, or 16 KiB and more ahead,
   left a third to half of it). On AMD Zen 4 the hardware prefetcher alone streams that
   projection faster at one or two rows (6.0 against 8.8 ms at one), while from about four
   rows, and for the K-quants at any (their tiles spend more arithmetic per byte: Gemma's Q6_K
   ffn_down at one row 0.62 against 1.30 ms a step), the requests ahead win. */
static int64_t q8_prefetch = 4096, q8_light_rows = 1, q8_k4_l2 = 0;
/* AVX2's int16 Q8_0 path (q8repack256.h: the output projection) below 4 activation rows: how
   many bytes ahead it asks for its weight (0: none). On the AMD Zen 3 here (EPYC, AVX2 only;
   decode_step_profile --gemma --batch 1, 3 rounds) 2 KiB ahead read the 262k x 640 projection
   in 9.5-10.3 ms against 10.7-12.2 without (1 KiB 9.6-11.8, 512 B 10.9-11.6); Intel and
   Zen 4 read it faster without. */
static int64_t q8_i16_few = 0;
/* `q4k_l2_bytes` > 0: a packed Q4_K tile asks for its weight's bytes that far ahead into L2
   (prefetcht2) instead of q8_prefetch's into L1. Why: on the AMD EPYC here a Q4_K tile spends
   the most arithmetic per byte of any type, and with its requests going to L1 4 KiB ahead its
   read from DRAM did not overlap that arithmetic at all (640 x 1024 at one row: 25 us cold
   against 11.5 us hot in cache; 16 KiB ahead into L2: 15 us; 8-48 KiB all gave 15-17 us),
   while Q6_K reads fastest as it was (4 KiB into L1: 37 us; into L2 at any distance 48-60). */
void slotserve_set_prefetch(int64_t bytes, int64_t light_min_rows, int64_t q4k_l2_bytes,
                            int64_t i16_few_bytes) {
    q8_prefetch = bytes < 0 ? 0 : bytes;
    q8_light_rows = light_min_rows < 1 ? 1 : light_min_rows;
    q8_k4_l2 = q4k_l2_bytes < 0 ? 0 : q4k_l2_bytes;
    q8_i16_few = i16_few_bytes < 0 ? 0 : i16_few_bytes;
}
/* A packed Q4_K record's prefetches (rb bytes from rec), per the policy above. */
#define Q8_K4_PREFETCH(rec, rb)                                                              \
    do {                                                                                     \
        if (q8_k4_l2)                                                                        \
            for (int64_t p_ = 0; p_ < (rb); p_ += 64)                                        \
                __builtin_prefetch((rec) + p_ + q8_k4_l2, 0, 1);                             \
        else                                                                                 \
            for (int64_t p_ = 0; p_ < (rb); p_ += 64)                                        \
                __builtin_prefetch((rec) + p_ + q8_prefetch, 0, 3);                          \
    } while (0)
/* Whether a call over activation rows [m0, m1) prefetches its weight's bytes. */
static inline int q8_prefetching(int64_t m0, int64_t m1, int light) {
    return q8_prefetch && (!light || m1 - m0 >= q8_light_rows);
}

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

#include "qmatmul_f32.h"

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

#include "q8mm.h"

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

/* Output columns [lo, hi) of a GGUF-layout weight for activation rows [0, m). */
static void q8_rows(int32_t type, const qtype_info* t, const uint8_t* w, int64_t row_bytes,
                    int64_t k, const uint8_t* act, int64_t arb, int64_t m, float* y,
                    int64_t ldy, int64_t lo, int64_t hi) {
    int64_t mb = Q8_X_BLOCK_BYTES / arb, nb = k / t->block;
    mb = mb < 1 ? 1 : mb;
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
        int64_t m1 = m - m0 < mb ? m : m0 + mb;
#ifdef Q8_SIMD
        q8_kernel(type)(w, row_bytes, nb, act, arb, k, m0, m1, y, ldy, lo, hi);
#else
        for (int64_t r = lo; r < hi; r++)
            for (int64_t i = m0; i < m1; i++)
                y[i * ldy + r] = dot_row_portable(type, w + r * row_bytes, nb, act + i * arb, k);
#endif
    }
}

/* Share `part` of `parts` of [n0, n1): whole 4-row tiles, the last share takes the rest. */
static void q8_share(int64_t n0, int64_t n1, int part, int parts, int64_t* lo, int64_t* hi) {
    int64_t tiles = (n1 - n0 + 3) / 4;
    *lo = n0 + tiles * part / parts * 4;
    *hi = n0 + tiles * (part + 1) / parts * 4;
    *hi = *hi < n1 ? *hi : n1;
    *lo = *lo < *hi ? *lo : *hi;
}

static int clamp_parts(int32_t threads, int64_t units) {
    return threads < 1 || units < 1 ? 1 : threads > units ? (int)units : threads;
}

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
    int64_t arb = act_row_bytes(kind, k);
    if (act_len < m * arb) return QMM_SMALL_SCRATCH;
    int parts = clamp_parts(threads, (n1 - n0 + 3) / 4);
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
#endif
    for (int part = 0; part < parts; part++) {
        int64_t lo, hi;
        q8_share(n0, n1, part, parts, &lo, &hi);
        q8_rows(type, t, w, row_bytes, k, act, arb, m, y, ldy, lo, hi);
    }
    return QMM_OK;
}

/* ---- weights repacked at load into groups of interleaved rows (q8repack.h) ------------ */

#include "q8repack.h"

/* Rows per packed group when this build multiplies `type` in the packed layout (16 with
   AVX-512 VNNI, 8 with AVX2), else 0 (the weight then stays in its GGUF layout). */
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

/* W [n, k] (rows row_bytes apart, n a multiple of RP_ROWS) into the packed layout in `out` (n *
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
            rp_pack_block(type, w + g * RP_ROWS * row_bytes + b * t->bytes, row_bytes,
                          out + g * RP_ROWS * row_bytes + b * rec, RP_ROWS, RP_Q8_XOR);
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
            rp_unpack_block(type, grp + b * rec, (int)(rows[i] % RP_ROWS), blk, RP_ROWS,
                            RP_Q8_XOR);
            t->fn(blk, 1, out + i * ldo + b * t->block);
        }
    }
    return QMM_OK;
}

#ifdef RP_SIMD
/* Groups [g0, g1) of RP_ROWS rows of a packed weight for activation rows [0, m). */
static void rp_rows(int32_t type, const qtype_info* t, const uint8_t* wp, int64_t k,
                    const uint8_t* act, int64_t arb, int64_t m, float* y, int64_t ldy,
                    int64_t g0, int64_t g1) {
    int64_t mb = Q8_X_BLOCK_BYTES / arb;
    mb = mb < RP_MR ? RP_MR : mb / RP_MR * RP_MR;
    rp_mm_fn fn = rp_kernel(type);
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
        int64_t m1 = m - m0 < mb ? m : m0 + mb;
        fn(wp, k / t->block, act, arb, k, m0, m1, y, ldy, g0, g1);
    }
}
#endif

/* slotserve_qmatmul_q8 for a weight packed by slotserve_q8_repack: y[:, 0:n] = x @ W^T, the
   groups of RP_ROWS rows split over `threads` as that function splits its tiles. */
int slotserve_qmatmul_q8_packed(int32_t type, const uint8_t* wp, int64_t n, int64_t k,
        int64_t row_bytes, const uint8_t* act, int64_t act_len, int64_t m, float* y,
        int64_t ldy, int32_t threads) {
#ifdef RP_SIMD
    const qtype_info* t;
    int rc = rp_check(type, n, k, row_bytes, &t);
    if (rc) return rc;
    if (m < 0 || (m > 1 && ldy < n)) return QMM_BAD_SHAPE;
    int64_t arb = act_row_bytes(slotserve_q8_act_kind(type), k);
    if (act_len < m * arb) return QMM_SMALL_SCRATCH;
    int64_t groups = n / RP_ROWS;
    int parts = clamp_parts(threads, groups);
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
#endif
    for (int part = 0; part < parts; part++)
        rp_rows(type, t, wp, k, act, arb, m, y, ldy, groups * part / parts,
                groups * (part + 1) / parts);
    return QMM_OK;
#else
    (void)type; (void)wp; (void)n; (void)k; (void)row_bytes; (void)act; (void)act_len;
    (void)m; (void)y; (void)ldy; (void)threads;
    return QMM_BAD_TYPE;
#endif
}

#include "q8call.h"
#include "q8layers.h"
