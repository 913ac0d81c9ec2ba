/* Q4_K and Q6_K in the 8-row packed layout (q8repack.h) times Q8_K activations with AVX2 (or
 * AVX-VNNI): the integer dots of rp8_dot_sc, exact, then the scales as q8dot.h's formulas.
 * A call of many activation rows decodes each group once ahead (RPK_MM). Included by
 * q8repack256.h only, after its helpers. */
#ifndef SLOTSERVE_Q8REPACK256K_H
#define SLOTSERVE_Q8REPACK256K_H

/* Q4_K: per block and activation row, each sub-block's integer dot for 8 rows times its
   scale, and the mins times the activation's bsums (rp8_pairdot), exact int32; then
   acc += (d_w * d_a) * isum - (dmin_w * d_a) * msum, as q8dot.h's formula. */
static inline RP_AI __m128i rp_k_six(const uint8_t* rec, int j, int mins) {
    const uint8_t* pl = rec + RP_K_SCALES;  /* plane i: the 8 rows' scales[i] */
    const __m128i m63 = _mm_set1_epi8(63), m0f = _mm_set1_epi8(0x0f), m30 = _mm_set1_epi8(0x30);
    if (j < 4) return _mm_and_si128(RP_LD8(pl + 8 * (j + 4 * mins)), m63);
    __m128i lo = RP_LD8(pl + 8 * (j + 4));  /* scales[j + 4] */
    lo = mins ? _mm_and_si128(_mm_srli_epi16(lo, 4), m0f) : _mm_and_si128(lo, m0f);
    __m128i top = RP_LD8(pl + 8 * (j - 4 + 4 * mins));
    return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(top, 2), m30));
}

/* A K-quant record decoded ahead: per chunk of 32 values its 8 lane registers (w[8c..]) and
   scale registers (Q4_K one, sc[c]; Q6_K two, sc[2c], sc[2c + 1]); the int16 pairs of the
   min (Q4_K) or offset (Q6_K) term (pair); d and (Q4_K) dmin. */
typedef struct {
    __m256i w[64], sc[16], pair[8];
    __m256 d, dmin;
} rpk_dec;

static inline RP_AI void rp_k_chunk(const uint8_t* rec, const int s, __m256i w[8],
                                    __m256i sc[1]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < 8; g++) {
        __m256i v = RP_LD(rec + RP_K_QS + 256 * (s / 2) + 32 * g);
        w[g] = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
    }
    sc[0] = rp8_scales(rp_k_six(rec, s, 0), 0);
}

static inline RP_AI void rp_k_head(const uint8_t* rec, rpk_dec* h) {
    for (int s = 0; s < 8; s++) {  /* (mn_s, mn_s) per row, against bs[2s], bs[2s + 1] */
        __m128i m8 = rp_k_six(rec, s, 1);
        h->pair[s] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    }
    h->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
    h->dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16)));
}

static inline RP_AI void rp_k_decode(const uint8_t* rec, rpk_dec* out) {
    rp_k_head(rec, out);
    for (int s = 0; s < 8; s++) rp_k_chunk(rec, s, out->w + 8 * s, out->sc + s);
}

/* `dec`: the group's records decoded ahead (nb of them), or NULL to decode each as it comes. */
static inline RP_AI void rp_k_tile(const uint8_t* grp, const rpk_dec* dec, int64_t nb,
                                   const uint8_t* act, int64_t arb, int64_t k, float* y,
                                   int64_t ldy, const int mr, const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * 144;
    __m256 acc[RP_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        if (pf && !dec) Q8_K4_PREFETCH(rec, rb);
        rpk_dec head_;
        const rpk_dec* h = dec ? dec + b : &head_;
        if (!dec) rp_k_head(rec, &head_);
        __m256i isum[RP_MR];
        for (int i = 0; i < mr; i++) isum[i] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            __m256i w_[8], sc_[1];
            const __m256i *w = w_, *sc = sc_;
            if (dec) {
                w = h->w + 8 * s;
                sc = h->sc + s;
            } else {
                rp_k_chunk(rec, s, w_, sc_);
            }
            for (int i = 0; i < mr; i++) {
                const rp_i32* a = (const rp_i32*)(act + i * arb + 256 * b + 32 * s);
                isum[i] = _mm256_add_epi32(isum[i], rp8_dot_sc(w, a, 8, 8, sc[0]));
            }
        }
        for (int i = 0; i < mr; i++) {
            const uint8_t* ai = act + i * arb;
            const int16_t* bs = (const int16_t*)((const float*)(ai + k) + nb) + 16 * b;
            const __m256i msum = rp8_pairdot(h->pair, bs);
            const __m256 da = _mm256_set1_ps(((const float*)(ai + k))[b]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(h->d, da),
                                     acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(h->dmin, da),
                                      acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(y + i * ldy, acc[i]);
}

/* Q6_K: per block and activation row, each 16-value group's integer dot of the unsigned
   values v = q + 32 for 8 rows times the group's scale, less 32 * sum_g sc_g * bsum_g (the
   offset, exact: rp8_pairdot); then acc += (d_w * d_a) * isum, as q8dot.h's formula. */
static inline RP_AI __m256i rp_6_hi(__m256i h, int c) {  /* bits 2c..2c+1 of each byte to 4..5 */
    switch (c % 4) {
        case 0: h = _mm256_slli_epi16(h, 4); break;
        case 1: h = _mm256_slli_epi16(h, 2); break;
        case 3: h = _mm256_srli_epi16(h, 2); break;
        default: break;
    }
    return _mm256_and_si256(h, _mm256_set1_epi8(0x30));
}

static inline RP_AI void rp_6_chunk(const uint8_t* rec, const int c, __m256i w[8],
                                    __m256i sc[2]) {
    const uint8_t* pl = rec + RP_6_SCALES;  /* plane g: the 8 rows' scales[g] */
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < 8; g++) {
        __m256i lo = RP_LD(rec + RP_6_LO + 256 * (c / 2) + 32 * g);
        __m256i hi = RP_LD(rec + RP_6_HI + 256 * (c / 4) + 32 * g);
        lo = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(lo, 4) : lo, m4);
        w[g] = _mm256_or_si256(lo, rp_6_hi(hi, c));
    }
    sc[0] = rp8_scales(RP_LD8(pl + 8 * (2 * c)), 1);
    sc[1] = rp8_scales(RP_LD8(pl + 8 * (2 * c + 1)), 1);
}

static inline RP_AI void rp_6_head(const uint8_t* rec, __m256i scp[8], __m256* d) {
    const uint8_t* pl = rec + RP_6_SCALES;
    for (int j = 0; j < 8; j++)  /* (sc_2j, sc_2j+1) per row, against bs[2j], bs[2j + 1] */
        scp[j] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(RP_LD8(pl + 16 * j),
                                                        RP_LD8(pl + 16 * j + 8)));
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
}

static inline RP_AI void rp_6_decode(const uint8_t* rec, rpk_dec* out) {
    rp_6_head(rec, out->pair, &out->d);
    for (int c = 0; c < 8; c++) rp_6_chunk(rec, c, out->w + 8 * c, out->sc + 2 * c);
}

/* `dec`: the group's records decoded ahead (nb of them), or NULL to decode each as it comes. */
static inline RP_AI void rp_6_tile(const uint8_t* grp, const rpk_dec* dec, int64_t nb,
                                   const uint8_t* act, int64_t arb, int64_t k, float* y,
                                   int64_t ldy, const int mr, const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * 210;
    __m256 acc[RP_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        if (pf && !dec)
            for (int64_t p = 0; p < rb; p += 64)
                __builtin_prefetch(rec + p + q8_prefetch, 0, 3);
        __m256i isum[RP_MR], scp_[8];
        __m256 d_;
        const __m256i* scp = scp_;
        if (dec) scp = dec[b].pair;
        else rp_6_head(rec, scp_, &d_);
        for (int i = 0; i < mr; i++) isum[i] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            __m256i w_[8], sc_[2];
            const __m256i *w = w_, *sc = sc_;
            if (dec) {
                w = dec[b].w + 8 * c;
                sc = dec[b].sc + 2 * c;
            } else {
                rp_6_chunk(rec, c, w_, sc_);
            }
            for (int i = 0; i < mr; i++) {
                const rp_i32* a = (const rp_i32*)(act + i * arb + 256 * b + 32 * c);
                isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(
                    rp8_dot_sc(w, a, 4, 2, sc[0]), rp8_dot_sc(w + 4, a + 4, 4, 2, sc[1])));
            }
        }
        const __m256 d = dec ? dec[b].d : d_;
        for (int i = 0; i < mr; i++) {
            const uint8_t* ai = act + i * arb;
            const int16_t* bs = (const int16_t*)((const float*)(ai + k) + nb) + 16 * b;
            const __m256i is = _mm256_sub_epi32(isum[i],
                                                _mm256_slli_epi32(rp8_pairdot(scp, bs), 5));
            const __m256 da = _mm256_set1_ps(((const float*)(ai + k))[b]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, da), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(y + i * ldy, acc[i]);
}

/* Q4_K / Q6_K groups [g0, g1) against rows [m0, m1), decoded ahead for a wide call
   (q8repack256.h; Zen 3, quant_kernels.py --slotserve-only --m 32, best of 3: Q4_K 132 ->
   145, Q6_K 107 -> 130 GFLOP/s; --m 256: 123 -> 152, 102 -> 141). */
#define RPK_DEC_MAX 16     /* blocks per row decoded ahead (k <= 4096: 42 KiB of stack) */
#define RPK_MM(NAME, TILE, DECODE, BYTES)                                                    \
static void NAME##_rp_mm(const uint8_t* wp, int64_t nb, const uint8_t* act, int64_t arb,      \
                         int64_t k, int64_t m0, int64_t m1, float* y, int64_t ldy,            \
                         int64_t g0, int64_t g1) {                                            \
    const int64_t rb = (int64_t)RP_ROWS * (BYTES);                                            \
    const int ahead = m1 - m0 >= RP_AHEAD_ROWS && nb <= RPK_DEC_MAX;                          \
    rpk_dec dec[ahead ? nb : 1];                                                              \
    for (int64_t grp = g0; grp < g1; grp++) {                                                 \
        const uint8_t* gp = wp + grp * nb * rb;                                               \
        if (ahead)                                                                            \
            for (int64_t b = 0; b < nb; b++) {                                                \
                if ((BYTES) == 144 && q8_prefetching(m0, m1, 0))                              \
                    Q8_K4_PREFETCH(gp + b * rb, rb);  /* as rp_k_tile's own */                \
                for (int64_t p = 0; (BYTES) != 144 && q8_prefetching(m0, m1, 0) && p < rb;   \
                     p += 64)                                                                 \
                    __builtin_prefetch(gp + b * rb + p + q8_prefetch, 0, 3);                  \
                DECODE(gp + b * rb, dec + b);                                                 \
            }                                                                                 \
        for (int64_t i = m0; i < m1; i += RP_MR) {                                            \
            const uint8_t* a_ = act + i * arb;                                                \
            float* y_ = y + i * ldy + grp * RP_ROWS;                                          \
            const int pf = !ahead && i == m0 && q8_prefetching(m0, m1, 0);                   \
            switch (m1 - i < RP_MR ? (int)(m1 - i) : RP_MR) {                                 \
                case 1: RP_AHEAD(TILE(gp, dec, nb, a_, arb, k, y_, ldy, 1, 0),                \
                                 TILE(gp, 0, nb, a_, arb, k, y_, ldy, 1, pf)); break;         \
                case 2: RP_AHEAD(TILE(gp, dec, nb, a_, arb, k, y_, ldy, 2, 0),                \
                                 TILE(gp, 0, nb, a_, arb, k, y_, ldy, 2, pf)); break;         \
                case 3: RP_AHEAD(TILE(gp, dec, nb, a_, arb, k, y_, ldy, 3, 0),                \
                                 TILE(gp, 0, nb, a_, arb, k, y_, ldy, 3, pf)); break;         \
                default: RP_AHEAD(TILE(gp, dec, nb, a_, arb, k, y_, ldy, RP_MR, 0),           \
                                  TILE(gp, 0, nb, a_, arb, k, y_, ldy, RP_MR, pf));           \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}
RPK_MM(q4_k, rp_k_tile, rp_k_decode, 144) RPK_MM(q6_k, rp_6_tile, rp_6_decode, 210)

#endif
