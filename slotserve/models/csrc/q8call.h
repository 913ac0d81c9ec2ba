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
 * rows are split. `threads` > 1 shares the call between the caller and helper threads
 * (q8pool.h): the rows of x are quantized in chunks (from 32 rows; fewer the caller quantizes
 * alone), then every weight's rows are cut into chunks of whole tiles (64 rows and more, a few
 * per thread, smaller for a large product) that the threads claim as they come. One thread touches no pool at all. Included by qmatmul.c only, after q8mm.h and q8repack.h. */
#ifndef SLOTSERVE_Q8CALL_H
#define SLOTSERVE_Q8CALL_H
#include "q8pool.h"

/* One weight of a call; qmatmul_lib.py's QmmSeg mirrors it field for field. */
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

/* What the chunks of one call share: chunk c of weight s covers its rows
   [(c - first[s]) * rows[s], + rows[s]), whole tiles (a multiple of 64 rows, the last
   chunk the rest). */
typedef struct {
    const qmm_seg* segs;
    const qtype_info* ts[Q8X_MAX_SEGS];
    const uint8_t* act[Q8X_MAX_SEGS];
    int64_t arb[Q8X_MAX_SEGS], rows[Q8X_MAX_SEGS], first[Q8X_MAX_SEGS + 1];
    const float* x;
    int64_t k, m, ldx, ldy;
    float* y;
    uint8_t* scratch;
    int64_t off[Q8X_KINDS];
    int nseg;
} q8x_call;

#define Q8X_QUANT_ROWS 8  /* activation rows per chunk of the quantization */
#define Q8X_CHUNKS_PER_THREAD 8
/* At most about this many multiply-adds a chunk (~0.25 ms of one core at 32 rows of x): the
   caller waits at the end for the chunks the helpers are running, so a chunk of a large
   product (Gemma 3's 262k-row output projection: 16 chunks of 3 ms each at 32 rows) is
   kept short, the more so as a helper preempted mid-chunk holds it up. */
#define Q8X_CHUNK_WORK ((int64_t)1 << 25)

static void q8x_quantize_chunk(const pool_job* job, int64_t c, int slot) {
    (void)slot;
    const q8x_call* w = (const q8x_call*)job->arg;
    int64_t i0 = c * Q8X_QUANT_ROWS, i1 = i0 + Q8X_QUANT_ROWS < w->m ? i0 + Q8X_QUANT_ROWS : w->m;
    for (int kind = 0; kind < Q8X_KINDS; kind++) {
        if (w->off[kind] < 0) continue;
        int64_t arb = act_row_bytes(kind, w->k);
        for (int64_t i = i0; i < i1; i++)
            quantize_act_row(kind, w->x + i * w->ldx, w->k, w->scratch + w->off[kind] + i * arb);
    }
}

static void q8x_multiply_chunk(const pool_job* job, int64_t c, int slot) {
    (void)slot;
    const q8x_call* w = (const q8x_call*)job->arg;
    int s = 0;
    while (c >= w->first[s + 1]) s++;
    const qmm_seg* g = w->segs + s;
    int64_t lo = (c - w->first[s]) * w->rows[s];
    int64_t hi = lo + w->rows[s] < g->n ? lo + w->rows[s] : g->n;
    if (g->packed) {
#ifdef RP_SIMD
        rp_rows(g->type, w->ts[s], g->w, w->k, w->act[s], w->arb[s], w->m, w->y + g->col, w->ldy,
                lo / RP_ROWS, hi / RP_ROWS);
#endif
    } else {
        q8_rows(g->type, w->ts[s], g->w, g->row_bytes, w->k, w->act[s], w->arb[s], w->m,
                w->y + g->col, w->ldy, lo, hi);
    }
}

/* y[:, col_s:col_s + n_s] = x @ W_s^T for every weight s of `segs` (nseg of them, k columns
   each), x [m, k] float32 (rows ldx floats apart), y rows ldy floats apart. `threads` > 1:
   the caller and threads - 1 helpers of q8pool.h share the chunks. */
int slotserve_qmatmul_q8_x(const qmm_seg* segs, int32_t nseg, int64_t k, const float* x,
        int64_t ldx, int64_t m, float* y, int64_t ldy, uint8_t* scratch, int64_t scratch_len,
        int32_t threads) {
    if (nseg < 1 || nseg > Q8X_MAX_SEGS || m < 0 || k <= 0 || (m > 1 && ldx < k))
        return QMM_BAD_SHAPE;
    q8x_call w = {.segs = segs, .x = x, .k = k, .m = m, .ldx = ldx, .ldy = ldy, .y = y,
                  .scratch = scratch, .off = {-1, -1, -1}, .nseg = nseg};
    int64_t need = 0;
    for (int s = 0; s < nseg; s++) {
        int rc = q8x_check(segs + s, k, m, ldy, w.ts + s);
        if (rc) return rc;
        int32_t kind = slotserve_q8_act_kind(segs[s].type);
        if (w.off[kind] < 0) {
            w.off[kind] = need;
            need += m * act_row_bytes(kind, k);
        }
    }
    if (scratch_len < need) return QMM_SMALL_SCRATCH;
    if (m == 0) return QMM_OK;
    int parts = threads < 1 ? 1 : threads;
    w.first[0] = 0;
    for (int s = 0; s < nseg; s++) {
        int32_t kind = slotserve_q8_act_kind(segs[s].type);
        w.act[s] = scratch + w.off[kind];
        w.arb[s] = act_row_bytes(kind, k);
        int64_t n = segs[s].n, per = (n + Q8X_CHUNKS_PER_THREAD * parts - 1)
                                     / (Q8X_CHUNKS_PER_THREAD * parts);
        int64_t by_work = Q8X_CHUNK_WORK / (k * m);
        per = per < by_work ? per : by_work;
        per = parts == 1 ? n : per;  /* one thread: one chunk per weight */
        per = (per + 63) / 64 * 64;
        w.rows[s] = per < 64 ? 64 : per;
        w.first[s + 1] = w.first[s] + (n + w.rows[s] - 1) / w.rows[s];
    }
    pool_job quant = {q8x_quantize_chunk, (m + Q8X_QUANT_ROWS - 1) / Q8X_QUANT_ROWS, 0, &w};
    pool_run(&quant, m >= 4 * Q8X_QUANT_ROWS ? parts : 1);  /* a few rows: not worth a hand-off */
    pool_job mult = {q8x_multiply_chunk, w.first[nseg], 0, &w};
    pool_run(&mult, parts);
    return QMM_OK;
}

#endif
