/* The decode step's int8 path in one native call: `slotserve_qmatmul_q8_x` quantizes the rows
 * of x (q8act.h) into the caller's scratch, once per activation kind its weights take, and
 * multiplies every weight of a list that shares x (a layer's q/k/v of mixed types, its fused
 * gate/up, one output projection) into its own columns of y.
 *
 * Why one call: the Python side used to quantize in one ctypes call and multiply in another,
 * once per weight, each with its argument marshalling; a step of Gemma 3 270M makes ~80 such
 * products, most of them a few microseconds of work. The list is prepared once per module
 * (native_qmatmul.QMatmulPlan), so a call passes only x, y, the scratch and the thread count.
 *
 * The results are bit for bit those of slotserve_q8_quantize then slotserve_qmatmul_q8 (or
 * _packed) per weight: the same quantizer, the same kernels, and no output depends on how the
 * rows are split. `threads` > 1 runs one OpenMP team for the whole call (one hand-off, not one
 * per weight): the rows of x are quantized in shares, then every weight's rows are split into
 * shares of whole tiles (4 rows; 16-row groups when packed), one share per thread. One thread
 * opens no team at all. Included by qmatmul.c only, after q8mm.h and q8repack.h. */
#ifndef SLOTSERVE_Q8CALL_H
#define SLOTSERVE_Q8CALL_H
#ifdef _OPENMP
#include <omp.h>
#endif

/* One weight of a call; native_qmatmul.py's _Seg mirrors it field for field. */
typedef struct {
    const uint8_t* w;   /* the blocks: GGUF layout, or slotserve_q8_repack's when `packed` */
    int64_t n;          /* rows */
    int64_t row_bytes;  /* bytes per row (the packed layout keeps the size) */
    int64_t col;        /* the first output column it writes: y[:, col:col + n] */
    int32_t type;       /* GGML type id */
    int32_t packed;
} qmm_seg;

#define Q8X_MAX_SEGS 8
#define Q8X_KINDS 3  /* ACT_Q8_0, ACT_Q8_1, ACT_Q8_K */

/* Checks one weight of the list; its type in *t. */
static int q8x_check(const qmm_seg* g, int64_t k, int64_t m, int64_t ldy,
                     const qtype_info** t) {
    *t = find_type(g->type);
    if (!*t || slotserve_q8_act_kind(g->type) < 0) return QMM_BAD_TYPE;
    if (g->packed) {
#ifdef RP_SIMD
        int rc = rp_check(g->type, g->n, k, g->row_bytes, t);
        if (rc) return rc;
#else
        return QMM_BAD_TYPE;
#endif
    }
    if (check_layout(*t, g->n, k, g->row_bytes) || g->col < 0 || (m > 1 && ldy < g->col + g->n))
        return QMM_BAD_SHAPE;
    return QMM_OK;
}

/* Bytes of scratch a call needs: m quantized rows per kind its weights take (-1: bad list). */
int64_t slotserve_q8x_scratch_bytes(const qmm_seg* segs, int32_t nseg, int64_t k, int64_t m) {
    if (nseg < 1 || nseg > Q8X_MAX_SEGS || k <= 0 || m < 0) return -1;
    int seen[Q8X_KINDS] = {0};
    int64_t need = 0;
    for (int s = 0; s < nseg; s++) {
        int32_t kind = slotserve_q8_act_kind(segs[s].type);
        if (kind < 0 || k % act_block(kind)) return -1;
        if (!seen[kind]) need += m * act_row_bytes(kind, k);
        seen[kind] = 1;
    }
    return need;
}

/* y[:, col_s:col_s + n_s] = x @ W_s^T for every weight s of `segs` (nseg of them, k columns
   each), x [m, k] float32 (rows ldx floats apart), y rows ldy floats apart. */
int slotserve_qmatmul_q8_x(const qmm_seg* segs, int32_t nseg, int64_t k, const float* x,
        int64_t ldx, int64_t m, float* y, int64_t ldy, uint8_t* scratch, int64_t scratch_len,
        int32_t threads) {
    if (nseg < 1 || nseg > Q8X_MAX_SEGS || m < 0 || k <= 0 || (m > 1 && ldx < k))
        return QMM_BAD_SHAPE;
    const qtype_info* ts[Q8X_MAX_SEGS];
    int64_t off[Q8X_KINDS] = {-1, -1, -1}, need = 0;
    for (int s = 0; s < nseg; s++) {
        int rc = q8x_check(segs + s, k, m, ldy, ts + s);
        if (rc) return rc;
        int32_t kind = slotserve_q8_act_kind(segs[s].type);
        if (off[kind] < 0) {
            off[kind] = need;
            need += m * act_row_bytes(kind, k);
        }
    }
    if (scratch_len < need) return QMM_SMALL_SCRATCH;
    if (m == 0) return QMM_OK;
#ifndef _OPENMP
    (void)threads;
#endif
#ifdef _OPENMP
    int parts = threads < 1 ? 1 : threads;
#pragma omp parallel num_threads(parts) if (parts > 1)
#endif
    {
        int part = 0, nparts = 1;
#ifdef _OPENMP
        part = omp_get_thread_num();
        nparts = omp_get_num_threads();
#endif
        for (int kind = 0; kind < Q8X_KINDS; kind++) {
            if (off[kind] < 0) continue;
            int64_t arb = act_row_bytes(kind, k);
#ifdef _OPENMP
#pragma omp for schedule(static) nowait
#endif
            for (int64_t i = 0; i < m; i++)
                quantize_act_row(kind, x + i * ldx, k, scratch + off[kind] + i * arb);
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int s = 0; s < nseg; s++) {
            const qmm_seg* g = segs + s;
            int32_t kind = slotserve_q8_act_kind(g->type);
            const uint8_t* act = scratch + off[kind];
            int64_t arb = act_row_bytes(kind, k);
            if (g->packed) {
#ifdef RP_SIMD
                int64_t groups = g->n / RP_ROWS;
                rp_rows(g->type, ts[s], g->w, k, act, arb, m, y + g->col, ldy,
                        groups * part / nparts, groups * (part + 1) / nparts);
#endif
            } else {
                int64_t lo, hi;
                q8_share(0, g->n, part, nparts, &lo, &hi);
                q8_rows(g->type, ts[s], g->w, g->row_bytes, k, act, arb, m, y + g->col, ldy,
                        lo, hi);
            }
        }
    }
    return QMM_OK;
}

#endif
