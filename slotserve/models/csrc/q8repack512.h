/* The 16-row packed layout (q8repack.h) times 8-bit activations with AVX-512 VNNI: one 512-bit
 * weight load feeds all 16 rows of a group, and a group stays in L1 while every activation
 * row of the call runs against it.
 *
 * vpdpbusd(acc, lanes_g, broadcast(activation bytes 4g..4g+3)) adds to int32 lane r the dot
 * of row r's 4 values with the activation's: after a block's 8 of them every lane holds its
 * row's integer block dot, with no horizontal sum, and one conversion, one scale product and
 * one multiply-add finish the block for 16 rows at once. The unsigned offset of the weights
 * (+128, +8, +16) is taken back exactly as in q8dot512.h: the dot starts from
 * off * -sum(a). Per output the float sum runs over the blocks in order, as llama.cpp's
 * reference does: y = sum_b (d_w,b * d_a,b) * isum_b (the scale product rounded, then fused).
 * Included by q8repack.h only, where AVX-512 VNNI and BW are on. */
#ifndef SLOTSERVE_Q8REPACK512_H
#define SLOTSERVE_Q8REPACK512_H
#define RP_SIMD 1
#define RP_MR 8            /* activation rows per tile: 8 accumulators + 8 weight registers */
#define RP_DEC_MAX 64      /* blocks per row decoded ahead (k <= 2048: 36 KiB of stack) */
typedef int32_t rp_i32 __attribute__((may_alias, aligned(1)));

/* A block record's 16 scales and its 8 lane registers of unsigned values (0..255, 0..15,
   0..31), the register g for activation bytes 4g..4g+3. */
static inline __attribute__((always_inline)) void rp_decode(const int type, const uint8_t* rec,
                                                            __m512i w[8], __m512* dw) {
    *dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
    if (type == 8) {
        for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void*)(rec + 32 + 64 * g));
        return;
    }
    const uint8_t* q = rec + 32 + (type == 6 ? 64 : 0);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < 4; g++) {
        __m512i v = _mm512_loadu_si512((const void*)(q + 64 * g));
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (type == 6) {
            uint64_t ml, mh;
            memcpy(&ml, rec + 32 + 8 * g, 8);
            memcpy(&mh, rec + 32 + 8 * (g + 4), 8);
            lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(ml), lo, _mm512_set1_epi8(16));
            hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(mh), hi, _mm512_set1_epi8(16));
        }
        w[g] = lo;
        w[g + 4] = hi;
    }
}

/* mr activation rows against one group of 16 weight rows: y[i * ldy + 0..15]. `dec`/`decd`:
   the group decoded ahead (nb blocks), or NULL to decode each record as it comes (`pf`: and
   prefetch the bytes q8_prefetch on). */
static inline __attribute__((always_inline)) void rp_tile(
        const int type, const int shift, const uint8_t* grp, const __m512i* dec,
        const __m512* decd, int64_t nb, const uint8_t* act, int64_t arb, int64_t k, float* y,
        int64_t ldy, const int mr, const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * (type == 8 ? 34 : type == 2 ? 18 : 22);
    __m512 acc[RP_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w[8];
        __m512 dw;
        if (dec) {
            for (int g = 0; g < 8; g++) w[g] = dec[8 * b + g];
            dw = decd[b];
        } else {
            const uint8_t* rec = grp + b * rb;
            if (pf)
                for (int64_t p = 0; p < rb; p += 64)
                    __builtin_prefetch(rec + p + q8_prefetch, 0, 3);
            rp_decode(type, rec, w, &dw);
        }
        for (int i = 0; i < mr; i++) {
            const uint8_t* ai = act + i * arb;
            const rp_i32* a = (const rp_i32*)(ai + 32 * b);
            const float da = ((const float*)(ai + k))[b];
            const int32_t ns = Q8_0_NEGSUM(ai, k, nb)[b];
            __m512i s0 = _mm512_set1_epi32(ns * (1 << shift)), s1 = _mm512_setzero_si512();
            for (int g = 0; g < 8; g += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(a[g]));
                s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(a[g + 1]));
            }
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                     _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

#define RP_TILE_CASE(N, T, S) \
    case N: rp_tile(T, S, gp, dp, dd, nb, a_, arb, k, y_, ldy, N, pf); break;
/* Groups [g0, g1) against activation rows [m0, m1). */
#define RP_MM(NAME, TYPE, SHIFT)                                                             \
static void NAME##_rp_mm(const uint8_t* wp, int64_t nb, const uint8_t* act, int64_t arb,      \
                         int64_t k, int64_t m0, int64_t m1, float* y, int64_t ldy,            \
                         int64_t g0, int64_t g1) {                                            \
    const int64_t rb = (int64_t)RP_ROWS * (TYPE == 8 ? 34 : TYPE == 2 ? 18 : 22);            \
    /* Nibble types decode a group once when more than one tile of rows reads it. */          \
    const int ahead = TYPE != 8 && m1 - m0 > RP_MR && nb <= RP_DEC_MAX;                       \
    __m512i dec[ahead ? 8 * nb : 1];                                                          \
    __m512 decd[ahead ? nb : 1];                                                              \
    for (int64_t grp = g0; grp < g1; grp++) {                                                 \
        const uint8_t* gp = wp + grp * nb * rb;                                               \
        const __m512i* dp = 0;                                                                \
        const __m512* dd = 0;                                                                 \
        if (ahead) {                                                                          \
            for (int64_t b = 0; b < nb; b++) {                                                \
                for (int64_t p = 0; q8_prefetching(m0, m1, 1) && p < rb; p += 64)             \
                    __builtin_prefetch(gp + b * rb + p + q8_prefetch, 0, 3);                  \
                rp_decode(TYPE, gp + b * rb, dec + 8 * b, decd + b);                          \
            }                                                                                 \
            dp = dec;                                                                         \
            dd = decd;                                                                        \
        }                                                                                     \
        for (int64_t i = m0; i < m1; i += RP_MR) {                                            \
            const uint8_t* a_ = act + i * arb;                                                \
            float* y_ = y + i * ldy + grp * RP_ROWS;                                          \
            const int pf = !ahead && i == m0 && q8_prefetching(m0, m1, 1);                   \
            switch (m1 - i < RP_MR ? (int)(m1 - i) : RP_MR) {                                 \
                RP_TILE_CASE(1, TYPE, SHIFT) RP_TILE_CASE(2, TYPE, SHIFT)                     \
                RP_TILE_CASE(3, TYPE, SHIFT) RP_TILE_CASE(4, TYPE, SHIFT)                     \
                RP_TILE_CASE(5, TYPE, SHIFT) RP_TILE_CASE(6, TYPE, SHIFT)                     \
                RP_TILE_CASE(7, TYPE, SHIFT) default:                                         \
                rp_tile(TYPE, SHIFT, gp, dp, dd, nb, a_, arb, k, y_, ldy, RP_MR, pf);         \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}
RP_MM(q4_0, 2, 3) RP_MM(q5_0, 6, 4) RP_MM(q8_0, 8, 7)

/* Q4_K: per block, for each activation row of the tile, the 8 sub-blocks' integer dots for
   16 rows (8 vpdpbusd each) times their scales, and the mins times the activation's sums of
   32 (from its bsums of 16), all exact int32; then
   acc += (d_w * d_a) * isum - (dmin_w * d_a) * msum, as q8dot.h's formula. */
#define RP_K_MR 4
static inline __m128i rp_k_six(const uint8_t* rec, int j, int mins) {
    const __m128i* pl = (const __m128i*)(rec + RP_K_SCALES);
    const __m128i m63 = _mm_set1_epi8(63), m0f = _mm_set1_epi8(0x0f), m30 = _mm_set1_epi8(0x30);
    if (j < 4) return _mm_and_si128(_mm_loadu_si128(pl + j + 4 * mins), m63);
    __m128i lo = _mm_loadu_si128(pl + j + 4);  /* scales[j + 8] */
    lo = mins ? _mm_and_si128(_mm_srli_epi16(lo, 4), m0f) : _mm_and_si128(lo, m0f);
    __m128i top = _mm_loadu_si128(pl + j - 4 + 4 * mins);
    return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(top, 2), m30));
}

static inline __attribute__((always_inline)) void rp_k_tile(
        const uint8_t* grp, int64_t nb, const uint8_t* act, int64_t arb, int64_t k, float* y,
        int64_t ldy, const int mr, const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * 144;
    __m512 acc[RP_K_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        if (pf) Q8_K4_PREFETCH(rec, rb);
        __m512i isum[RP_K_MR], msum[RP_K_MR];
        for (int i = 0; i < mr; i++) isum[i] = msum[i] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            __m512i w[8];
            for (int g = 0; g < 8; g++) {
                __m512i v = _mm512_loadu_si512((const void*)(rec + RP_K_QS + 512 * (s / 2) + 64 * g));
                w[g] = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(v, 4) : v, m4);
            }
            const __m512i sc = _mm512_cvtepu8_epi32(rp_k_six(rec, s, 0));
            const __m512i mn = _mm512_cvtepu8_epi32(rp_k_six(rec, s, 1));
            for (int i = 0; i < mr; i++) {
                const uint8_t* ai = act + i * arb;
                const rp_i32* a = (const rp_i32*)(ai + 256 * b + 32 * s);
                const int16_t* bs = (const int16_t*)((const float*)(ai + k) + nb) + 16 * b;
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int g = 0; g < 8; g += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(a[g]));
                    s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(a[g + 1]));
                }
                isum[i] = _mm512_add_epi32(isum[i], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
                msum[i] = _mm512_add_epi32(msum[i], _mm512_mullo_epi32(
                    mn, _mm512_set1_epi32((int32_t)bs[2 * s] + bs[2 * s + 1])));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 32)));
        for (int i = 0; i < mr; i++) {
            const __m512 da = _mm512_set1_ps(((const float*)(act + i * arb + k))[b]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, da), acc[i]);
            acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[i]), _mm512_mul_ps(dmin, da),
                                      acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* Q6_K: per block and activation row, each 16-value group's integer dot for 16 rows (4
   vpdpbusd from -32 * the activation's sum over the group: the offset of v exact), times the
   group's scales, summed as int32; then acc += (d_w * d_a) * isum, as q8dot.h's formula. */
static inline __m512i rp_6_hi(__m512i h, int c) {  /* bits 2c..2c+1 of each byte to 4..5 */
    switch (c % 4) {
        case 0: h = _mm512_slli_epi16(h, 4); break;
        case 1: h = _mm512_slli_epi16(h, 2); break;
        case 3: h = _mm512_srli_epi16(h, 2); break;
        default: break;
    }
    return _mm512_and_si512(h, _mm512_set1_epi8(0x30));
}

static inline __attribute__((always_inline)) void rp_6_tile(
        const uint8_t* grp, int64_t nb, const uint8_t* act, int64_t arb, int64_t k, float* y,
        int64_t ldy, const int mr, const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * 210;
    __m512 acc[RP_K_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        if (pf)
            for (int64_t p = 0; p < rb; p += 64)
                __builtin_prefetch(rec + p + q8_prefetch, 0, 3);
        __m512i isum[RP_K_MR];
        for (int i = 0; i < mr; i++) isum[i] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            __m512i w[8];
            for (int g = 0; g < 8; g++) {
                __m512i lo = _mm512_loadu_si512((const void*)(rec + RP_6_LO + 512 * (c / 2) + 64 * g));
                __m512i hi = _mm512_loadu_si512((const void*)(rec + RP_6_HI + 512 * (c / 4) + 64 * g));
                lo = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(lo, 4) : lo, m4);
                w[g] = _mm512_or_si512(lo, rp_6_hi(hi, c));
            }
            const __m512i sc0 = _mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i*)(rec + RP_6_SCALES + 16 * (2 * c))));
            const __m512i sc1 = _mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i*)(rec + RP_6_SCALES + 16 * (2 * c + 1))));
            for (int i = 0; i < mr; i++) {
                const uint8_t* ai = act + i * arb;
                const rp_i32* a = (const rp_i32*)(ai + 256 * b + 32 * c);
                const int16_t* bs = (const int16_t*)((const float*)(ai + k) + nb) + 16 * b;
                __m512i s0 = _mm512_set1_epi32(-32 * (int32_t)bs[2 * c]);
                __m512i s1 = _mm512_set1_epi32(-32 * (int32_t)bs[2 * c + 1]);
                for (int g = 0; g < 4; g++) {
                    s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(a[g]));
                    s1 = _mm512_dpbusd_epi32(s1, w[g + 4], _mm512_set1_epi32(a[g + 4]));
                }
                isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0),
                                                                     _mm512_mullo_epi32(s1, sc1)));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
        for (int i = 0; i < mr; i++) {
            const __m512 da = _mm512_set1_ps(((const float*)(act + i * arb + k))[b]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, da), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* The K-quants' groups against activation rows [m0, m1), RP_K_MR at a time. */
RP_GROUPS_MM(q4_k, rp_k_tile, 144, RP_K_MR) RP_GROUPS_MM(q6_k, rp_6_tile, 210, RP_K_MR)
#endif

