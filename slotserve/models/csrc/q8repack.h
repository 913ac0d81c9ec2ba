/* Q4_0, Q5_0, Q8_0, Q4_K and Q6_K weights repacked at load into groups of R interleaved rows,
 * for the int8-activation kernels: R = 16 with AVX-512 VNNI (q8repack512.h: one 512-bit
 * register holds 4 bytes of each of 16 rows), R = 8 with AVX2, with or without AVX-VNNI
 * (q8repack256.h: one 256-bit register, 8 rows). One weight load then feeds every row of a
 * group, with no horizontal sum, and a group stays in L1 while every activation row of the
 * call runs against it.
 *
 * The layout is what ggml's CPU "repack" does for the same reason (block_q4_0x8 and kin: the
 * scales of several rows' blocks first, then their quants interleaved a few bytes at a time),
 * here with 4 bytes, the width of one vpdpbusd / vpmaddubsw+vpmaddwd lane. Per group of rows
 * R g..R g + R - 1 and per block b (32 values), one record of R * block-bytes bytes (so the
 * packed matrix has exactly the original's size):
 *
 *   R float16 scales d, row 0 first;
 *   Q5_0 only: the 32R high bits: R = 16, 8 masks of 64 bits, mask g bit 4r + t = high bit
 *     of value 4g + t of row r (a mask register each); R = 8, 32 bytes, byte 4r + t bit g =
 *     that same bit (one shift and one and bring register g's to bit 4);
 *   the quants as "lanes": lane register g (4R bytes), bytes 4r..4r+3 = row r's quant bytes
 *     4g..4g+3 (Q8_0: 8 registers, the int8 values xor `q8_xor`: + 128 where the kernel's dot
 *     takes unsigned weights, as they are where it takes |w| and sign(a, w); Q4_0 / Q5_0:
 *     4 registers of packed nibbles, whose low nibbles are values 4g..4g+3 and high nibbles
 *     values 16 + 4g..16 + 4g + 3).
 *
 * The repack and its inverse are plain C with R a parameter (every build; the tests round-trip
 * them); the multiply exists where AVX-512 VNNI + BW or AVX2 + FMA + F16C are on (RP_SIMD).
 * Included by qmatmul.c only. */
#ifndef SLOTSERVE_Q8REPACK_H
#define SLOTSERVE_Q8REPACK_H

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RP_ROWS 16
#define RP_Q8_XOR 0x80
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RP_ROWS 8
#ifdef __AVXVNNI__
#define RP_Q8_XOR 0x80
#else
#define RP_Q8_XOR 0x00  /* vpmaddubsw would saturate on w + 128: |w| and sign(a, w) instead */
#endif
#else
#define RP_ROWS 16      /* no kernel: the layout only (slotserve_q8_repack_rows says 0) */
#define RP_Q8_XOR 0x80
#endif

#ifndef Q8_0_NEGSUM  /* q8act.h's -sum(q) per block of a Q8_0 row */
#define Q8_0_NEGSUM(act, k, nb) ((const int32_t*)((act) + (k)) + (nb))
#endif

static inline int rp_type_ok(int32_t type) {
    return type == 2 || type == 6 || type == 8 || type == 12 || type == 14;
}

/* Q6_K (256 six-bit values v = q + 32 a block, scales per 16) per R rows: d[R] (float16),
   the 16 int8 scales as 16 planes of R (plane g byte r = row r's scales[g]), the low nibbles
   of 8 chunks of 32 values as 4 pairs times 8 lane registers (pair p, register g, byte 4r + t:
   v[64p + 4g + t] & 15 | (v[64p + 32 + 4g + t] & 15) << 4), then their top two bits as 2
   quads times 8 registers (quad h, register g, byte 4r + t: bits 2j..2j+1 = v[128h + 32j +
   4g + t] >> 4). */
#define RP_6_SCALES_AT(R) (2 * (R))
#define RP_6_LO_AT(R) (18 * (R))
#define RP_6_HI_AT(R) (146 * (R))
static void rp_6_block(uint8_t* blk, int r, uint8_t* rec, int pack, int R) {
    uint8_t v[256];
    const int lo_at = RP_6_LO_AT(R), hi_at = RP_6_HI_AT(R), reg = 4 * R;
    if (pack) {
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) {
                    int lo = (blk[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0f;
                    int hi = (blk[128 + 32 * h + l] >> (2 * s)) & 3;
                    v[128 * h + 32 * s + l] = (uint8_t)(lo | hi << 4);
                }
        memcpy(rec + 2 * r, blk + 208, 2);
        for (int g = 0; g < 16; g++) rec[RP_6_SCALES_AT(R) + R * g + r] = blk[192 + g];
        for (int i = 0; i < 256; i++) {
            int c = i / 32, o = i % 32;
            uint8_t* lo = rec + lo_at + 8 * reg * (c / 2) + reg * (o / 4) + 4 * r + o % 4;
            uint8_t* hi = rec + hi_at + 8 * reg * (c / 4) + reg * (o / 4) + 4 * r + o % 4;
            if (c % 2 == 0) *lo = 0;
            if (c % 4 == 0) *hi = 0;
            *lo |= (uint8_t)((v[i] & 15) << (4 * (c % 2)));
            *hi |= (uint8_t)((v[i] >> 4) << (2 * (c % 4)));
        }
        return;
    }
    for (int i = 0; i < 256; i++) {
        int c = i / 32, o = i % 32;
        uint8_t lo = rec[lo_at + 8 * reg * (c / 2) + reg * (o / 4) + 4 * r + o % 4];
        uint8_t hi = rec[hi_at + 8 * reg * (c / 4) + reg * (o / 4) + 4 * r + o % 4];
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
    for (int g = 0; g < 16; g++) blk[192 + g] = rec[RP_6_SCALES_AT(R) + R * g + r];
    memcpy(blk + 208, rec + 2 * r, 2);
}

/* Q4_K (256 values a block, Q8_K activations) per R rows: d[R], dmin[R] (float16), the 12
   six-bit scale bytes as 12 planes of R (plane i byte r = row r's scales[i]), then the quants
   as 4 pairs of sub-blocks times 8 lane registers: pair p, register g, bytes 4r..4r+3 = row
   r's qs[32p + 4g..32p + 4g + 3], whose low nibbles are sub-block 2p's values 4g..4g+3 and
   high nibbles sub-block 2p + 1's. */
#define RP_K_SCALES_AT(R) (4 * (R))
#define RP_K_QS_AT(R) (16 * (R))
/* pack: row r's block `blk` into the record `rec`; else back (blk written, rec read). */
static void rp_k_block(uint8_t* blk, int r, uint8_t* rec, int pack, int R) {
    for (int i = 0; i < 4; i++) {  /* d, dmin */
        uint8_t* a = rec + 2 * R * (i / 2) + 2 * r + i % 2;
        if (pack) *a = blk[i]; else blk[i] = *a;
    }
    for (int i = 0; i < 12; i++) {
        uint8_t* a = rec + RP_K_SCALES_AT(R) + R * i + r;
        if (pack) *a = blk[4 + i]; else blk[4 + i] = *a;
    }
    for (int p = 0; p < 4; p++)
        for (int g = 0; g < 8; g++)
            for (int t = 0; t < 4; t++) {
                uint8_t* a = rec + RP_K_QS_AT(R) + 32 * R * p + 4 * R * g + 4 * r + t;
                if (pack) *a = blk[16 + 32 * p + 4 * g + t];
                else blk[16 + 32 * p + 4 * g + t] = *a;
            }
}

/* One block's record in the packed layout from the R rows' blocks (`src` + r * row_bytes). */
static void rp_pack_block(int32_t type, const uint8_t* src, int64_t row_bytes, uint8_t* dst,
                          int R, uint8_t q8_xor) {
    if (type == 12 || type == 14) {  /* the blocks are only read */
        for (int r = 0; r < R; r++)
            (type == 12 ? rp_k_block : rp_6_block)((uint8_t*)(src + r * row_bytes), r, dst, 1,
                                                   R);
        return;
    }
    int qoff = type == 8 ? 2 : type == 2 ? 2 : 6;  /* the quants' offset in a block */
    int lanes = type == 8 ? 8 : 4;
    uint8_t* q = dst + 2 * R + (type == 6 ? 4 * R : 0);
    if (type == 6) memset(dst + 2 * R, 0, 4 * (size_t)R);
    for (int r = 0; r < R; r++) {
        const uint8_t* blk = src + r * row_bytes;
        memcpy(dst + 2 * r, blk, 2);
        for (int g = 0; g < lanes; g++)
            for (int t = 0; t < 4; t++) {
                uint8_t v = blk[qoff + 4 * g + t];
                q[4 * R * g + 4 * r + t] = type == 8 ? (uint8_t)(v ^ q8_xor) : v;
            }
        if (type == 6) {
            uint32_t qh = u32le(blk + 2);
            for (int g = 0; g < 8; g++)
                for (int t = 0; t < 4; t++) {
                    uint8_t bit = (uint8_t)((qh >> (4 * g + t)) & 1u);
                    if (R == 8) dst[2 * R + 4 * r + t] |= (uint8_t)(bit << g);
                    else dst[2 * R + R / 2 * g + (4 * r + t) / 8] |= (uint8_t)(bit << ((4 * r + t) % 8));
                }
        }
    }
}

/* Row r's block back in its GGUF form (`out`: the type's block bytes) from a packed record. */
static void rp_unpack_block(int32_t type, const uint8_t* rec, int r, uint8_t* out, int R,
                            uint8_t q8_xor) {
    if (type == 12 || type == 14) {  /* the record is only read */
        (type == 12 ? rp_k_block : rp_6_block)(out, r, (uint8_t*)rec, 0, R);
        return;
    }
    int qoff = type == 8 ? 2 : type == 2 ? 2 : 6;
    int lanes = type == 8 ? 8 : 4;
    const uint8_t* q = rec + 2 * R + (type == 6 ? 4 * R : 0);
    memcpy(out, rec + 2 * r, 2);
    for (int g = 0; g < lanes; g++)
        for (int t = 0; t < 4; t++) {
            uint8_t v = q[4 * R * g + 4 * r + t];
            out[qoff + 4 * g + t] = type == 8 ? (uint8_t)(v ^ q8_xor) : v;
        }
    if (type == 6) {
        uint32_t qh = 0;
        for (int g = 0; g < 8; g++)
            for (int t = 0; t < 4; t++) {
                uint32_t bit = R == 8 ? (rec[2 * R + 4 * r + t] >> g) & 1u
                             : (rec[2 * R + R / 2 * g + (4 * r + t) / 8] >> ((4 * r + t) % 8)) & 1u;
                qh |= bit << (4 * g + t);
            }
        uint8_t le[4] = {(uint8_t)qh, (uint8_t)(qh >> 8), (uint8_t)(qh >> 16), (uint8_t)(qh >> 24)};
        memcpy(out + 2, le, 4);
    }
}

/* The offsets of this build's layout, for its kernel. */
#define RP_6_SCALES RP_6_SCALES_AT(RP_ROWS)
#define RP_6_LO RP_6_LO_AT(RP_ROWS)
#define RP_6_HI RP_6_HI_AT(RP_ROWS)
#define RP_K_SCALES RP_K_SCALES_AT(RP_ROWS)
#define RP_K_QS RP_K_QS_AT(RP_ROWS)

/* A kernel header's driver: groups [g0, g1) against activation rows [m0, m1), MR at a time
   (TILE takes 1..3 or MR rows); the first tile of a group prefetches the bytes
   q8_prefetch on where the CPU gains from it (qmatmul.c: the weight streams from DRAM once
   per step; BYTES under 144, a Q4_0 / Q5_0 / Q8_0 block, is a light type). */
#define RP_GROUPS_MM(NAME, TILE, BYTES, MR)                                                  \
static void NAME##_rp_mm(const uint8_t* wp, int64_t nb, const uint8_t* act, int64_t arb,      \
                         int64_t k, int64_t m0, int64_t m1, float* y, int64_t ldy,            \
                         int64_t g0, int64_t g1) {                                            \
    for (int64_t grp = g0; grp < g1; grp++) {                                                 \
        const uint8_t* gp = wp + grp * nb * RP_ROWS * (BYTES);                                \
        for (int64_t i = m0; i < m1; i += (MR)) {                                             \
            const uint8_t* a_ = act + i * arb;                                                \
            float* y_ = y + i * ldy + grp * RP_ROWS;                                          \
            const int pf = i == m0 && q8_prefetching(m0, m1, (BYTES) < 144);                  \
            switch (m1 - i < (MR) ? (int)(m1 - i) : (MR)) {                                   \
                case 1: TILE(gp, nb, a_, arb, k, y_, ldy, 1, pf); break;                      \
                case 2: TILE(gp, nb, a_, arb, k, y_, ldy, 2, pf); break;                      \
                case 3: TILE(gp, nb, a_, arb, k, y_, ldy, 3, pf); break;                      \
                default: TILE(gp, nb, a_, arb, k, y_, ldy, (MR), pf);                         \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "q8repack512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "q8repack256.h"
#endif

#ifdef RP_SIMD
typedef void (*rp_mm_fn)(const uint8_t*, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                         int64_t, float*, int64_t, int64_t, int64_t);
static rp_mm_fn rp_kernel(int32_t type) {
    return type == 2 ? q4_0_rp_mm : type == 6 ? q5_0_rp_mm : type == 8 ? q8_0_rp_mm
         : type == 12 ? q4_k_rp_mm : type == 14 ? q6_k_rp_mm : 0;
}
#endif

#endif
