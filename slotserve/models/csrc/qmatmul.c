/* Block-quantized matmul for the CPU: y = x @ W^T with float32 activations and W kept in one
 * of GGUF's block formats (see slotserve/models/native_qmatmul.py for why, and for how this
 * file is built and called).
 *
 * The model's numbers stay those of dequantize-then-matmul: every weight is dequantized to
 * exactly the float32 value `gguf`'s reference dequantizer gives (same operations in the same
 * order; the file is compiled with -ffp-contract=off so no multiply-add is fused there), and
 * only the order of the float32 sums in the dot products differs. Activations are never
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

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

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

#ifdef __clang__
#define SHUF(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define SHUF(x, ...) __builtin_shuffle(x, (v16i){__VA_ARGS__})
#endif

static inline float hsum(v16 x) {
    x += SHUF(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += SHUF(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += SHUF(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += SHUF(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

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
   Python side checks them against gguf's table once, when the library is loaded. */
void slotserve_qtype_layout(int32_t type, int32_t* block, int32_t* bytes) {
    const qtype_info* t = find_type(type);
    *block = t ? t->block : 0;
    *bytes = t ? t->bytes : 0;
}
