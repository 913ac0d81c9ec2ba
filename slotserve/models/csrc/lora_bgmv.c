/* Batched LoRA (punica's bgmv, shrink then expand) for float32 on the CPU.
 *
 * For every row t of the batch whose adapter slot s = slot_of[t] is >= 0, and every shard k
 * of the wrapped projection (q/k/v of a fused qkv, gate/up, or one module):
 *     y[t, cols[k]:cols[k+1]] += Bt[s, k]^T @ (A[s, k] @ x[t])
 * at the slot's own rank ranks[s, k] (0: the adapter skips that shard), never the padded
 * max_rank R. Rows of the base model (slot -1) are skipped. B comes pre-scaled by the
 * module's alpha / r (lora/adapters.py), so the scale is part of Bt.
 *
 * Layout (lora/native_bgmv.py fills it): A transposed, [slots, shards, in, RP] with RP = R
 * rounded up to the 16 lanes of a vector (a shard's ranks, then zeros to its vector's end:
 * lanes past the rank are computed, never padding vectors up to R); Bt [slots, R * out],
 * shard k at offset R * cols[k] as [rank, width] rows (width = cols[k+1] - cols[k]): B
 * transposed, so the expand runs along contiguous output columns.
 *
 * Consecutive rows of one slot (the runner orders rows by slot) go in chunks of up to CH:
 * first every shard's shrink, in blocks of up to RB rows (each A row read once per block;
 * a block's x rows stay in L1 for all the shards: the q/k/v shrinks share them), then the
 * expand, 64 output columns at a time for every block of the chunk (the tile's Bt rows
 * read from L1 after the first block).
 */
#include <stdint.h>
#include "simd.h"

#define RB 4
/* Rows of one slot taken together: their shrinks first, then the expand tile by tile. */
#define CH 32

static inline v16 load16(const float *p) { return *(const v16 *)p; }
static inline void store16(float *p, v16 v) { *(v16 *)p = v; }

/* t[i * ld + j] = A row j . x row i for j < r (and 0 up to the vector's end), nb rows, A
 * given transposed: at [n, rp], rank lanes contiguous. One FMA covers 16 ranks of one row
 * (no horizontal sums); x's columns alternate between two accumulators per row, so a block
 * keeps 2 * nb independent FMA chains in flight. */
static inline __attribute__((always_inline)) void shrink(
        const float *const *xr, const float *at, int64_t n, int64_t r, int64_t rp, float *t,
        int64_t ld, const int nb) {
    for (int64_t v = 0; v * 16 < r; v++) {
        const float *a = at + 16 * v;
        v16 acc0[RB], acc1[RB];
        for (int i = 0; i < nb; i++) acc0[i] = acc1[i] = (v16){0};
        int64_t c = 0;
        for (; c + 2 <= n; c += 2) {
            v16 a0 = load16(a + c * rp), a1 = load16(a + (c + 1) * rp);
            for (int i = 0; i < nb; i++) {
                acc0[i] += xr[i][c] * a0;
                acc1[i] += xr[i][c + 1] * a1;
            }
        }
        if (c < n) {
            v16 a0 = load16(a + c * rp);
            for (int i = 0; i < nb; i++) acc0[i] += xr[i][c] * a0;
        }
        for (int i = 0; i < nb; i++) store16(t + i * ld + 16 * v, acc0[i] + acc1[i]);
    }
}

/* y row i [c0 + cb, c0 + ce) += sum_j t[i * ld + j] * b[j * w + ...] for nb rows, rank r:
 * columns [cb, ce) of a shard of width w starting at y's column c0. */
static inline __attribute__((always_inline)) void expand(
        float *const *y_rows, int64_t c0, const float *b, int64_t w, int64_t cb, int64_t ce,
        int64_t r, const float *t, int64_t ld, const int nb) {
    float *yr[RB];
    for (int i = 0; i < nb; i++) yr[i] = y_rows[i] + c0;
    int64_t c = cb;
    for (; c + 64 <= ce; c += 64) {  /* a 64-column tile: RB x 4 accumulators in registers */
        v16 acc[RB][4];
        for (int i = 0; i < nb; i++)
            for (int v = 0; v < 4; v++) acc[i][v] = load16(yr[i] + c + 16 * v);
        for (int64_t j = 0; j < r; j++) {
            const float *bj = b + j * w + c;
            v16 bv[4];
            for (int v = 0; v < 4; v++) bv[v] = load16(bj + 16 * v);
            for (int i = 0; i < nb; i++) {
                float tij = t[i * ld + j];
                for (int v = 0; v < 4; v++) acc[i][v] += tij * bv[v];
            }
        }
        for (int i = 0; i < nb; i++)
            for (int v = 0; v < 4; v++) store16(yr[i] + c + 16 * v, acc[i][v]);
    }
    for (; c + 16 <= ce; c += 16) {
        v16 acc[RB];
        for (int i = 0; i < nb; i++) acc[i] = load16(yr[i] + c);
        for (int64_t j = 0; j < r; j++) {
            v16 bv = load16(b + j * w + c);
            for (int i = 0; i < nb; i++) acc[i] += t[i * ld + j] * bv;
        }
        for (int i = 0; i < nb; i++) store16(yr[i] + c, acc[i]);
    }
    for (; c < ce; c++)
        for (int i = 0; i < nb; i++) {
            float s = yr[i][c];
            for (int64_t j = 0; j < r; j++) s += t[i * ld + j] * b[j * w + c];
            yr[i][c] = s;
        }
}

/* The rows [0, nb) of a block (constant nb: the accumulators stay in registers). */
#define BY_BLOCK_SIZE(nb, call) do { switch (nb) { \
    case 4: call(4); break; case 3: call(3); break; case 2: call(2); break; \
    default: call(1); break; } } while (0)

/* x [n, n_in] (row stride xs), y [n, cols[shards]] (row stride ys), slot_of [n]; a, bt,
 * ranks [slots, shards] as above. Returns 0, or 1 + the first row whose slot is out of
 * range (nothing of that row or after it applied). */
int64_t slotserve_lora_bgmv(const float *x, int64_t xs, float *y, int64_t ys, int64_t n,
                            const int64_t *slot_of, const float *a, const float *bt,
                            const int32_t *ranks, const int64_t *cols, int64_t shards,
                            int64_t R, int64_t n_in, int64_t n_slots) {
    int64_t out = cols[shards], rp = (R + 15) / 16 * 16, ld = shards * rp;
    float t[CH * shards * rp];
    const float *xr[CH];
    float *yr[CH];
    int64_t t0 = 0;
    while (t0 < n) {
        int64_t s = slot_of[t0];
        if (s < 0) { t0++; continue; }
        if (s >= n_slots) return t0 + 1;
        int64_t t1 = t0 + 1;
        while (t1 < n && t1 - t0 < CH && slot_of[t1] == s) t1++;
        int64_t m = t1 - t0;  /* a chunk of rows of one slot */
        for (int64_t i = 0; i < m; i++) {
            xr[i] = x + (t0 + i) * xs;
            yr[i] = y + (t0 + i) * ys;
        }
        const float *as = a + s * shards * n_in * rp;
        const float *bs = bt + s * R * out;
        const int32_t *rs = ranks + s * shards;
        for (int64_t k = 0; k < shards; k++) {
            int64_t r = rs[k];
            if (r == 0) continue;
            for (int64_t i = 0; i < m; i += RB) {
#define SHRINK(nb) shrink(xr + i, as + k * n_in * rp, n_in, r, rp, t + i * ld + k * rp, ld, nb)
                BY_BLOCK_SIZE(m - i < RB ? m - i : RB, SHRINK);
#undef SHRINK
            }
        }
        /* The expand walks the output in 64-column tiles, each tile's [r, 64] of Bt read
         * from L1 for every block of the chunk. */
        for (int64_t k = 0; k < shards; k++) {
            int64_t r = rs[k], w = cols[k + 1] - cols[k];
            if (r == 0) continue;
            for (int64_t cb = 0; cb < w; cb += 64) {
                int64_t ce = cb + 64 < w ? cb + 64 : w;
                for (int64_t i = 0; i < m; i += RB) {
#define EXPAND(nb) expand(yr + i, cols[k], bs + R * cols[k], w, cb, ce, r, \
                          t + i * ld + k * rp, ld, nb)
                    BY_BLOCK_SIZE(m - i < RB ? m - i : RB, EXPAND);
#undef EXPAND
                }
            }
        }
        t0 = t1;
    }
    return 0;
}
