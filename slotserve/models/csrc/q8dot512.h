/* Q4_0, Q5_0 and Q8_0 weights times Q8_0 activations with AVX-512 VNNI, two 32-value blocks
 * per 512-bit register (the 262k-row Q8_0 output projection and Gemma's Q5_0 layers).
 *
 * vpdpbusd multiplies unsigned by signed bytes, so the weights are made unsigned by an offset
 * (Q8_0: w + 128, i.e. w xor 0x80; Q4_0 / Q5_0: their stored nibbles, w + 8 / w + 16) and the
 * offset is taken back exactly in the integer sum: sum(u * a) = sum(w * a) + off * sum(a), and
 * the quantizer stores -sum(a) per block (q8act.h), so the dot of a block starts from
 * off * -sum(a) instead of zero. Per weight row and activation row of a tile that leaves one
 * vpdpbusd, one conversion, one scale product and one multiply-add per 64 values (the sign
 * trick ggml's AVX2 code needs costs a masked negate per pair on top). Integer sums are exact,
 * so the result is that of q8dot.h's formula: sum_b dw_b * da_b * sum(w * a).
 *
 * A tile is mr activation rows times nr weight rows (both at most 4): each weight block pair is
 * decoded once per tile, each activation pair loaded once per tile. An odd last block runs
 * with a zero upper half (zero activations and scales: its products vanish). Included by
 * q8dot.h only, where AVX-512 VNNI and BW are on. */
#ifndef SLOTSERVE_Q8DOT512_H
#define SLOTSERVE_Q8DOT512_H

#define Q8_0_NEGSUM(act, k, nb) ((const int32_t*)((act) + (k)) + (nb))

/* The f16 scales of blocks b (lanes 0-7) and b + 1 (lanes 8-15, 0 when absent). */
static inline __m512 scales2(const uint8_t* blk, int64_t bytes, int two) {
    uint16_t d0, d1 = 0;
    memcpy(&d0, blk, 2);
    if (two) memcpy(&d1, blk + bytes, 2);
    __m256i h = _mm256_mask_set1_epi16(_mm256_set1_epi16((short)d0), 0xff00, (short)d1);
    return _mm512_cvtph_ps(h);
}

/* Two blocks of 16 quant bytes as 64 values: per block the low nibbles (values 0-15), then
   the high nibbles (values 16-31), as ggml lays them out. */
static inline __m512i nibbles64(const uint8_t* q0, const uint8_t* q1, int two) {
    __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)q0));
    __m256i hi = two ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)q1))
                     : _mm256_setzero_si256();
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    /* 128-bit lanes 1 and 3 take the high nibbles */
    const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi64(v, shift), _mm512_set1_epi8(0x0f));
}

static inline __m512i u_q8_0(const uint8_t* blk, int two) {
    __m512i v = two ? _mm512_inserti64x4(_mm512_castsi256_si512(LOADU(blk + 2)), LOADU(blk + 36), 1)
                    : _mm512_zextsi256_si512(LOADU(blk + 2));
    return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
}
static inline __m512i u_q4_0(const uint8_t* blk, int two) {
    return nibbles64(blk + 2, blk + 20, two);
}
static inline __m512i u_q5_0(const uint8_t* blk, int two) {
    __m512i v = nibbles64(blk + 6, blk + 28, two);
    uint64_t hb = (uint64_t)u32le(blk + 2) | (two ? (uint64_t)u32le(blk + 24) << 32 : 0);
    return _mm512_mask_add_epi8(v, _cvtu64_mask64(hb), v, _mm512_set1_epi8(16));
}

#define Q8_512_TILE(NAME, BYTES, SHIFT)                                                       \
static inline __attribute__((always_inline)) void NAME##_tile(                               \
        const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* act, int64_t arb,    \
        int64_t k, float* y, int64_t ldy, const int mr, const int nr) {                      \
    __m512 acc[Q8_MR][4];                                                                     \
    for (int i = 0; i < mr; i++)                                                              \
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();                         \
    for (int64_t b = 0; b < nb; b += 2) {                                                     \
        const int two = b + 1 < nb;                                                           \
        __m512i u[4];                                                                         \
        __m512 dw[4];                                                                         \
        for (int j = 0; j < nr; j++) {                                                        \
            const uint8_t* blk = w + j * row_bytes + (BYTES) * b;                             \
            u[j] = u_##NAME(blk, two);                                                        \
            dw[j] = scales2(blk, (BYTES), two);                                               \
        }                                                                                     \
        const __mmask16 pair = two ? 0x0101 : 0x0001;                                         \
        for (int i = 0; i < mr; i++) {                                                        \
            const uint8_t* ai = act + i * arb;                                                \
            const float* ad = (const float*)(ai + k);                                         \
            __m512i a = two ? _mm512_loadu_si512((const void*)(ai + 32 * b))                  \
                            : _mm512_zextsi256_si512(LOADU(ai + 32 * b));                     \
            __m512 da = _mm512_mask_broadcastss_ps(_mm512_set1_ps(ad[b]), 0xff00,             \
                                                   _mm_set_ss(two ? ad[b + 1] : 0.0f));       \
            __m512i init = _mm512_slli_epi32(                                                 \
                _mm512_maskz_expandloadu_epi32(pair, Q8_0_NEGSUM(ai, k, nb) + b), (SHIFT));   \
            for (int j = 0; j < nr; j++) {                                                    \
                __m512i dot = _mm512_dpbusd_epi32(init, u[j], a);                             \
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[j], da),\
                                            acc[i][j]);                                       \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int i = 0; i < mr; i++) {                                                            \
        if (nr == 4) {                                                                        \
            hsum4((v16)acc[i][0], (v16)acc[i][1], (v16)acc[i][2], (v16)acc[i][3],             \
                  y + i * ldy);                                                               \
        } else {                                                                              \
            for (int j = 0; j < nr; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);    \
        }                                                                                     \
    }                                                                                         \
}

/* From Q8_MR + 1 activation rows on, a tile of weight rows is decoded once into the caller's
   stack buffers (`u`, `dw`: nr rows of `pairs` block pairs) and every group of activation rows
   reads it from L1, instead of decoding it again per group (the 262k-row output projection at
   8 and 32 sequences). */
#define Q8_512_DECODE(NAME, BYTES)                                                            \
static inline void NAME##_decode(const uint8_t* w, int64_t row_bytes, int64_t nb, int nr,     \
                                 __m512i* u, __m512* dw) {                                    \
    int64_t pairs = (nb + 1) / 2;                                                             \
    for (int j = 0; j < nr; j++)                                                              \
        for (int64_t p = 0; p < pairs; p++) {                                                 \
            const uint8_t* blk = w + j * row_bytes + (BYTES) * 2 * p;                         \
            int two = 2 * p + 1 < nb;                                                         \
            u[j * pairs + p] = u_##NAME(blk, two);                                            \
            dw[j * pairs + p] = scales2(blk, (BYTES), two);                                   \
        }                                                                                     \
}

/* The tile of Q8_512_TILE on weight rows decoded already. */
static inline __attribute__((always_inline)) void q8_512_tile_pre(
        const __m512i* u, const __m512* dw, int64_t nb, const uint8_t* act, int64_t arb,
        int64_t k, float* y, int64_t ldy, const int mr, const int nr, const int shift) {
    int64_t pairs = (nb + 1) / 2;
    __m512 acc[Q8_MR][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t b = 2 * p;
        const int two = b + 1 < nb;
        const __mmask16 pair = two ? 0x0101 : 0x0001;
        for (int i = 0; i < mr; i++) {
            const uint8_t* ai = act + i * arb;
            const float* ad = (const float*)(ai + k);
            __m512i a = two ? _mm512_loadu_si512((const void*)(ai + 32 * b))
                            : _mm512_zextsi256_si512(LOADU(ai + 32 * b));
            __m512 da = _mm512_mask_broadcastss_ps(_mm512_set1_ps(ad[b]), 0xff00,
                                                   _mm_set_ss(two ? ad[b + 1] : 0.0f));
            __m512i init = _mm512_slli_epi32(
                _mm512_maskz_expandloadu_epi32(pair, Q8_0_NEGSUM(ai, k, nb) + b), shift);
            for (int j = 0; j < nr; j++) {
                __m512i dot = _mm512_dpbusd_epi32(init, u[j * pairs + p], a);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                            _mm512_mul_ps(dw[j * pairs + p], da), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++) {
        if (nr == 4) {
            hsum4((v16)acc[i][0], (v16)acc[i][1], (v16)acc[i][2], (v16)acc[i][3], y + i * ldy);
        } else {
            for (int j = 0; j < nr; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
        }
    }
}

Q8_512_TILE(q8_0, 34, 7)
Q8_512_TILE(q4_0, 18, 3)
Q8_512_TILE(q5_0, 22, 4)
Q8_512_DECODE(q8_0, 34)
Q8_512_DECODE(q4_0, 18)
Q8_512_DECODE(q5_0, 22)
#define Q8_PREDECODE 1
#define Q8_PRE_PAIRS 32  /* k <= 2048: 4 decoded rows take 16 KiB of stack */

#endif
