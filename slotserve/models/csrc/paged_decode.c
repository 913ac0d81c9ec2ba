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

typedef uint16_t v16u16 __attribute__((vector_size(32), aligned(2)));
typedef _Float16 v16f16 __attribute__((vector_size(32), aligned(2)));
typedef int8_t v16i8 __attribute__((vector_size(16), aligned(1)));

/* 16 float16 / int8 values widened to floats. GCC 12 lowers __builtin_convertvector of these
   types to one scalar conversion per lane (8x slower than a float32 cache at batch 32), so the
   x86 levels name the vector instructions: AVX-512 converts 16 lanes at once, AVX2 + F16C two
   halves of 8. The conversions are exact, so every path gives the same bits. */
#if defined(__AVX512F__)
static inline v16 f16_to_v16(const char* p) {
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
static inline v16 i8_to_v16(const char* p) {
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#elif defined(__AVX2__) && defined(__F16C__)
typedef union { v16 v; __m256 h[2]; } v16_halves;
static inline v16 f16_to_v16(const char* p) {
    v16_halves r;
    r.h[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    r.h[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
    return r.v;
}
static inline v16 i8_to_v16(const char* p) {
    v16_halves r;
    r.h[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    r.h[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
    return r.v;
}
#else
static inline v16 f16_to_v16(const char* p) {
    v16f16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, v16);
}
static inline v16 i8_to_v16(const char* p) {
    v16i8 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v16);
}
#endif

/* Values c*16 .. c*16+15 of a cache row, as floats. */
static inline __attribute__((always_inline)) v16 load16(const char* row, int64_t c,
                                                         const int kvt) {
    if (kvt == KV_F32) return ((const v16*)row)[c];
    if (kvt == KV_BF16) {
        v16i bits = __builtin_convertvector(((const v16u16*)row)[c], v16i) << 16;
        return (v16)bits;
    }
    if (kvt == KV_F16) return f16_to_v16(row + 32 * c);
    return i8_to_v16(row + 16 * c);
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
    v16 a[HT];
    for (int h = 0; h < nt; h++) a[h] = (v16){0};
    for (int64_t bk = 0, c = 0; bk < nblk; bk++) {
        float sc = block_scale(kr, bk, head_dim, kvt);
        for (int64_t j = 0; j < cpb; j++, c++) {
            v16 x = load16(kr, c, kvt) * sc;  /* scaled once for the tile (int8 only) */
            for (int h = 0; h < nt; h++) a[h] += ((const v16*)(qb + (h0 + h) * head_dim))[c] * x;
        }
    }
    for (int h = 0; h < nt; h++) p[(h0 + h) * span + at] = scale * hsum(a[h]);
}

/* acc[h] += p[h][i] * V row `vr` for the heads h0 .. h0 + nt - 1 (probabilities
   p[h * span + at]): the row's rows are read front to back, as they lie in memory. */
static inline __attribute__((always_inline)) void value_tile(
        const char* vr, const float* p, int64_t span, int64_t at, int64_t h0, const int nt,
        v16* acc, int64_t nc, int64_t nblk, int64_t cpb, int64_t head_dim, const int kvt) {
    float pw[HT];
    for (int h = 0; h < nt; h++) pw[h] = p[(h0 + h) * span + at];
    for (int64_t bk = 0, c = 0; bk < nblk; bk++) {
        float sc = block_scale(vr, bk, head_dim, kvt);
        v16 w[HT];
        for (int h = 0; h < nt; h++) w[h] = (v16){0} + pw[h] * sc;
        for (int64_t j = 0; j < cpb; j++, c++) {
            v16 x = load16(vr, c, kvt);
            for (int h = 0; h < nt; h++) acc[(h0 + h) * nc + c] += w[h] * x;
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
    int64_t nh = kvh * groups, nc = head_dim / 16;
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
        v16* acc = (v16*)(out + b * out_stride);
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
#define VALUE(nt) value_tile(vr, p, span, t0 + i - lo, h0, nt, acc, nc, nblk, cpb, \
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
