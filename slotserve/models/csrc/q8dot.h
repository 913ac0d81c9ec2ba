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

/* ---- the weight blocks decoded, 32 values at a time ------------------------------------
   Each decoder gives chunk c of a block as 32 bytes for the pair dot (`pdot`): signed values
   for Q4_0 / Q5_0 / Q8_0 (|w| and sign(a, w) then), unsigned ones for the rest, and for the
   K-quants the int16 scales of its sub-blocks. A weight block is decoded once per tile and
   multiplied with every activation row of the tile. */

typedef struct { __m256i q, sc; } wchunk;

static inline wchunk q4_0_chunk(const uint8_t* b, int c, const uint8_t* sc) {
    (void)c; (void)sc;
    return (wchunk){_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), _mm256_setzero_si256()};
}
static inline wchunk q5_0_chunk(const uint8_t* b, int c, const uint8_t* sc) {
    (void)c; (void)sc;
    __m256i hi = _mm256_and_si256(bits_to_bytes(u32le(b + 2)), _mm256_set1_epi8(16));
    __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), hi), _mm256_set1_epi8(16));
    return (wchunk){q, _mm256_setzero_si256()};
}
static inline wchunk q8_0_chunk(const uint8_t* b, int c, const uint8_t* sc) {
    (void)c; (void)sc;
    return (wchunk){LOADU(b + 2), _mm256_setzero_si256()};
}
static inline wchunk q4_1_chunk(const uint8_t* b, int c, const uint8_t* sc) {
    (void)c; (void)sc;
    return (wchunk){nibbles32(b + 4), _mm256_setzero_si256()};
}
static inline wchunk q5_1_chunk(const uint8_t* b, int c, const uint8_t* sc) {
    (void)c; (void)sc;
    __m256i hi = _mm256_and_si256(bits_to_bytes(u32le(b + 4)), _mm256_set1_epi8(16));
    return (wchunk){_mm256_or_si256(nibbles32(b + 8), hi), _mm256_setzero_si256()};
}
/* Q4_K / Q5_K: sub-block c is nibble c % 2 of qs[32 (c / 2) ...] (Q5_K: bit c of qh[l] on
   top); sc: the 8 six-bit scales. */
static inline wchunk q4_k_chunk(const uint8_t* b, int c, const uint8_t* sc) {
    __m256i q = _mm256_srli_epi16(LOADU(b + 16 + 32 * (c / 2)), 4 * (c % 2));
    return (wchunk){_mm256_and_si256(q, _mm256_set1_epi8(0x0f)), _mm256_set1_epi16(sc[c])};
}
static inline wchunk q5_k_chunk(const uint8_t* b, int c, const uint8_t* sc) {
    __m256i q = _mm256_srli_epi16(LOADU(b + 48 + 32 * (c / 2)), 4 * (c % 2));
    __m256i h = _mm256_and_si256(_mm256_srli_epi16(LOADU(b + 16), c), _mm256_set1_epi8(1));
    q = _mm256_or_si256(_mm256_and_si256(q, _mm256_set1_epi8(0x0f)), _mm256_slli_epi16(h, 4));
    return (wchunk){q, _mm256_set1_epi16(sc[c])};
}
/* Q6_K: chunk c = 32 s + 128 h (s = c % 4, h = c / 4): the low nibble (s < 2) or high nibble
   of ql[64 h + 32 (s % 2) ...], bits 2 s of qh[32 h ...] on top (unsigned, 0..63; the -32 is
   applied through the activation sums); its two 16-value halves have their own int8 scale. */
static inline wchunk q6_k_chunk(const uint8_t* b, int c, const uint8_t* sc) {
    (void)sc;
    int h = c / 4, s = c % 4;
    const int8_t* scales = (const int8_t*)(b + 192);
    __m256i lo = _mm256_and_si256(_mm256_srli_epi16(LOADU(b + 64 * h + 32 * (s % 2)), 4 * (s / 2)),
                                  _mm256_set1_epi8(0x0f));
    __m256i hb = _mm256_and_si256(_mm256_srli_epi16(LOADU(b + 128 + 32 * h), 2 * s),
                                  _mm256_set1_epi8(3));
    int e = 8 * h + 2 * s;
    return (wchunk){_mm256_or_si256(lo, _mm256_slli_epi16(hb, 4)),
                    _mm256_set_m128i(_mm_set1_epi16(scales[e + 1]), _mm_set1_epi16(scales[e]))};
}

/* The pair dots: a chunk of weights with 32 activation bytes, 8 int32 lanes. */
#define PDOT_SIGNED(w, a) dot_s8s8((w).q, a)
#define PDOT_UNSIGNED(w, a) dot_u8s8((w).q, a)
#define PDOT_SCALED(w, a) dot_scaled((w).q, a, (w).sc)

/* A block's scales: d (times the activation's d for the lanes' sum) and the min term's. For
   the K-quants `mins` gets the int16 per 16 activation values that, madd'ed with the
   activation's bsums, give the min (Q4_K / Q5_K: mn_s twice) or offset (Q6_K: 32 sc_s) sum. */
typedef struct { float d, dmin; __m256i mins; uint8_t sc[8]; } whead;

static inline whead head32(const uint8_t* b, int with_min) {
    whead h;
    h.d = f16(b);
    h.dmin = with_min ? f16(b + 2) : 0.0f;
    h.mins = _mm256_setzero_si256();
    return h;
}
static inline whead head45_k(const uint8_t* b) {
    whead h;
    uint8_t mn[8];
    scale_min_k4(b + 4, h.sc, mn);
    h.d = f16(b);
    h.dmin = -f16(b + 2);
    h.mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)mn),
                                                    _mm_loadl_epi64((const __m128i*)mn)));
    return h;
}
static inline whead head6_k(const uint8_t* b) {
    whead h;
    h.d = f16(b + 208);
    h.dmin = 0.0f;  /* the offset is exact: folded into isum */
    h.mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + 192))),
                               5);
    return h;
}
#define HEAD_Q4_0(b) head32(b, 0)
#define HEAD_Q5_0(b) head32(b, 0)
#define HEAD_Q8_0(b) head32(b, 0)
#define HEAD_Q4_1(b) head32(b, 1)
#define HEAD_Q5_1(b) head32(b, 1)
#define HEAD_Q4_K(b) head45_k(b)
#define HEAD_Q5_K(b) head45_k(b)
#define HEAD_Q6_K(b) head6_k(b)

#ifndef Q8_MR
#define Q8_MR 4  /* activation rows per tile */
#endif

/* A tile: mr activation rows (rows arb bytes apart) times nr weight rows (row_bytes apart),
   all nb blocks; y[i * ldy + j]. Per block: every weight row's chunks decoded once, their
   integer dots with each activation row summed over the block's chunks, then
   acc += (d_w * d_a) * isum (+ the min term: Q4_1 / Q5_1 m_w * s_a, K-quants
   dmin_w * d_a * (mins . bsums), Q6_K's -32 offset as an exact integer in isum). */
#define Q8_TILE(NAME, HEAD, BYTES, BLOCK, CHUNKS, PDOT, KIND)                                 \
static inline __attribute__((always_inline)) void NAME##_tile(                               \
        const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* act, int64_t arb,    \
        int64_t k, float* y, int64_t ldy, const int mr, const int nr) {                      \
    __m256 acc[Q8_MR][4];                                                                     \
    float extra[Q8_MR][4];                                                                    \
    for (int i = 0; i < mr; i++)                                                              \
        for (int j = 0; j < nr; j++) { acc[i][j] = _mm256_setzero_ps(); extra[i][j] = 0; }    \
    for (int64_t b = 0; b < nb; b++) {                                                        \
        whead hd[4];                                                                          \
        __m256i isum[Q8_MR][4];                                                               \
        for (int j = 0; j < nr; j++) hd[j] = HEAD(w + j * row_bytes + (BYTES) * b);           \
        for (int i = 0; i < mr; i++)                                                          \
            for (int j = 0; j < nr; j++) isum[i][j] = _mm256_setzero_si256();                 \
        for (int c = 0; c < (CHUNKS); c++) {                                                  \
            for (int j = 0; j < nr; j++) {                                                    \
                wchunk wc = NAME##_chunk(w + j * row_bytes + (BYTES) * b, c, hd[j].sc);        \
                for (int i = 0; i < mr; i++) {                                                \
                    __m256i av = LOADU(act + i * arb + (BLOCK) * b + 32 * c);                 \
                    isum[i][j] = _mm256_add_epi32(isum[i][j], PDOT(wc, av));                  \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < mr; i++) {                                                        \
            const float* ad = (const float*)(act + i * arb + k);                              \
            for (int j = 0; j < nr; j++) {                                                    \
                __m256i is = isum[i][j];                                                      \
                if ((KIND) == ACT_Q8_K) {                                                     \
                    const int16_t* bs = (const int16_t*)(ad + nb) + 16 * b;                   \
                    __m256i ms = _mm256_madd_epi16(hd[j].mins, LOADU(bs));                    \
                    if ((CHUNKS) == 8 && (BYTES) == 210) {                                    \
                        is = _mm256_sub_epi32(is, ms);                                        \
                    } else {                                                                  \
                        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(hd[j].dmin * ad[b]),       \
                                                    _mm256_cvtepi32_ps(ms), acc[i][j]);       \
                    }                                                                         \
                } else if ((KIND) == ACT_Q8_1) {                                              \
                    extra[i][j] += hd[j].dmin * ad[nb + b];                                   \
                }                                                                             \
                acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(hd[j].d * ad[b]),                  \
                                            _mm256_cvtepi32_ps(is), acc[i][j]);               \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int i = 0; i < mr; i++)                                                              \
        for (int j = 0; j < nr; j++) y[i * ldy + j] = hsum8(acc[i][j]) + extra[i][j];         \
}
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "q8dot512.h"
#else
Q8_TILE(q4_0, HEAD_Q4_0, 18, 32, 1, PDOT_SIGNED, ACT_Q8_0)
Q8_TILE(q5_0, HEAD_Q5_0, 22, 32, 1, PDOT_SIGNED, ACT_Q8_0)
Q8_TILE(q8_0, HEAD_Q8_0, 34, 32, 1, PDOT_SIGNED, ACT_Q8_0)
#endif
Q8_TILE(q4_1, HEAD_Q4_1, 20, 32, 1, PDOT_UNSIGNED, ACT_Q8_1)
Q8_TILE(q5_1, HEAD_Q5_1, 24, 32, 1, PDOT_UNSIGNED, ACT_Q8_1)
Q8_TILE(q4_k, HEAD_Q4_K, 144, 256, 8, PDOT_SCALED, ACT_Q8_K)
Q8_TILE(q5_k, HEAD_Q5_K, 176, 256, 8, PDOT_SCALED, ACT_Q8_K)
Q8_TILE(q6_k, HEAD_Q6_K, 210, 256, 8, PDOT_SCALED, ACT_Q8_K)

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
