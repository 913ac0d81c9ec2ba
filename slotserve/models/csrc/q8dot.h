/* Integer dot products of GGUF weight blocks with 8-bit activation rows (q8act.h), as
 * llama.cpp defines them per format (ggml-cpu quants.c, ggml_vec_dot_<type>_q8_<kind>):
 *
 *   Q4_0, Q5_0, Q8_0 x Q8_0:  sum_b dw_b * da_b * sum(qw * qa)            (qw signed)
 *   Q4_1, Q5_1 x Q8_1:        sum_b dw_b * da_b * sum(qw * qa) + mw_b * sa_b
 *   Q4_K, Q5_K x Q8_K:        sum_b dw * da * sum_s sc_s * sum(qw * qa)
 *                                 - dminw * da * sum_s mn_s * bsum_s     (32-value sub-blocks)
 *   Q6_K x Q8_K:              sum_b dw * da * sum_s sc_s * sum((qw - 32) * qa)  (16-value)
 *
 * Every integer sum is exact; only the float combination of the block scales rounds. Each
 * x86 level has its own instructions for the 32-byte integer dot (u8 x s8 -> 8 int32):
 * AVX-512 VNNI or AVX-VNNI `vpdpbusd`, else AVX2 `vpmaddubsw` + `vpmaddwd` (no overflow: the
 * unsigned operand is at most 128 here, so a pair stays below 2^15). Signed weights go
 * through |w| and sign(a, w), as ggml does. The portable build (any CPU) runs the same sums in
 * plain C. Weight rows are taken four at a time, so four independent accumulator chains hide
 * the multiply-add latency at one activation row. Included by qmatmul.c only. */
#ifndef SLOTSERVE_Q8DOT_H
#define SLOTSERVE_Q8DOT_H
#include "q8act.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_ISA "avx512-vnni"
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#elif defined(__AVXVNNI__)
#define Q8_ISA "avx-vnni"
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#else
#define Q8_ISA "avx2"
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

static inline __m256i dot_s8s8(__m256i w, __m256i a) {
    return dot_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
}

/* 16 int16 pair sums of u8 x s8, each pair then times its int16 scale: 8 int32. */
static inline __m256i dot_scaled(__m256i u, __m256i s, __m256i scale16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale16);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i nibbles32(const uint8_t* p) {  /* 16 bytes -> 16 low, 16 high nibbles */
    __m128i q = _mm_loadu_si128((const __m128i*)p);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

static inline __m256i bits_to_bytes(uint32_t bits) {  /* byte i: 0xff where bit i is set */
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                              0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

#define LOADU(p) _mm256_loadu_si256((const __m256i*)(p))

/* ---- one block of 32 (Q8_0 / Q8_1 activations): acc += scale * int dot ---------------- */

static inline __m256i q4_0_dot(const uint8_t* b, const int8_t* a) {
    return dot_s8s8(_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), LOADU(a));
}
static inline __m256i q5_0_dot(const uint8_t* b, const int8_t* a) {
    __m256i hi = _mm256_and_si256(bits_to_bytes(u32le(b + 2)), _mm256_set1_epi8(16));
    __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), hi), _mm256_set1_epi8(16));
    return dot_s8s8(q, LOADU(a));
}
static inline __m256i q8_0_dot(const uint8_t* b, const int8_t* a) {
    return dot_s8s8(LOADU(b + 2), LOADU(a));
}
static inline __m256i q4_1_dot(const uint8_t* b, const int8_t* a) {
    return dot_u8s8(nibbles32(b + 4), LOADU(a));
}
static inline __m256i q5_1_dot(const uint8_t* b, const int8_t* a) {
    __m256i hi = _mm256_and_si256(bits_to_bytes(u32le(b + 4)), _mm256_set1_epi8(16));
    return dot_u8s8(_mm256_or_si256(nibbles32(b + 8), hi), LOADU(a));
}

/* The block interface both families share: the integer vector, the scale its lanes' sum takes
   (with the activation's d), and a float term w_extra * a_extra (Q4_1 / Q5_1: m * s; the
   K-quants: the mins; the others: none). `side` is the activation's per-block data after d. */
#define BLOCK32(NAME, WITH_MIN)                                                               static inline __m256i NAME##_block(const uint8_t* b, const int8_t* a, const void* side,                                         int64_t bi, float* d, float* we, float* ae) {                  *d = f16(b);                                                                                  *we = WITH_MIN ? f16(b + 2) : 0.0f;                                                           *ae = WITH_MIN ? ((const float*)side)[bi] : 0.0f;                                             return NAME##_dot(b, a);                                                                  }
BLOCK32(q4_0, 0)
BLOCK32(q5_0, 0)
BLOCK32(q8_0, 0)
BLOCK32(q4_1, 1)
BLOCK32(q5_1, 1)

/* ---- super-blocks of 256 (Q8_K activations) ------------------------------------------- */

/* sum_s sc_s * (int dot of sub-block s), Q4_K / Q5_K: 8 sub-blocks of 32. */
static inline __m256i q45_k_isum(const uint8_t* qs, const uint8_t* qh, const int8_t* a,
                                 const uint8_t sc[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256i isum = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i q = LOADU(qs + 32 * c);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (qh) {
            __m256i h = LOADU(qh);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(h, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(h, 2 * c + 1), one), 4));
        }
        isum = _mm256_add_epi32(isum, dot_scaled(lo, LOADU(a + 64 * c),
                                                 _mm256_set1_epi16(sc[2 * c])));
        isum = _mm256_add_epi32(isum, dot_scaled(hi, LOADU(a + 64 * c + 32),
                                                 _mm256_set1_epi16(sc[2 * c + 1])));
    }
    return isum;
}

/* Q6_K: sum_s sc_s * dot(q6 unsigned, a) over 16 sub-blocks of 16 (the -32 offset is applied
   by the caller through the activation's bsums). */
static inline __m256i q6_k_isum(const uint8_t* b, const int8_t* a) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
    const int8_t* scales = (const int8_t*)(b + 192);
    __m256i isum = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i l0 = LOADU(b + 64 * h), l1 = LOADU(b + 64 * h + 32), qh = LOADU(b + 128 + 32 * h);
        __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                         _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        for (int s = 0; s < 4; s++) {
            __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), m2);
            __m256i q = _mm256_or_si256(lo[s], _mm256_slli_epi16(hb, 4));
            int e = 8 * h + 2 * s;
            __m256i sc = _mm256_set_m128i(_mm_set1_epi16(scales[e + 1]), _mm_set1_epi16(scales[e]));
            isum = _mm256_add_epi32(isum, dot_scaled(q, LOADU(a + 128 * h + 32 * s), sc));
        }
    }
    return isum;
}

/* One super-block (side: the activation's bsums): the min term is -dmin * d_a * sum_s mn_s *
   bsum_s (Q4_K / Q5_K); Q6_K has none, its -32 offset is an exact integer folded into the
   vector. */
static inline __m256i q45_k_block(const uint8_t* b, const int8_t* a, const int16_t* bs,
                                  float* d, float* we, int32_t* msum, const int five) {
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    int32_t ms = 0;
    for (int s = 0; s < 8; s++) ms += mn[s] * (bs[2 * s] + bs[2 * s + 1]);
    *d = f16(b);
    *we = -f16(b + 2);
    *msum = ms;
    return five ? q45_k_isum(b + 48, b + 16, a, sc) : q45_k_isum(b + 16, 0, a, sc);
}
#define BLOCK_K(NAME, FIVE)                                                                   static inline __m256i NAME##_block(const uint8_t* b, const int8_t* a, const void* side,                                         int64_t bi, float* d, float* we, float* ae) {                  int32_t msum;                                                                                 __m256i v = q45_k_block(b, a, (const int16_t*)side + 16 * bi, d, we, &msum, FIVE);            *ae = (float)msum;                                                                            return v;                                                                                 }
BLOCK_K(q4_k, 0)
BLOCK_K(q5_k, 1)

static inline __m256i q6_k_block(const uint8_t* b, const int8_t* a, const void* side,
                                 int64_t bi, float* d, float* we, float* ae) {
    const int8_t* scales = (const int8_t*)(b + 192);
    const int16_t* bs = (const int16_t*)side + 16 * bi;
    int32_t off = 0;
    for (int s = 0; s < 16; s++) off += scales[s] * bs[s];
    *d = f16(b + 208);
    *we = *ae = 0.0f;
    return _mm256_sub_epi32(q6_k_isum(b, a), _mm256_setr_epi32(32 * off, 0, 0, 0, 0, 0, 0, 0));
}

/* NR weight rows (nr <= 4) times one activation row: acc += (d_w * d_a) * isum per block,
   the extra term scaled by d_a as well for the K-quants (their s is d_a * bsum). */
#define DOTQ(NAME, BYTES, BLOCK)                                                              static inline __attribute__((always_inline)) void NAME##_q8(                                         const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* act, int64_t k,              float* y, const int nr) {                                                                 const int8_t* aq = (const int8_t*)act;                                                        const float* ad = (const float*)(act + k);                                                    const void* side = ad + nb;                                                                   __m256 acc[4];                                                                                float extra[4] = {0, 0, 0, 0};                                                                for (int j = 0; j < nr; j++) acc[j] = _mm256_setzero_ps();                                    for (int64_t b = 0; b < nb; b++) {                                                                for (int j = 0; j < nr; j++) {                                                                    const uint8_t* blk = w + j * row_bytes + (BYTES) * b;                                         float d, we, ae;                                                                              __m256i isum = NAME##_block(blk, aq + (BLOCK) * b, side, b, &d, &we, &ae);                    acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * ad[b]), _mm256_cvtepi32_ps(isum),                                          acc[j]);                                                             extra[j] += we * ((BLOCK) == 256 ? ad[b] * ae : ae);                                      }                                                                                         }                                                                                             for (int j = 0; j < nr; j++) y[j] = hsum8(acc[j]) + extra[j];                             }
DOTQ(q4_0, 18, 32)
DOTQ(q5_0, 22, 32)
DOTQ(q8_0, 34, 32)
DOTQ(q4_1, 20, 32)
DOTQ(q5_1, 24, 32)
DOTQ(q4_k, 144, 256)
DOTQ(q5_k, 176, 256)
DOTQ(q6_k, 210, 256)

#else  /* portable: the same integer sums in plain C */
#define Q8_ISA "portable"

static inline int32_t idot32(const int8_t* w, const int8_t* a) {
    int32_t s = 0;
    for (int l = 0; l < 32; l++) s += w[l] * a[l];
    return s;
}

/* A block of 32 weights as signed int8 (Q4_0, Q5_0: the offset already subtracted) or
   unsigned values (Q4_1, Q5_1). */
static inline void unpack32(int32_t type, const uint8_t* b, int8_t q[32]) {
    const uint8_t* qs = b + (type == 2 ? 2 : type == 3 ? 4 : type == 6 ? 6 : 8);
    uint32_t qh = type == 6 ? u32le(b + 2) : type == 7 ? u32le(b + 4) : 0;
    int off = type == 2 ? 8 : type == 6 ? 16 : 0;
    for (int j = 0; j < 16; j++) {
        int lo = qs[j] & 0x0f, hi = qs[j] >> 4;
        lo |= (int)((qh >> j) & 1u) << 4;
        hi |= (int)((qh >> (j + 16)) & 1u) << 4;
        q[j] = (int8_t)(lo - off);
        q[j + 16] = (int8_t)(hi - off);
    }
}

static float dot_row_portable(int32_t type, const uint8_t* w, int64_t nb, const uint8_t* act,
                              int64_t k) {
    const int8_t* aq = (const int8_t*)act;
    const float* ad = (const float*)(act + k);
    float sum = 0.0f, extra = 0.0f;
    int8_t q[256];
    if (type == 8 || type == 2 || type == 6 || type == 3 || type == 7) {
        int bytes = type == 8 ? 34 : type == 2 ? 18 : type == 6 ? 22 : type == 3 ? 20 : 24;
        const float* as = ad + nb;
        for (int64_t b = 0; b < nb; b++, w += bytes) {
            if (type == 8) memcpy(q, w + 2, 32);
            else unpack32(type, w, q);
            sum += f16(w) * ad[b] * (float)idot32(q, aq + 32 * b);
            if (type == 3 || type == 7) extra += f16(w + 2) * as[b];
        }
        return sum + extra;
    }
    const int16_t* bsums = (const int16_t*)(ad + nb);
    int bytes = type == 12 ? 144 : type == 13 ? 176 : 210;
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        const int8_t* a = aq + 256 * b;
        const int16_t* bs = bsums + 16 * b;
        int32_t isum = 0;
        if (type == 14) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t* scales = (const int8_t*)(w + 192);
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++)
                    for (int l = 0; l < 32; l++) {
                        int lo = (ql[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0f;
                        int v = lo | ((qh[32 * h + l] >> (2 * s)) & 3) << 4;
                        q[128 * h + 32 * s + l] = (int8_t)(v - 32);
                    }
            for (int g = 0; g < 16; g++) {
                int32_t s16 = 0;
                for (int l = 0; l < 16; l++) s16 += q[16 * g + l] * a[16 * g + l];
                isum += scales[g] * s16;
            }
            sum += f16(w + 208) * ad[b] * (float)isum;
            continue;
        }
        uint8_t sc[8], mn[8];
        scale_min_k4(w + 4, sc, mn);
        const uint8_t* qh = type == 13 ? w + 16 : 0;
        const uint8_t* qs = w + (type == 13 ? 48 : 16);
        int32_t msum = 0;
        for (int s = 0; s < 8; s++) {
            for (int l = 0; l < 32; l++) {
                int v = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f;
                if (qh) v |= ((qh[l] >> s) & 1) << 4;
                q[l] = (int8_t)v;
            }
            isum += sc[s] * idot32(q, a + 32 * s);
            msum += mn[s] * (bs[2 * s] + bs[2 * s + 1]);
        }
        sum += f16(w) * ad[b] * (float)isum;
        extra -= f16(w + 2) * ad[b] * (float)msum;
    }
    return sum + extra;
}
#endif  /* Q8_SIMD */

#endif
