/* Paged decode attention for the CPU, float32 queries: one query token per sequence, K/V read
 * straight from the paged cache (see slotserve/models/native_attention.py for why, and for
 * how this file is built and called).
 *
 * One call handles the decodes [b0, b1). Per sequence: scores for every query head in one pass
 * over its K rows (a token's row holds all KV heads, so blocks are read front to back), a
 * softmax per head, then one pass over the V rows. Vector types keep the 16-wide dot products
 * in registers; expf is declared with the vector ABI so the softmax loop calls glibc's libmvec
 * (when linking it fails, the plain declaration from math.h is used).
 *
 * A sliding window of W tokens attends to positions [n - W, n) of a sequence of n tokens
 * (transformers' rule: key position > query position - W); window <= 0 means the whole
 * context. Blocks wholly before the window are never read.
 *
 * The cache rows may be stored as float32, bfloat16, float16 or int8 (q8_0 blocks along the
 * row, the head_dim values then their float16 scales; models/kv_storage.py): each is widened
 * to float32 as it is read, 16 values at a time (named vector instructions on the x86 levels),
 * int8 values times their block's scale. Each row is widened once for all the query heads that
 * share its KV head (GQA), in tiles of up to four heads whose sums stay in registers. One
 * body serves every storage type: the type is a constant argument of an always-inlined
 * function, so each gets its own loops.
 *
 * The Python caller checks shapes, strides and dtypes; what only the data can tell (context
 * lengths, block ids, the scratch size they need) is checked here, before any memory is read.
 * Nothing is allocated: the caller hands in `scratch` (the scores) and `out`.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include "simd.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif
#ifdef USE_MVEC
__attribute__((simd("notinbranch"))) float expf(float);
#endif

enum {
    SLOTSERVE_OK = 0,
    SLOTSERVE_BAD_CTX_LEN = 1,   /* a context length < 1 or beyond its block-table row */
    SLOTSERVE_BAD_BLOCK_ID = 2,  /* a block id outside [0, num_blocks) */
    SLOTSERVE_SMALL_SCRATCH = 3, /* scratch holds fewer than heads * attended tokens floats */
    SLOTSERVE_BAD_KV_DTYPE = 4,  /* a storage type code this file does not know */
};

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_INT8 = 3 };

/* The vector the loops work in: VW floats. A row is still read in 16-value chunks, and every
   sum runs per 16-lane chunk lane in the same order at every width, so the bits do not depend
   on VW. AVX2 has 16 ymm registers and no 512-bit type: GCC 12 lowers the 64-byte generic
   vectors there into ymm pairs that round-trip through the stack (the tile's accumulators,
   the loaded row values and `acc` all went through memory, 8.5x the AVX-512 time at batch
   32), so AVX2 works in explicit 8-lane halves: NS vectors make one 16-value chunk. */
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define VW 8
typedef float vf __attribute__((vector_size(32), aligned(4)));
typedef int32_t vfi __attribute__((vector_size(32)));
#else
#define VW 16
typedef v16 vf;
typedef v16i vfi;
#endif
enum { NS = 16 / VW };

typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
typedef _Float16 v16f16 __attribute__((vector_size(32), aligned(2)));
typedef int8_t v16i8 __attribute__((vector_size(16), aligned(1)));

/* Vector v of a row (values v*VW .. v*VW+VW-1) widened to floats. GCC 12 lowers
   __builtin_convertvector of float16 / int8 vectors to one scalar conversion per lane (8x
   slower than a float32 cache at batch 32), so the x86 levels name the vector instructions.
   The conversions are exact, so every path gives the same bits. */
#if defined(__AVX512F__)
static inline vf f16_load(const char* row, int64_t v) {
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(row + 32 * v)));
}
static inline vf i8_load(const char* row, int64_t v) {
    return (vf)_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * v))));
}
static inline vf bf16_load(const char* row, int64_t v) {
    return (vf)(__builtin_convertvector(((const v16u16*)row)[v], v16i) << 16);
}
#elif VW == 8
static inline vf f16_load(const char* row, int64_t v) {
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + 16 * v)));
}
static inline vf i8_load(const char* row, int64_t v) {
    return (vf)_mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + 8 * v))));
}
static inline vf bf16_load(const char* row, int64_t v) {
    __m128i h = _mm_loadu_si128((const __m128i*)(row + 16 * v));
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
}
#else
static inline vf f16_load(const char* row, int64_t v) {
    v16f16 h;
    memcpy(&h, row + 32 * v, sizeof h);
    return __builtin_convertvector(h, v16);
}
static inline vf i8_load(const char* row, int64_t v) {
    v16i8 b;
    memcpy(&b, row + 16 * v, sizeof b);
    return __builtin_convertvector(b, v16);
}
static inline vf bf16_load(const char* row, int64_t v) {
    return (vf)(__builtin_convertvector(((const v16u16*)row)[v], v16i) << 16);
}
#endif

static inline __attribute__((always_inline)) vf loadv(const char* row, int64_t v,
                                                       const int kvt) {
    if (kvt == KV_F32) return ((const vf*)row)[v];
    if (kvt == KV_BF16) return bf16_load(row, v);
    if (kvt == KV_F16) return f16_load(row, v);
    return i8_load(row, v);
}

/* The sum of one 16-lane chunk held as NS vectors, in simd.h's hsum order (lane i + lane
   i + 8 first, then + 4, + 2, + 1). */
#ifdef __clang__
#define SHUF8(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define SHUF8(x, ...) __builtin_shuffle(x, (vfi){__VA_ARGS__})
#endif
static inline float hsum_chunk(const vf* a) {
#if VW == 8
    vf x = a[0] + a[1];
    x += SHUF8(x, 4, 5, 6, 7, 0, 1, 2, 3);
    x += SHUF8(x, 2, 3, 0, 1, 6, 7, 4, 5);
    x += SHUF8(x, 1, 0, 3, 2, 5, 4, 7, 6);
    return x[0];
#else
    return hsum(a[0]);
#endif
}

/* The float16 scale of q8_0 block `blk` of an int8 row (1 for the other types): the scales
   follow the head_dim values. */
static inline __attribute__((always_inline)) float block_scale(const char* row, int64_t blk,
                                                               int64_t head_dim, const int kvt) {
    if (kvt != KV_INT8) return 1.0f;
    _Float16 s;
    memcpy(&s, row + head_dim + 2 * blk, sizeof s);
    return (float)s;
}

/* Query heads are handled in tiles of up to HT that share one KV head (GQA): each value of
   a K or V row is widened once and used by every head of the tile, with the tile's
   accumulators in registers. Per head and lane the sums run in the same order as one head at
   a time would (chunks for a score, tokens for an output), so the bits do not depend on the
   tiling. */
enum { HT = 4 };

/* Scores of query heads h0 .. h0 + nt - 1 against one K row `kr`, into p[h * span + at]. */
static inline __attribute__((always_inline)) void score_tile(
        const char* kr, const float* qb, int64_t h0, const int nt, int64_t nblk, int64_t cpb,
        int64_t head_dim, float scale, float* p, int64_t span, int64_t at, const int kvt) {
    const vf* qv = (const vf*)qb;
    int64_t nv = head_dim / VW;
    vf a[HT][NS];
    for (int h = 0; h < nt; h++)
        for (int s = 0; s < NS; s++) a[h][s] = (vf){0};
    for (int64_t bk = 0, c = 0; bk < nblk; bk++) {
        float sc = block_scale(kr, bk, head_dim, kvt);
        for (int64_t j = 0; j < cpb; j++, c++) {
            for (int s = 0; s < NS; s++) {
                vf x = loadv(kr, c * NS + s, kvt) * sc;  /* scaled once for the tile */
                for (int h = 0; h < nt; h++) a[h][s] += qv[(h0 + h) * nv + c * NS + s] * x;
            }
        }
    }
    for (int h = 0; h < nt; h++) p[(h0 + h) * span + at] = scale * hsum_chunk(a[h]);
}

/* acc[h] += p[h][i] * V row `vr` for the heads h0 .. h0 + nt - 1 (probabilities
   p[h * span + at]): the row's values are read front to back, as they lie in memory. */
static inline __attribute__((always_inline)) void value_tile(
        const char* vr, const float* p, int64_t span, int64_t at, int64_t h0, const int nt,
        vf* acc, int64_t nv, int64_t nblk, int64_t cpb, int64_t head_dim, const int kvt) {
    float pw[HT];
    for (int h = 0; h < nt; h++) pw[h] = p[(h0 + h) * span + at];
    for (int64_t bk = 0, c = 0; bk < nblk; bk++) {
        float sc = block_scale(vr, bk, head_dim, kvt);
        vf w[HT];
        for (int h = 0; h < nt; h++) w[h] = (vf){0} + pw[h] * sc;
        for (int64_t j = 0; j < cpb; j++, c++) {
            for (int s = 0; s < NS; s++) {
                vf x = loadv(vr, c * NS + s, kvt);
                for (int h = 0; h < nt; h++) acc[(h0 + h) * nv + c * NS + s] += w[h] * x;
            }
        }
    }
}

/* The tile functions with their head count a constant, so each unrolls into registers. */
#define BY_TILE(nt, call) \
    switch (nt) { \
    case 4: call(4); break; \
    case 3: call(3); break; \
    case 2: call(2); break; \
    default: call(1); break; \
    }

/* Blocks sit at random places, so the hardware prefetcher stalls at every block start:
   while a block's row i is used, row i of the sequence's next block is requested. */
#define PREFETCH_ROW(ptr) \
    for (int64_t j = 0; j < tok_stride; j += 64) __builtin_prefetch((ptr) + j)

static inline __attribute__((always_inline)) int decode(
        const float* q, int64_t q_stride, const char* k_cache, const char* v_cache,
        int64_t num_blocks, const int64_t* block_table, int64_t max_blocks,
        const int64_t* ctx_lens, int64_t window, float* out, int64_t out_stride,
        float* scratch, int64_t scratch_len, int64_t b0, int64_t b1, int64_t kvh,
        int64_t groups, int64_t head_dim, int64_t bs, float scale, int64_t row_bytes,
        const int kvt) {
    int64_t nh = kvh * groups, nv = head_dim / VW;
    /* Scale blocks per row and 16-value chunks per block (int8: 32 values, or the whole row
       when head_dim is no multiple of 32; the other types: one unscaled block). */
    int64_t qk = kvt == KV_INT8 && head_dim % 32 == 0 ? 32 : head_dim;
    int64_t nblk = head_dim / qk, cpb = qk / 16;
    int64_t tok_stride = kvh * row_bytes, blk_stride = bs * tok_stride;
    for (int64_t b = b0; b < b1; b++) {
        int64_t n = ctx_lens[b];
        if (n < 1 || n > max_blocks * bs) return SLOTSERVE_BAD_CTX_LEN;
        int64_t lo = window > 0 && n > window ? n - window : 0;  /* first attended position */
        int64_t span = n - lo;
        if (nh * span > scratch_len) return SLOTSERVE_SMALL_SCRATCH;
        const int64_t* blocks = block_table + b * max_blocks;
        int64_t first = lo / bs, last = (n + bs - 1) / bs;
        for (int64_t i = first; i < last; i++)
            if (blocks[i] < 0 || blocks[i] >= num_blocks) return SLOTSERVE_BAD_BLOCK_ID;
        const float* qb = q + b * q_stride;
        float* p = scratch;  /* p[hq * span + t - lo]: scores, then probabilities */
        for (int64_t t0 = first * bs; t0 < n; t0 += bs) {
            const char* blk = k_cache + blocks[t0 / bs] * blk_stride;
            const char* next = t0 + bs < n ? k_cache + blocks[t0 / bs + 1] * blk_stride : blk;
            int64_t i0 = t0 < lo ? lo - t0 : 0, tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t i = i0; i < tn; i++) {
                PREFETCH_ROW(next + i * tok_stride);
                for (int64_t g = 0; g < kvh; g++) {
                    const char* kr = blk + i * tok_stride + g * row_bytes;
                    for (int64_t h0 = g * groups; h0 < (g + 1) * groups; h0 += HT) {
                        int64_t left = (g + 1) * groups - h0;
#define SCORE(nt) score_tile(kr, qb, h0, nt, nblk, cpb, head_dim, scale, p, span, \
                             t0 + i - lo, kvt)
                        BY_TILE(left < HT ? left : HT, SCORE)
#undef SCORE
                    }
                }
            }
        }
        for (int64_t hq = 0; hq < nh; hq++) {
            float* ph = p + hq * span;
            float m = ph[0], sum = 0.0f;
            for (int64_t t = 1; t < span; t++) m = ph[t] > m ? ph[t] : m;
#pragma omp simd reduction(+:sum)
            for (int64_t t = 0; t < span; t++) { ph[t] = expf(ph[t] - m); sum += ph[t]; }
            float inv = 1.0f / sum;
            for (int64_t t = 0; t < span; t++) ph[t] *= inv;
        }
        vf* acc = (vf*)(out + b * out_stride);
        memset(acc, 0, sizeof(float) * nh * head_dim);
        for (int64_t t0 = first * bs; t0 < n; t0 += bs) {
            const char* blk = v_cache + blocks[t0 / bs] * blk_stride;
            const char* next = t0 + bs < n ? v_cache + blocks[t0 / bs + 1] * blk_stride : blk;
            int64_t i0 = t0 < lo ? lo - t0 : 0, tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t i = i0; i < tn; i++) {
                PREFETCH_ROW(next + i * tok_stride);
                for (int64_t g = 0; g < kvh; g++) {
                    const char* vr = blk + i * tok_stride + g * row_bytes;
                    for (int64_t h0 = g * groups; h0 < (g + 1) * groups; h0 += HT) {
                        int64_t left = (g + 1) * groups - h0;
#define VALUE(nt) value_tile(vr, p, span, t0 + i - lo, h0, nt, acc, nv, nblk, cpb, \
                             head_dim, kvt)
                        BY_TILE(left < HT ? left : HT, VALUE)
#undef VALUE
                    }
                }
            }
        }
    }
    return SLOTSERVE_OK;
}


/* q [nd, kvh * groups, head_dim] (rows q_stride floats apart, heads contiguous),
   caches [num_blocks, bs, kvh, row_bytes] contiguous in storage type kv_dtype (the enum
   above), block_table [nd, max_blocks], ctx_lens [nd], out [nd, kvh * groups * head_dim]
   (rows out_stride apart), scratch [scratch_len]. head_dim % 16 == 0. */
int slotserve_paged_decode(const float* q, int64_t q_stride, const void* k_cache,
        const void* v_cache, int64_t num_blocks, const int64_t* block_table,
        int64_t max_blocks, const int64_t* ctx_lens, int64_t window, float* out,
        int64_t out_stride, float* scratch, int64_t scratch_len, int64_t b0, int64_t b1,
        int64_t kvh, int64_t groups, int64_t head_dim, int64_t bs, float scale,
        int64_t row_bytes, int kv_dtype) {
#define CALL(kvt) decode(q, q_stride, k_cache, v_cache, num_blocks, block_table, max_blocks, \
                         ctx_lens, window, out, out_stride, scratch, scratch_len, b0, b1, kvh, \
                         groups, head_dim, bs, scale, row_bytes, kvt)
    switch (kv_dtype) {
    case KV_F32: return CALL(KV_F32);
    case KV_BF16: return CALL(KV_BF16);
    case KV_F16: return CALL(KV_F16);
    case KV_INT8: return CALL(KV_INT8);
    default: return SLOTSERVE_BAD_KV_DTYPE;
    }
#undef CALL
}
