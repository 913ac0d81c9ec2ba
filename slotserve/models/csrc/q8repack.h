/* Q4_0, Q5_0, Q8_0 (and Q4_K, Q6_K, below) weights repacked at load into 16 interleaved rows, times 8-bit
 * activations with AVX-512 VNNI: one 512-bit weight load feeds all 16 rows of a group, and a
 * group stays in L1 while every activation row of the call runs against it.
 *
 * The layout is what ggml's CPU "repack" does for the same reason (block_q4_0x8 and kin: the
 * scales of several rows' blocks first, then their quants interleaved a few bytes at a time),
 * here with 16 rows and 4 bytes, the width of one vpdpbusd lane. Per group of rows 16r..16r+15
 * and per block b (32 values), one record of 16 * block-bytes bytes (so the packed matrix has
 * exactly the original's size):
 *
 *   16 float16 scales d, row 0 first;
 *   Q5_0 only: 8 uint64 high-bit masks, mask g bit 4r + t = high bit of value 4g + t of row r;
 *   the quants as "lanes": lane register g, bytes 4r..4r+3 = row r's quant bytes 4g..4g+3
 *     (Q8_0: 8 registers, the int8 values + 128; Q4_0 / Q5_0: 4 registers of packed nibbles,
 *     whose low nibbles are values 4g..4g+3 and high nibbles values 16 + 4g..16 + 4g + 3).
 *
 * So vpdpbusd(acc, lanes_g, broadcast(activation bytes 4g..4g+3)) adds to int32 lane r the dot
 * of row r's 4 values with the activation's: after a block's 8 of them every lane holds its
 * row's integer block dot, with no horizontal sum, and one conversion, one scale product and
 * one multiply-add finish the block for 16 rows at once. The unsigned offset of the weights
 * (+128, +8, +16) is taken back exactly as in q8dot512.h: the dot starts from
 * off * -sum(a). Per output the float sum runs over the blocks in order, as llama.cpp's
 * reference does: y = sum_b (d_w,b * d_a,b) * isum_b (the scale product rounded, then fused).
 *
 * The repack and its inverse are plain C (every build; the tests round-trip them); the
 * multiply exists where AVX-512 VNNI and BW are on. Included by qmatmul.c only. */
#ifndef SLOTSERVE_Q8REPACK_H
#define SLOTSERVE_Q8REPACK_H

#define RP_ROWS 16

static inline int rp_type_ok(int32_t type) {
    return type == 2 || type == 6 || type == 8 || type == 12 || type == 14;
}

/* Q6_K (256 six-bit values v = q + 32 a block, scales per 16) per 16 rows: d[16] (float16),
   the 16 int8 scales as 16 planes of 16 (plane g byte r = row r's scales[g]), the low nibbles
   of 8 chunks of 32 values as 4 pairs times 8 lane registers (pair p, register g, byte 4r + t:
   v[64p + 4g + t] & 15 | (v[64p + 32 + 4g + t] & 15) << 4), then their top two bits as 2
   quads times 8 registers (quad h, register g, byte 4r + t: bits 2j..2j+1 = v[128h + 32j +
   4g + t] >> 4). */
#define RP_6_SCALES 32
#define RP_6_LO 288
#define RP_6_HI 2336
static void rp_6_block(uint8_t* blk, int r, uint8_t* rec, int pack) {
    uint8_t v[256];
    if (pack) {
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) {
                    int lo = (blk[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0f;
                    int hi = (blk[128 + 32 * h + l] >> (2 * s)) & 3;
                    v[128 * h + 32 * s + l] = (uint8_t)(lo | hi << 4);
                }
        memcpy(rec + 2 * r, blk + 208, 2);
        for (int g = 0; g < 16; g++) rec[RP_6_SCALES + 16 * g + r] = blk[192 + g];
        for (int i = 0; i < 256; i++) {
            int c = i / 32, o = i % 32;
            uint8_t* lo = rec + RP_6_LO + 512 * (c / 2) + 64 * (o / 4) + 4 * r + o % 4;
            uint8_t* hi = rec + RP_6_HI + 512 * (c / 4) + 64 * (o / 4) + 4 * r + o % 4;
            if (c % 2 == 0) *lo = 0;
            if (c % 4 == 0) *hi = 0;
            *lo |= (uint8_t)((v[i] & 15) << (4 * (c % 2)));
            *hi |= (uint8_t)((v[i] >> 4) << (2 * (c % 4)));
        }
        return;
    }
    for (int i = 0; i < 256; i++) {
        int c = i / 32, o = i % 32;
        uint8_t lo = rec[RP_6_LO + 512 * (c / 2) + 64 * (o / 4) + 4 * r + o % 4];
        uint8_t hi = rec[RP_6_HI + 512 * (c / 4) + 64 * (o / 4) + 4 * r + o % 4];
        v[i] = (uint8_t)(((lo >> (4 * (c % 2))) & 15) | ((hi >> (2 * (c % 4))) & 3) << 4);
    }
    memset(blk, 0, 192);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                uint8_t x = v[128 * h + 32 * s + l];
                blk[64 * h + 32 * (s % 2) + l] |= (uint8_t)((x & 15) << (4 * (s / 2)));
                blk[128 + 32 * h + l] |= (uint8_t)((x >> 4) << (2 * s));
            }
    for (int g = 0; g < 16; g++) blk[192 + g] = rec[RP_6_SCALES + 16 * g + r];
    memcpy(blk + 208, rec + 2 * r, 2);
}

/* Q4_K (256 values a block, Q8_K activations) per 16 rows: d[16], dmin[16] (float16), the 12
   six-bit scale bytes as 12 planes of 16 (plane i byte r = row r's scales[i]), then the quants
   as 4 pairs of sub-blocks times 8 lane registers: pair p, register g, bytes 4r..4r+3 = row
   r's qs[32p + 4g..32p + 4g + 3], whose low nibbles are sub-block 2p's values 4g..4g+3 and
   high nibbles sub-block 2p + 1's. */
#define RP_K_SCALES 64
#define RP_K_QS 256
/* pack: row r's block `blk` into the record `rec`; else back (blk written, rec read). */
static void rp_k_block(uint8_t* blk, int r, uint8_t* rec, int pack) {
    for (int i = 0; i < 4; i++) {  /* d, dmin */
        uint8_t* a = rec + 32 * (i / 2) + 2 * r + i % 2;
        if (pack) *a = blk[i]; else blk[i] = *a;
    }
    for (int i = 0; i < 12; i++) {
        uint8_t* a = rec + RP_K_SCALES + 16 * i + r;
        if (pack) *a = blk[4 + i]; else blk[4 + i] = *a;
    }
    for (int p = 0; p < 4; p++)
        for (int g = 0; g < 8; g++)
            for (int t = 0; t < 4; t++) {
                uint8_t* a = rec + RP_K_QS + 512 * p + 64 * g + 4 * r + t;
                if (pack) *a = blk[16 + 32 * p + 4 * g + t];
                else blk[16 + 32 * p + 4 * g + t] = *a;
            }
}

/* One block's record in the packed layout from the 16 rows' blocks (`src` + r * row_bytes). */
static void rp_pack_block(int32_t type, int32_t bytes, const uint8_t* src, int64_t row_bytes,
                          uint8_t* dst) {
    if (type == 12 || type == 14) {  /* the blocks are only read */
        for (int r = 0; r < RP_ROWS; r++)
            (type == 12 ? rp_k_block : rp_6_block)((uint8_t*)(src + r * row_bytes), r, dst, 1);
        return;
    }
    int qoff = type == 8 ? 2 : type == 2 ? 2 : 6;  /* the quants' offset in a block */
    int lanes = type == 8 ? 8 : 4;
    uint8_t* q = dst + 2 * RP_ROWS + (type == 6 ? 64 : 0);
    if (type == 6) memset(dst + 2 * RP_ROWS, 0, 64);
    for (int r = 0; r < RP_ROWS; r++) {
        const uint8_t* blk = src + r * row_bytes;
        memcpy(dst + 2 * r, blk, 2);
        for (int g = 0; g < lanes; g++)
            for (int t = 0; t < 4; t++) {
                uint8_t v = blk[qoff + 4 * g + t];
                q[64 * g + 4 * r + t] = type == 8 ? (uint8_t)(v ^ 0x80) : v;
            }
        if (type == 6) {
            uint32_t qh = u32le(blk + 2);
            for (int g = 0; g < 8; g++)
                for (int t = 0; t < 4; t++)
                    dst[2 * RP_ROWS + 8 * g + (4 * r + t) / 8] |=
                        (uint8_t)(((qh >> (4 * g + t)) & 1u) << ((4 * r + t) % 8));
        }
    }
    (void)bytes;
}

/* Row r's block back in its GGUF form (`out`: bytes bytes) from a packed block record. */
static void rp_unpack_block(int32_t type, const uint8_t* rec, int r, uint8_t* out) {
    if (type == 12 || type == 14) {  /* the record is only read */
        (type == 12 ? rp_k_block : rp_6_block)(out, r, (uint8_t*)rec, 0);
        return;
    }
    int qoff = type == 8 ? 2 : type == 2 ? 2 : 6;
    int lanes = type == 8 ? 8 : 4;
    const uint8_t* q = rec + 2 * RP_ROWS + (type == 6 ? 64 : 0);
    memcpy(out, rec + 2 * r, 2);
    for (int g = 0; g < lanes; g++)
        for (int t = 0; t < 4; t++) {
            uint8_t v = q[64 * g + 4 * r + t];
            out[qoff + 4 * g + t] = type == 8 ? (uint8_t)(v ^ 0x80) : v;
        }
    if (type == 6) {
        uint32_t qh = 0;
        for (int g = 0; g < 8; g++)
            for (int t = 0; t < 4; t++) {
                uint32_t bit = (rec[2 * RP_ROWS + 8 * g + (4 * r + t) / 8] >> ((4 * r + t) % 8)) & 1u;
                qh |= bit << (4 * g + t);
            }
        uint8_t le[4] = {(uint8_t)qh, (uint8_t)(qh >> 8), (uint8_t)(qh >> 16), (uint8_t)(qh >> 24)};
        memcpy(out + 2, le, 4);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RP_SIMD 1
#define RP_MR 8            /* activation rows per tile: 8 accumulators + 8 weight registers */
#define RP_DEC_MAX 64      /* blocks per row decoded ahead (k <= 2048: 36 KiB of stack) */
#ifndef RP_PREFETCH_BYTES
#define RP_PREFETCH_BYTES 4096
#endif
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
   prefetch the bytes RP_PREFETCH_BYTES on). */
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
                    __builtin_prefetch(rec + p + RP_PREFETCH_BYTES, 0, 3);
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
                for (int64_t p = 0; p < rb; p += 64)                                          \
                    __builtin_prefetch(gp + b * rb + p + RP_PREFETCH_BYTES, 0, 3);            \
                rp_decode(TYPE, gp + b * rb, dec + 8 * b, decd + b);                          \
            }                                                                                 \
            dp = dec;                                                                         \
            dd = decd;                                                                        \
        }                                                                                     \
        for (int64_t i = m0; i < m1; i += RP_MR) {                                            \
            const uint8_t* a_ = act + i * arb;                                                \
            float* y_ = y + i * ldy + grp * RP_ROWS;                                          \
            const int pf = !ahead && i == m0;                                                 \
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
        if (pf)
            for (int64_t p = 0; p < rb; p += 64)
                __builtin_prefetch(rec + p + RP_PREFETCH_BYTES, 0, 3);
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
                __builtin_prefetch(rec + p + RP_PREFETCH_BYTES, 0, 3);
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
#define RP_K_MM(NAME, TILE, BYTES)                                                           \
static void NAME##_rp_mm(const uint8_t* wp, int64_t nb, const uint8_t* act, int64_t arb,      \
                         int64_t k, int64_t m0, int64_t m1, float* y, int64_t ldy,            \
                         int64_t g0, int64_t g1) {                                            \
    for (int64_t grp = g0; grp < g1; grp++) {                                                 \
        const uint8_t* gp = wp + grp * nb * RP_ROWS * (BYTES);                                \
        for (int64_t i = m0; i < m1; i += RP_K_MR) {                                          \
            const uint8_t* a_ = act + i * arb;                                                \
            float* y_ = y + i * ldy + grp * RP_ROWS;                                          \
            const int pf = i == m0;                                                           \
            switch (m1 - i < RP_K_MR ? (int)(m1 - i) : RP_K_MR) {                             \
                case 1: TILE(gp, nb, a_, arb, k, y_, ldy, 1, pf); break;                      \
                case 2: TILE(gp, nb, a_, arb, k, y_, ldy, 2, pf); break;                      \
                case 3: TILE(gp, nb, a_, arb, k, y_, ldy, 3, pf); break;                      \
                default: TILE(gp, nb, a_, arb, k, y_, ldy, RP_K_MR, pf);                      \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}
RP_K_MM(q4_k, rp_k_tile, 144) RP_K_MM(q6_k, rp_6_tile, 210)

typedef void (*rp_mm_fn)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                         int64_t, float*, int64_t, int64_t, int64_t);
static rp_mm_fn rp_kernel(int32_t type) {
    return type == 2 ? q4_0_rp_mm : type == 6 ? q5_0_rp_mm : type == 8 ? q8_0_rp_mm
         : type == 12 ? q4_k_rp_mm : type == 14 ? q6_k_rp_mm : 0;
}
#endif

#endif
