/* The 8-row packed layout (q8repack.h) times 8-bit activations with AVX2, or AVX-VNNI where
 * the build has it: one 256-bit register holds 4 bytes of each of 8 rows, so a register times
 * a broadcast of 4 activation bytes adds to int32 lane r row r's 4-value dot, with no
 * horizontal sum, and one conversion, one scale product and one multiply-add finish a block
 * for 8 rows at once.
 *
 * AVX-VNNI: vpdpbusd, the weights unsigned (Q8_0 + 128, Q4_0 / Q5_0 their stored + 8 / + 16,
 * taken back exactly from -sum(a): the dot starts from off * -sum(a), as in q8repack512.h).
 * AVX2: vpmaddubsw (u8 x s8 pairs into int16, saturating) then vpmaddwd. No pair may pass
 * 2^15 - 1, and |a| <= 127 (q8act.h), so: nibble and 5-/6-bit weights (at most 15, 31, 63)
 * are summed as int16 over up to 8, 4, 2 registers (8 * 2 * 15 * 127 = 30480) before one
 * vpmaddwd, by 1 or by the K-quants' per-row scale; Q8_0, whose + 128 would saturate, is kept
 * signed in this layout and multiplied as |w| times sign(a, w) (at most 2 * 128 * 127), as
 * ggml's AVX2 code does, or (without AVX-VNNI, rows of at most RP_A16 values) both sides
 * widened to int16 for vpmaddwd alone (rp_q8_tile16). Every integer sum is exact either way;
 * per output the float sum runs over the blocks in order: y = sum_b (d_w,b * d_a,b) * isum_b. Included by q8repack.h only,
 * where AVX2, FMA and F16C are on. */
#ifndef SLOTSERVE_Q8REPACK256_H
#define SLOTSERVE_Q8REPACK256_H
#define RP_SIMD 1
#define RP_MR 4  /* activation rows per tile: 16 ymm registers hold 8 weight, 4 accumulators */
typedef int32_t rp_i32 __attribute__((may_alias, aligned(1)));
#define RP_LD(p) _mm256_loadu_si256((const __m256i*)(p))
#define RP_LD8(p) _mm_loadl_epi64((const __m128i*)(p))
#define RP_BC(v) _mm256_set1_epi32(v)
#define RP_AI __attribute__((always_inline))

/* int32 lane r: init_r + sum over g < n of row r's 4 unsigned bytes of w[g] times the 4
   signed activation bytes a[g]; AVX2 sums at most `lim` vpmaddubsw results as int16. */
static inline RP_AI __m256i rp8_dot(__m256i init, const __m256i* w, const rp_i32* a,
                                    const int n, const int lim) {
#ifdef __AVXVNNI__
    (void)lim;
    __m256i s1 = _mm256_setzero_si256();
    for (int g = 0; g + 1 < n; g += 2) {
        init = _mm256_dpbusd_avx_epi32(init, w[g], RP_BC(a[g]));
        s1 = _mm256_dpbusd_avx_epi32(s1, w[g + 1], RP_BC(a[g + 1]));
    }
    if (n % 2) init = _mm256_dpbusd_avx_epi32(init, w[n - 1], RP_BC(a[n - 1]));
    return _mm256_add_epi32(init, s1);
#else
    const __m256i one = _mm256_set1_epi16(1);
    for (int g0 = 0; g0 < n; g0 += lim) {
        __m256i s = _mm256_maddubs_epi16(w[g0], RP_BC(a[g0]));
        for (int g = g0 + 1; g < g0 + lim && g < n; g++)
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g], RP_BC(a[g])));
        init = _mm256_add_epi32(init, _mm256_madd_epi16(s, one));
    }
    return init;
#endif
}

/* 8 per-row scale bytes (unsigned or, `sgn`, signed) as rp8_dot_sc takes them: AVX-VNNI int32
   per lane; AVX2 the scale twice per lane as int16, for vpmaddwd. */
static inline RP_AI __m256i rp8_scales(__m128i sc8, const int sgn) {
#ifdef __AVXVNNI__
    return sgn ? _mm256_cvtepi8_epi32(sc8) : _mm256_cvtepu8_epi32(sc8);
#else
    __m128i twice = _mm_unpacklo_epi8(sc8, sc8);
    return sgn ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
#endif
}

/* rp8_dot from zero, times each row's scale `sc` (rp8_scales). */
static inline RP_AI __m256i rp8_dot_sc(const __m256i* w, const rp_i32* a, const int n,
                                       const int lim, __m256i sc) {
#ifdef __AVXVNNI__
    return _mm256_mullo_epi32(rp8_dot(_mm256_setzero_si256(), w, a, n, lim), sc);
#else
    __m256i acc = _mm256_setzero_si256();
    for (int g0 = 0; g0 < n; g0 += lim) {
        __m256i s = _mm256_maddubs_epi16(w[g0], RP_BC(a[g0]));
        for (int g = g0 + 1; g < g0 + lim && g < n; g++)
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g], RP_BC(a[g])));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s, sc));
    }
    return acc;
#endif
}

/* int32 lane r: sum over j < 8 of p[j]'s int16 pair of row r times the activation's int16
   pair bs[2j], bs[2j + 1] (the K-quants' min and offset terms, exact). */
static inline RP_AI __m256i rp8_pairdot(const __m256i* p, const int16_t* bs) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p[j], RP_BC(((const rp_i32*)bs)[j])));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p[j + 1], RP_BC(((const rp_i32*)bs)[j + 1])));
    }
    return _mm256_add_epi32(s0, s1);
}

/* A block record's 8 scales and its 8 lane registers (register g for activation bytes
   4g..4g+3): Q4_0 / Q5_0 unsigned (0..15, 0..31), Q8_0 as stored (+128 with AVX-VNNI, else
   signed). */
static inline RP_AI void rp_decode(const int type, const uint8_t* rec, __m256i w[8],
                                   __m256* dw) {
    *dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
    if (type == 8) {
        for (int g = 0; g < 8; g++) w[g] = RP_LD(rec + 16 + 32 * g);
        return;
    }
    const uint8_t* q = rec + 16 + (type == 6 ? 32 : 0);
    const __m256i m4 = _mm256_set1_epi8(0x0f), b4 = _mm256_set1_epi8(0x10);
    const __m256i hb = type == 6 ? RP_LD(rec + 16) : _mm256_setzero_si256();
    for (int g = 0; g < 4; g++) {
        __m256i v = RP_LD(q + 32 * g);
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (type == 6) {  /* bit g (lo) and g + 4 (hi) of each byte to bit 4: no byte's bit 4 is
                             reached by its neighbour's bits within the 16-bit shift */
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4 - g), b4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(g ? _mm256_srli_epi16(hb, g) : hb, b4));
        }
        w[g] = lo;
        w[g + 4] = hi;
    }
}

/* mr activation rows against one group of 8 weight rows: y[i * ldy + 0..7]. */
static inline RP_AI void rp_tile(const int type, const int shift, const uint8_t* grp,
                                 int64_t nb, const uint8_t* act, int64_t arb, int64_t k,
                                 float* y, int64_t ldy, const int mr, const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * (type == 8 ? 34 : type == 2 ? 18 : 22);
    const int lim = type == 2 ? 8 : 4;
    __m256 acc[RP_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        if (pf)
            for (int64_t p = 0; p < rb; p += 64)
                __builtin_prefetch(rec + p + q8_prefetch, 0, 3);
        __m256i w[8];
        __m256 dw;
        rp_decode(type, rec, w, &dw);
#ifndef __AVXVNNI__
        __m256i u[8];
        if (type == 8)
            for (int g = 0; g < 8; g++) u[g] = _mm256_abs_epi8(w[g]);
#endif
        for (int i = 0; i < mr; i++) {
            const uint8_t* ai = act + i * arb;
            const rp_i32* a = (const rp_i32*)(ai + 32 * b);
            const float da = ((const float*)(ai + k))[b];
            __m256i is;
#ifndef __AVXVNNI__
            if (type == 8) {
                const __m256i one = _mm256_set1_epi16(1);
                __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                for (int g = 0; g < 8; g += 2) {
                    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                        u[g], _mm256_sign_epi8(RP_BC(a[g]), w[g])), one));
                    s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                        u[g + 1], _mm256_sign_epi8(RP_BC(a[g + 1]), w[g + 1])), one));
                }
                is = _mm256_add_epi32(s0, s1);
            } else
#endif
            {
                const int32_t ns = Q8_0_NEGSUM(ai, k, nb)[b];
                is = rp8_dot(RP_BC(ns * (1 << shift)), w, a, 8, lim);
            }
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(dw, _mm256_set1_ps(da)),
                                     acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm256_storeu_ps(y + i * ldy, acc[i]);
}

#ifndef __AVXVNNI__
/* Q8_0 with AVX2 in int16: vpmaddubsw needs |w| and sign(a, w) here (w + 128 would saturate),
   and on Zen 4 the sign, vpmaddubsw and vpmaddwd all issue to the same two of the four vector
   pipes (as do vpabsb and the float multiply-adds): 3 ops there per 32 multiply-adds.
   Widened to int16 instead (the weights once per block for every activation row of the tile,
   the activations once per call, RP_A16 values at a time), a vpmaddwd does 16 multiply-adds
   and its vpaddd runs on any pipe: 2 ops there per 32. The int16 weight register of rows 0-3
   (4-7) holds each row's 4 values in two int32 lanes, so per row two lanes are summed over the
   block's 8 registers (at most 16 * 2 * 128 * 127, exact) and one vphaddd of the two halves
   gives rows 0 1 4 5 2 3 6 7: the block scales are put in that order and the sums back in row
   order at the end. The integer sums are rp_tile's, the float steps the same, so the outputs
   are its bits. */
#ifndef RP_A16
#define RP_A16 (32 * 1024)  /* int16 activations per pass, on the stack (64 KiB; 51 rows
                                of Gemma 3 270M's 640) */
#endif
#ifndef RP_MR16
#define RP_MR16 6  /* activation rows per tile (at most 6): 12 int32 sums, 2 weight registers,
                      the broadcast and a product, the 6 float sums read once a block */
#endif
#if RP_MR16 > 6
#error "rp_q8_tile16's driver handles tiles of at most 6 rows"
#endif

static inline RP_AI void rp_q8_tile16(const uint8_t* grp, int64_t nb, const int16_t* a16,
                                      int64_t k, const uint8_t* act, int64_t arb, float* y,
                                      int64_t ldy, const int mr, const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * 34;
    const __m256i perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);  /* its own inverse */
    __m256 acc[RP_MR16];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        if (pf)
            for (int64_t p = 0; p < rb; p += 64)
                __builtin_prefetch(rec + p + q8_prefetch, 0, 3);
        __m256i lo[RP_MR16], hi[RP_MR16];
        for (int i = 0; i < mr; i++) lo[i] = hi[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const uint8_t* wq = rec + 16 + 32 * g;
            const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wq));
            const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wq + 16)));
            for (int i = 0; i < mr; i++) {
                int64_t a4;  /* values 4g..4g+3 of the block, row i */
                memcpy(&a4, a16 + i * k + 32 * b + 4 * g, sizeof a4);
                const __m256i a = _mm256_set1_epi64x(a4);
                const __m256i pl = _mm256_madd_epi16(wl, a), ph = _mm256_madd_epi16(wh, a);
                lo[i] = _mm256_add_epi32(lo[i], pl);
                hi[i] = _mm256_add_epi32(hi[i], ph);
                /* keeps the sums as chains in registers: GCC's reassociation would otherwise
                   hold all 16 products of a row on the stack and add them as a tree */
                __asm__("" : "+x"(lo[i]), "+x"(hi[i]));
            }
        }
        const __m256 dw = _mm256_permutevar8x32_ps(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec)), perm);
        for (int i = 0; i < mr; i++) {
            const float da = ((const float*)(act + i * arb + k))[b];
            const __m256i is = _mm256_hadd_epi32(lo[i], hi[i]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(da)), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++)
        _mm256_storeu_ps(y + i * ldy, _mm256_permutevar8x32_ps(acc[i], perm));
}

/* From how many activation rows this int16 path asks for its weight's bytes ahead, whatever
   the vendor (qmatmul.c's policy sets it for the other paths): below that the hardware
   prefetcher alone streams it faster. Intel Xeon (AVX-512 + AMX, running this AVX2 code;
   decode_step_profile --gemma --batch 1, SLOTSERVE_CPU_LEVEL=v3): the 262k x 640 Q8_0 output
   projection 16.4-16.7 ms a step with the requests 4 KiB ahead, 13.7-14.1 ms without; AMD
   Zen 4 already did not ask below 4 rows. */
#ifndef RP_Q8_PF_ROWS
#define RP_Q8_PF_ROWS 4
#endif

static void q8_0_sign_rp_mm(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                            int64_t, float*, int64_t, int64_t, int64_t);

/* The Q8_0 driver: activation rows [m0, m1) widened to int16 RP_A16 values at a time, each
   such pass against groups [g0, g1); rows longer than RP_A16 take rp_tile's signs instead. */
static void q8_0_rp_mm(const uint8_t* wp, int64_t nb, const uint8_t* act, int64_t arb,
                       int64_t k, int64_t m0, int64_t m1, float* y, int64_t ldy, int64_t g0,
                       int64_t g1) {
    if (k > RP_A16) {
        q8_0_sign_rp_mm(wp, nb, act, arb, k, m0, m1, y, ldy, g0, g1);
        return;
    }
    int16_t a16[RP_A16] __attribute__((aligned(32)));
    const int64_t rows = RP_A16 / k;
    for (int64_t c0 = m0; c0 < m1; c0 += rows) {
        const int64_t c1 = m1 - c0 < rows ? m1 : c0 + rows;
        for (int64_t i = c0; i < c1; i++)
            for (int64_t j = 0; j < k; j += 16)
                _mm256_storeu_si256((__m256i*)(a16 + (i - c0) * k + j), _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i*)(act + i * arb + j))));
        for (int64_t grp = g0; grp < g1; grp++) {
            const uint8_t* gp = wp + grp * nb * RP_ROWS * 34;
            for (int64_t i = c0; i < c1; i += RP_MR16) {
                const int16_t* ai = a16 + (i - c0) * k;
                const uint8_t* a_ = act + i * arb;
                float* y_ = y + i * ldy + grp * RP_ROWS;
                const int pf = i == c0 && m1 - m0 >= RP_Q8_PF_ROWS && q8_prefetching(m0, m1, 1);
#define RP_T16(mr) rp_q8_tile16(gp, nb, ai, k, a_, arb, y_, ldy, mr, pf)
                switch (c1 - i < RP_MR16 ? (int)(c1 - i) : RP_MR16) {
                    case 1: RP_T16(1); break;
                    case 2: RP_T16(2); break;
                    case 3: RP_T16(3); break;
                    case 4: RP_T16(4); break;
                    case 5: RP_T16(5); break;
                    default: RP_T16(RP_MR16);
                }
#undef RP_T16
            }
        }
    }
}
#endif

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

static inline RP_AI void rp_k_tile(const uint8_t* grp, int64_t nb, const uint8_t* act,
                                   int64_t arb, int64_t k, float* y, int64_t ldy, const int mr,
                                   const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * 144;
    __m256 acc[RP_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        if (pf) Q8_K4_PREFETCH(rec, rb);
        __m256i isum[RP_MR], mn[8];
        for (int i = 0; i < mr; i++) isum[i] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {  /* (mn_s, mn_s) per row, against bs[2s], bs[2s + 1] */
            __m128i m8 = rp_k_six(rec, s, 1);
            mn[s] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        }
        for (int s = 0; s < 8; s++) {
            __m256i w[8];
            for (int g = 0; g < 8; g++) {
                __m256i v = RP_LD(rec + RP_K_QS + 256 * (s / 2) + 32 * g);
                w[g] = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
            }
            const __m256i sc = rp8_scales(rp_k_six(rec, s, 0), 0);
            for (int i = 0; i < mr; i++) {
                const rp_i32* a = (const rp_i32*)(act + i * arb + 256 * b + 32 * s);
                isum[i] = _mm256_add_epi32(isum[i], rp8_dot_sc(w, a, 8, 8, sc));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16)));
        for (int i = 0; i < mr; i++) {
            const uint8_t* ai = act + i * arb;
            const int16_t* bs = (const int16_t*)((const float*)(ai + k) + nb) + 16 * b;
            const __m256i msum = rp8_pairdot(mn, bs);
            const __m256 da = _mm256_set1_ps(((const float*)(ai + k))[b]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(d, da), acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, da), acc[i]);
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

static inline RP_AI void rp_6_tile(const uint8_t* grp, int64_t nb, const uint8_t* act,
                                   int64_t arb, int64_t k, float* y, int64_t ldy, const int mr,
                                   const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * 210;
    __m256 acc[RP_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        const uint8_t* pl = rec + RP_6_SCALES;  /* plane g: the 8 rows' scales[g] */
        if (pf)
            for (int64_t p = 0; p < rb; p += 64)
                __builtin_prefetch(rec + p + q8_prefetch, 0, 3);
        __m256i isum[RP_MR], scp[8];
        for (int i = 0; i < mr; i++) isum[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++)  /* (sc_2j, sc_2j+1) per row, against bs[2j], bs[2j + 1] */
            scp[j] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(RP_LD8(pl + 16 * j),
                                                            RP_LD8(pl + 16 * j + 8)));
        for (int c = 0; c < 8; c++) {
            __m256i w[8];
            for (int g = 0; g < 8; g++) {
                __m256i lo = RP_LD(rec + RP_6_LO + 256 * (c / 2) + 32 * g);
                __m256i hi = RP_LD(rec + RP_6_HI + 256 * (c / 4) + 32 * g);
                lo = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(lo, 4) : lo, m4);
                w[g] = _mm256_or_si256(lo, rp_6_hi(hi, c));
            }
            const __m256i sc0 = rp8_scales(RP_LD8(pl + 8 * (2 * c)), 1);
            const __m256i sc1 = rp8_scales(RP_LD8(pl + 8 * (2 * c + 1)), 1);
            for (int i = 0; i < mr; i++) {
                const rp_i32* a = (const rp_i32*)(act + i * arb + 256 * b + 32 * c);
                isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(
                    rp8_dot_sc(w, a, 4, 2, sc0), rp8_dot_sc(w + 4, a + 4, 4, 2, sc1)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
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

#define RP_Q4_0_TILE(gp, nb, a_, arb, k, y_, ldy, mr, pf) \
    rp_tile(2, 3, gp, nb, a_, arb, k, y_, ldy, mr, pf)
#define RP_Q5_0_TILE(gp, nb, a_, arb, k, y_, ldy, mr, pf) \
    rp_tile(6, 4, gp, nb, a_, arb, k, y_, ldy, mr, pf)
#define RP_Q8_0_TILE(gp, nb, a_, arb, k, y_, ldy, mr, pf) \
    rp_tile(8, 7, gp, nb, a_, arb, k, y_, ldy, mr, pf)

RP_GROUPS_MM(q4_0, RP_Q4_0_TILE, 18, RP_MR) RP_GROUPS_MM(q5_0, RP_Q5_0_TILE, 22, RP_MR)
#ifdef __AVXVNNI__
RP_GROUPS_MM(q8_0, RP_Q8_0_TILE, 34, RP_MR)
#else
RP_GROUPS_MM(q8_0_sign, RP_Q8_0_TILE, 34, RP_MR)
#endif
RP_GROUPS_MM(q4_k, rp_k_tile, 144, RP_MR)
RP_GROUPS_MM(q6_k, rp_6_tile, 210, RP_MR)

#endif
