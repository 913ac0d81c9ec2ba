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
 * per output the float sum runs over the blocks in order: y = sum_b (d_w,b * d_a,b) * isum_b.
 * Q4_K and Q6_K are in q8repack256k.h. Included by q8repack.h only, where AVX2, FMA and F16C
 * are on. */
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

/* mr activation rows against one group of 8 weight rows: y[i * ldy + 0..7]. `dec`/`decd`:
   the group decoded ahead (nb blocks; Q4_0 / Q5_0), or NULL to decode each record as it comes
   (`pf`: and prefetch the bytes q8_prefetch on). */
static inline RP_AI void rp_tile(const int type, const int shift, const uint8_t* grp,
                                 const __m256i* dec, const __m256* decd, int64_t nb,
                                 const uint8_t* act, int64_t arb, int64_t k, float* y,
                                 int64_t ldy, const int mr, const int pf) {
    const int64_t rb = (int64_t)RP_ROWS * (type == 8 ? 34 : type == 2 ? 18 : 22);
    const int lim = type == 2 ? 8 : 4;
    __m256 acc[RP_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w[8];
        __m256 dw;
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

/* `pf`: how many bytes ahead to ask for the weight's bytes (0: not at all). */
static inline RP_AI void rp_q8_tile16(const uint8_t* grp, int64_t nb, const int16_t* a16,
                                      int64_t k, const uint8_t* act, int64_t arb, float* y,
                                      int64_t ldy, const int mr, const int64_t pf) {
    const int64_t rb = (int64_t)RP_ROWS * 34;
    const __m256i perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);  /* its own inverse */
    __m256 acc[RP_MR16];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = grp + b * rb;
        if (pf)
            for (int64_t p = 0; p < rb; p += 64)
                __builtin_prefetch(rec + p + pf, 0, 3);
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

/* From how many activation rows this int16 path asks for its weight's bytes q8_prefetch ahead
   (when the policy prefetches light types there); below that it asks q8_i16_few bytes ahead,
   0 for none (qmatmul.c's policy, per CPU). Intel Xeon (AVX-512 + AMX, running this AVX2
   code; decode_step_profile --gemma --batch 1, SLOTSERVE_CPU_LEVEL=v3): the 262k x 640 Q8_0
   output projection 16.4-16.7 ms a step with the requests 4 KiB ahead, 13.7-14.1 ms without;
   AMD Zen 4 did not ask below 4 rows either; AMD Zen 3 gains from 2 KiB ahead. */
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
                const int64_t pf = i != c0 ? 0
                                 : m1 - m0 < RP_Q8_PF_ROWS ? q8_i16_few
                                 : q8_prefetching(m0, m1, 1) ? q8_prefetch : 0;
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

/* A call of at least RP_AHEAD_ROWS activation rows decodes each group once ahead, and every
   tile of rows reads it (Q4_0 / Q5_0 below, Q4_K / Q6_K in q8repack256k.h; q8repack512.h does
   the same): unpacking nibbles, high bits and scales again for every RP_MR rows costs about
   as much as their products. AMD Zen 3 (EPYC, AVX2), decode_step_profile.py --gemma, the
   layers: batch 32 71-74 ms against 78-80 as before, batch 8 24.4 against 22.8 when it
   started at 5 rows (the stores and reloads cost more than two decodes), equal from 9. */
#ifndef RP_AHEAD_ROWS
#define RP_AHEAD_ROWS 9
#endif
/* Either tile call, each inlined with `dec` a constant (NULL: the one-row path as before). */
#define RP_AHEAD(WITH, WITHOUT) do { if (ahead) WITH; else WITHOUT; } while (0)
#include "q8repack256k.h"

#define RP_Q8_0_TILE(gp, nb, a_, arb, k, y_, ldy, mr, pf) \
    rp_tile(8, 7, gp, 0, 0, nb, a_, arb, k, y_, ldy, mr, pf)

/* Q4_0 / Q5_0: groups [g0, g1) against activation rows [m0, m1), decoded ahead for a wide
   call (above); the integer and float steps are the same either way, so are the outputs. */
#define RP_DEC_MAX 128     /* blocks per row decoded ahead (k <= 4096: 36 KiB of stack) */
#define RP_TILE_CASE(N, T, S) \
    case N: RP_AHEAD(rp_tile(T, S, gp, dec, decd, nb, a_, arb, k, y_, ldy, N, 0), \
                     rp_tile(T, S, gp, 0, 0, nb, a_, arb, k, y_, ldy, N, pf)); break;
#define RP_MM(NAME, TYPE, SHIFT)                                                             \
static void NAME##_rp_mm(const uint8_t* wp, int64_t nb, const uint8_t* act, int64_t arb,      \
                         int64_t k, int64_t m0, int64_t m1, float* y, int64_t ldy,            \
                         int64_t g0, int64_t g1) {                                            \
    const int64_t rb = (int64_t)RP_ROWS * (TYPE == 2 ? 18 : 22);                              \
    const int ahead = m1 - m0 >= RP_AHEAD_ROWS && nb <= RP_DEC_MAX;                           \
    __m256i dec[ahead ? 8 * nb : 1];                                                          \
    __m256 decd[ahead ? nb : 1];                                                              \
    for (int64_t grp = g0; grp < g1; grp++) {                                                 \
        const uint8_t* gp = wp + grp * nb * rb;                                               \
        if (ahead)                                                                            \
            for (int64_t b = 0; b < nb; b++) {                                                \
                for (int64_t p = 0; q8_prefetching(m0, m1, 1) && p < rb; p += 64)             \
                    __builtin_prefetch(gp + b * rb + p + q8_prefetch, 0, 3);                  \
                rp_decode(TYPE, gp + b * rb, dec + 8 * b, decd + b);                          \
            }                                                                                 \
        for (int64_t i = m0; i < m1; i += RP_MR) {                                            \
            const uint8_t* a_ = act + i * arb;                                                \
            float* y_ = y + i * ldy + grp * RP_ROWS;                                          \
            const int pf = !ahead && i == m0 && q8_prefetching(m0, m1, 1);                   \
            switch (m1 - i < RP_MR ? (int)(m1 - i) : RP_MR) {                                 \
                RP_TILE_CASE(1, TYPE, SHIFT) RP_TILE_CASE(2, TYPE, SHIFT)                     \
                RP_TILE_CASE(3, TYPE, SHIFT) default:                                         \
                RP_AHEAD(rp_tile(TYPE, SHIFT, gp, dec, decd, nb, a_, arb, k, y_, ldy, RP_MR, 0), \
                         rp_tile(TYPE, SHIFT, gp, 0, 0, nb, a_, arb, k, y_, ldy, RP_MR, pf));  \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}
RP_MM(q4_0, 2, 3) RP_MM(q5_0, 6, 4)
#ifdef __AVXVNNI__
RP_GROUPS_MM(q8_0, RP_Q8_0_TILE, 34, RP_MR)
#else
RP_GROUPS_MM(q8_0_sign, RP_Q8_0_TILE, 34, RP_MR)
#endif

#endif
