/* GGUF's block formats decoded to float32, each value exactly as gguf's reference dequantizer
 * gives it (same operations in the same order; the including file is compiled with
 * -ffp-contract=off). With AVX-512 every block is handed 32 values at a time to a callback
 * macro (FOR_<TYPE>(block, EMIT)), which the dequantizers store and qmatmul.c's fused path
 * multiplies right away; QMM_AVX512 is defined then. Elsewhere plain loops dequantize. Either
 * way deq_<type>(blocks, nb, y) writes nb blocks of one row to y. Included by qmatmul.c only. */
#ifndef SLOTSERVE_QBLOCKS_H
#define SLOTSERVE_QBLOCKS_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

static inline float f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact in float32 */
        f = (float)man * (1.0f / 16777216.0f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint32_t u32le(const uint8_t* p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The 6-bit scales and mins of the 8 sub-blocks of Q4_K / Q5_K, packed into 12 bytes. */
static inline void scale_min_k4(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

/* ---- dequantizers: `nb` blocks of one row -> float32, each value exactly as gguf's ---------- */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* AVX-512: a block's bytes are unpacked to 32 small integers in one 256-bit register,
   widened to two registers of 16 floats and scaled: the same operations as the portable loops
   below (which other CPUs compile), hence the same values. Each type's decoder (FOR_<type>)
   hands every 32 values of a block to EMIT(v, offset): the dequantizers store them, the fused
   small-m path multiplies them with x right away. */
#define QMM_AVX512 1

typedef struct { __m512 a, b; } f32x32;

static inline __m256i nibbles_lo_hi(__m128i q) {  /* 16 bytes -> 16 low then 16 high nibbles */
    const __m128i m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

static inline f32x32 i8_scaled(__m256i q, float d0, float d1) {  /* d * int8 q */
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    return (f32x32){_mm512_mul_ps(_mm512_set1_ps(d0), a), _mm512_mul_ps(_mm512_set1_ps(d1), b)};
}

static inline f32x32 u8_mul_add(__m256i q, float d, float m) {  /* d * q + m */
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
    __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    return (f32x32){_mm512_add_ps(_mm512_mul_ps(dv, a), mv),
                    _mm512_add_ps(_mm512_mul_ps(dv, b), mv)};
}

static inline f32x32 u8_mul_sub(__m256i q, float d, float m) {  /* d * q - m */
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
    __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    return (f32x32){_mm512_sub_ps(_mm512_mul_ps(dv, a), mv),
                    _mm512_sub_ps(_mm512_mul_ps(dv, b), mv)};
}

#define FOR_Q4_0(b, EMIT) do {                                                                \
    float d_ = f16(b);                                                                        \
    __m256i q_ = nibbles_lo_hi(_mm_loadu_si128((const __m128i*)((b) + 2)));                   \
    EMIT(i8_scaled(_mm256_sub_epi8(q_, _mm256_set1_epi8(8)), d_, d_), 0);                     \
} while (0)

#define FOR_Q4_1(b, EMIT) do {                                                                \
    EMIT(u8_mul_add(nibbles_lo_hi(_mm_loadu_si128((const __m128i*)((b) + 4))), f16(b),        \
                    f16((b) + 2)), 0);                                                        \
} while (0)

/* q | bit << 4, minus 16: values whose fifth bit is clear lose 16, the others keep q */
#define FOR_Q5_0(b, EMIT) do {                                                                \
    float d_ = f16(b);                                                                        \
    __m256i q_ = nibbles_lo_hi(_mm_loadu_si128((const __m128i*)((b) + 6)));                   \
    q_ = _mm256_mask_sub_epi8(q_, (__mmask32)~u32le((b) + 2), q_, _mm256_set1_epi8(16));      \
    EMIT(i8_scaled(q_, d_, d_), 0);                                                           \
} while (0)

#define FOR_Q5_1(b, EMIT) do {                                                                \
    __m256i q_ = nibbles_lo_hi(_mm_loadu_si128((const __m128i*)((b) + 8)));                   \
    q_ = _mm256_mask_add_epi8(q_, (__mmask32)u32le((b) + 4), q_, _mm256_set1_epi8(16));       \
    EMIT(u8_mul_add(q_, f16(b), f16((b) + 2)), 0);                                            \
} while (0)

#define FOR_Q8_0(b, EMIT) do {                                                                \
    float d_ = f16(b);                                                                        \
    EMIT(i8_scaled(_mm256_loadu_si256((const __m256i*)((b) + 2)), d_, d_), 0);                \
} while (0)

#define FOR_Q4_K(b, EMIT) do {                                                                \
    const __m256i m4_ = _mm256_set1_epi8(0x0f);                                               \
    uint8_t sc_[8], mn_[8];                                                                   \
    float d_ = f16(b), dmin_ = f16((b) + 2);                                                  \
    scale_min_k4((b) + 4, sc_, mn_);                                                          \
    for (int c_ = 0; c_ < 4; c_++) {                                                          \
        __m256i q_ = _mm256_loadu_si256((const __m256i*)((b) + 16 + 32 * c_));                \
        EMIT(u8_mul_sub(_mm256_and_si256(q_, m4_), d_ * (float)sc_[2 * c_],                   \
                        dmin_ * (float)mn_[2 * c_]), 64 * c_);                                \
        EMIT(u8_mul_sub(_mm256_and_si256(_mm256_srli_epi16(q_, 4), m4_),                      \
                        d_ * (float)sc_[2 * c_ + 1], dmin_ * (float)mn_[2 * c_ + 1]),         \
             64 * c_ + 32);                                                                   \
    }                                                                                         \
} while (0)

#define FOR_Q5_K(b, EMIT) do {                                                                \
    const __m256i m4_ = _mm256_set1_epi8(0x0f), sixteen_ = _mm256_set1_epi8(16);              \
    uint8_t sc_[8], mn_[8];                                                                   \
    float d_ = f16(b), dmin_ = f16((b) + 2);                                                  \
    scale_min_k4((b) + 4, sc_, mn_);                                                          \
    __m256i qh_ = _mm256_loadu_si256((const __m256i*)((b) + 16));                             \
    for (int c_ = 0; c_ < 4; c_++) {                                                          \
        __m256i q_ = _mm256_loadu_si256((const __m256i*)((b) + 48 + 32 * c_));                \
        __m256i lo_ = _mm256_and_si256(q_, m4_);                                              \
        __m256i hi_ = _mm256_and_si256(_mm256_srli_epi16(q_, 4), m4_);                        \
        lo_ = _mm256_mask_add_epi8(lo_, _mm256_test_epi8_mask(                                \
            qh_, _mm256_set1_epi8((char)(1 << (2 * c_)))), lo_, sixteen_);                    \
        hi_ = _mm256_mask_add_epi8(hi_, _mm256_test_epi8_mask(                                \
            qh_, _mm256_set1_epi8((char)(2 << (2 * c_)))), hi_, sixteen_);                    \
        EMIT(u8_mul_sub(lo_, d_ * (float)sc_[2 * c_], dmin_ * (float)mn_[2 * c_]), 64 * c_);  \
        EMIT(u8_mul_sub(hi_, d_ * (float)sc_[2 * c_ + 1], dmin_ * (float)mn_[2 * c_ + 1]),    \
             64 * c_ + 32);                                                                   \
    }                                                                                         \
} while (0)

#define FOR_Q6_K(b, EMIT) do {                                                                \
    const __m256i m4_ = _mm256_set1_epi8(0x0f), m2_ = _mm256_set1_epi8(3);                    \
    const __m256i off_ = _mm256_set1_epi8(32);                                                \
    const int8_t* scales_ = (const int8_t*)((b) + 192);                                       \
    float d_ = f16((b) + 208);                                                                \
    for (int h_ = 0; h_ < 2; h_++) {                                                          \
        __m256i l0_ = _mm256_loadu_si256((const __m256i*)((b) + 64 * h_));                    \
        __m256i l1_ = _mm256_loadu_si256((const __m256i*)((b) + 64 * h_ + 32));               \
        __m256i qh_ = _mm256_loadu_si256((const __m256i*)((b) + 128 + 32 * h_));              \
        __m256i lo_[4] = {_mm256_and_si256(l0_, m4_), _mm256_and_si256(l1_, m4_),             \
                          _mm256_and_si256(_mm256_srli_epi16(l0_, 4), m4_),                   \
                          _mm256_and_si256(_mm256_srli_epi16(l1_, 4), m4_)};                  \
        __m256i hi_[4] = {_mm256_and_si256(qh_, m2_),                                         \
                          _mm256_and_si256(_mm256_srli_epi16(qh_, 2), m2_),                   \
                          _mm256_and_si256(_mm256_srli_epi16(qh_, 4), m2_),                   \
                          _mm256_and_si256(_mm256_srli_epi16(qh_, 6), m2_)};                  \
        for (int s_ = 0; s_ < 4; s_++) {                                                      \
            __m256i q_ = _mm256_or_si256(lo_[s_], _mm256_slli_epi16(hi_[s_], 4));             \
            EMIT(i8_scaled(_mm256_sub_epi8(q_, off_), d_ * (float)scales_[8 * h_ + 2 * s_],   \
                           d_ * (float)scales_[8 * h_ + 2 * s_ + 1]), 128 * h_ + 32 * s_);    \
        }                                                                                     \
    }                                                                                         \
} while (0)

/* The dequantizers: every block's values stored in order. */
#define STORE_TO_Y(v, off) do {                                                               \
    _mm512_storeu_ps(y + (off), (v).a);                                                       \
    _mm512_storeu_ps(y + (off) + 16, (v).b);                                                  \
} while (0)
#define DEQ(NAME, FOR, VALUES, BYTES)                                                         \
static void NAME(const uint8_t* b, int64_t nb, float* y) {                                    \
    for (int64_t i = 0; i < nb; i++, b += (BYTES), y += (VALUES)) FOR(b, STORE_TO_Y);         \
}
DEQ(deq_q4_0, FOR_Q4_0, 32, 18)
DEQ(deq_q4_1, FOR_Q4_1, 32, 20)
DEQ(deq_q5_0, FOR_Q5_0, 32, 22)
DEQ(deq_q5_1, FOR_Q5_1, 32, 24)
DEQ(deq_q8_0, FOR_Q8_0, 32, 34)
DEQ(deq_q4_k, FOR_Q4_K, 256, 144)
DEQ(deq_q5_k, FOR_Q5_K, 256, 176)
DEQ(deq_q6_k, FOR_Q6_K, 256, 210)

#else  /* portable loops */


static void deq_q4_0(const uint8_t* b, int64_t nb, float* y) {  /* d, 16 bytes of nibbles */
    for (int64_t i = 0; i < nb; i++, b += 18, y += 32) {
        float d = f16(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[2 + j] & 0x0f) - 8);
            y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
    }
}

static void deq_q4_1(const uint8_t* b, int64_t nb, float* y) {  /* d, m, nibbles */
    for (int64_t i = 0; i < nb; i++, b += 20, y += 32) {
        float d = f16(b), m = f16(b + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b[4 + j] & 0x0f) + m;
            y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
    }
}

static void deq_q5_0(const uint8_t* b, int64_t nb, float* y) {  /* d, 32 high bits, nibbles */
    for (int64_t i = 0; i < nb; i++, b += 22, y += 32) {
        float d = f16(b);
        uint32_t qh = u32le(b + 2);
        for (int j = 0; j < 16; j++) {
            int lo = (b[6 + j] & 0x0f) | (int)((qh >> j) & 1u) << 4;
            int hi = (b[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
    }
}

static void deq_q5_1(const uint8_t* b, int64_t nb, float* y) {  /* d, m, high bits, nibbles */
    for (int64_t i = 0; i < nb; i++, b += 24, y += 32) {
        float d = f16(b), m = f16(b + 2);
        uint32_t qh = u32le(b + 4);
        for (int j = 0; j < 16; j++) {
            int lo = (b[8 + j] & 0x0f) | (int)((qh >> j) & 1u) << 4;
            int hi = (b[8 + j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
    }
}

static void deq_q8_0(const uint8_t* b, int64_t nb, float* y) {  /* d, 32 int8 */
    for (int64_t i = 0; i < nb; i++, b += 34, y += 32) {
        float d = f16(b);
        const int8_t* q = (const int8_t*)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
    }
}

/* Q4_K: d, dmin, scales[12], qs[128]; sub-block i (32 values) is nibble i % 2 of the 32 bytes
   qs[32 * (i / 2) ...]; value = (d * sc_i) * q - dmin * m_i. */
static void deq_q4_k(const uint8_t* b, int64_t nb, float* y) {
    uint8_t sc[8], mn[8];
    for (int64_t i = 0; i < nb; i++, b += 144, y += 256) {
        float d = f16(b), dmin = f16(b + 2);
        scale_min_k4(b + 4, sc, mn);
        const uint8_t* qs = b + 16;
        for (int s = 0; s < 8; s++) {
            float ds = d * (float)sc[s], ms = dmin * (float)mn[s];
            const uint8_t* q = qs + 32 * (s / 2);
            int shift = 4 * (s % 2);
            for (int l = 0; l < 32; l++) y[32 * s + l] = ds * (float)((q[l] >> shift) & 0x0f) - ms;
        }
    }
}

/* Q5_K: Q4_K plus qh[32]: bit s of qh[l] is the fifth bit of value l of sub-block s. */
static void deq_q5_k(const uint8_t* b, int64_t nb, float* y) {
    uint8_t sc[8], mn[8];
    for (int64_t i = 0; i < nb; i++, b += 176, y += 256) {
        float d = f16(b), dmin = f16(b + 2);
        scale_min_k4(b + 4, sc, mn);
        const uint8_t* qh = b + 16;
        const uint8_t* qs = b + 48;
        for (int s = 0; s < 8; s++) {
            float ds = d * (float)sc[s], ms = dmin * (float)mn[s];
            const uint8_t* q = qs + 32 * (s / 2);
            int shift = 4 * (s % 2);
            for (int l = 0; l < 32; l++) {
                int v = ((q[l] >> shift) & 0x0f) | ((qh[l] >> s) & 1) << 4;
                y[32 * s + l] = ds * (float)v - ms;
            }
        }
    }
}

/* Q6_K: ql[128], qh[64], int8 scales[16], d. Each half h of 128 values: value 64 * t + c
   (c < 64) has low nibble t of ql[64 h + c]; value 32 s + l has bits 2s..2s+1 of qh[32 h + l]
   as its top two bits; value = (d * scale[e / 16]) * (q - 32). */
static void deq_q6_k(const uint8_t* b, int64_t nb, float* y) {
    for (int64_t i = 0; i < nb; i++, b += 210, y += 256) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t* scales = (const int8_t*)(b + 192);
        float d = f16(b + 208);
        for (int h = 0; h < 2; h++) {
            for (int s = 0; s < 4; s++) {
                float d0 = d * (float)scales[8 * h + 2 * s], d1 = d * (float)scales[8 * h + 2 * s + 1];
                const uint8_t* lo = ql + 64 * h + 32 * (s % 2);
                int shift = 4 * (s / 2);
                for (int l = 0; l < 32; l++) {
                    int q = ((lo[l] >> shift) & 0x0f) | ((qh[32 * h + l] >> (2 * s)) & 3) << 4;
                    y[128 * h + 32 * s + l] = (l < 16 ? d0 : d1) * (float)(q - 32);
                }
            }
        }
    }
}

#endif

#endif
