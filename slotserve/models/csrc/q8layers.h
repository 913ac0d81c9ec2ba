/* A pure decode step's decoder layers in one native call: `slotserve_decode_layers` runs, for
 * every layer in order, the same kernels with the same arguments as the Python modules do
 * (models/layers.py, gemma3.py, llama.py with `NativeOps` and int8 `QMatmulPlan`s), so the
 * hidden states are bit for bit those of the module path.
 *
 * Why: at one sequence a layer of Gemma 3 270M is ten native calls of a few to a few dozen
 * microseconds each, and the Python around them (module calls, argument checks, tensor
 * allocations, ctypes marshalling) cost about as much as the calls themselves: ~3.5 ms of a
 * 17 ms step on an AMD EPYC, the same on two threads, where it is what does not scale. Here
 * Python fills one step record per step (models/native_layers.py) and the layers run from a
 * table of per-layer records built once.
 *
 * The glue kernels (RMSNorm and its residual forms, the gated activation, q/k norm + RoPE +
 * the K/V write) live in fused_ops.c and the attention in paged_decode.c, other libraries
 * built with their own flags: they are called through the function pointers of `ql_fns`,
 * filled once from those libraries. The products are slotserve_qmatmul_q8_x (q8call.h), and
 * the attention's sequences are shared over q8pool.h's threads one at a time (each sequence
 * computed alike whatever the split, so bit for bit the Python caller's results).
 * Included by qmatmul.c only, after q8call.h. */
#ifndef SLOTSERVE_Q8LAYERS_H
#define SLOTSERVE_Q8LAYERS_H

/* The native functions the layers call; native_layers.py's _Fns mirrors it. */
typedef struct {
    void (*rms_norm)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t,
                     float);
    void (*add_rms_norm)(float*, const float*, int64_t, const float*, float*, int64_t, int64_t,
                         float);
    void (*rms_norm_add)(float*, const float*, int64_t, const float*, const float*, float*,
                         int64_t, int64_t, float);
    void (*gated_act)(const float*, int64_t, int64_t, float*, int);
    int (*qkv_rope_store)(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                          const float*, float, const float*, const float*, void*, void*,
                          int64_t, const int64_t*, int, int64_t);
    int (*paged_decode)(const float*, int64_t, const void*, const void*, int64_t,
                        const int64_t*, int64_t, const int64_t*, int64_t, float*, int64_t,
                        float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float, int64_t, int);
} ql_fns;

/* One product of a layer: a QMatmulPlan's weights. */
typedef struct {
    const qmm_seg* segs;
    int64_t nseg, k, columns, work;  /* work: multiply-adds per row of x */
} ql_mm;

enum { QL_GEMMA3 = 0, QL_LLAMA = 1 };

/* One decoder layer, built once; native_layers.py's _Layer mirrors it field for field. */
typedef struct {
    int64_t kind;  /* QL_GEMMA3: norms around attention and MLP; QL_LLAMA: pre-norms */
    const float *in_w, *post_attn_w, *pre_ff_w, *post_ff_w;  /* pre_ff/post_ff: Gemma 3 */
    const float *q_norm_w, *k_norm_w;  /* per-head q/k norms, or NULL */
    double eps, qk_eps, scale;
    ql_mm qkv, o, gate_up, down;
    int64_t nh, kvh, head_dim, inter, act;
    void *k_cache, *v_cache;
    int64_t num_blocks, block_size, row_bytes, kv_code;
    int64_t rope;    /* which tables of the step: 0 global, 1 local */
    int64_t window;  /* which applied window of the step */
} ql_layer;

#define QL_WINDOWS 4

/* One step, filled per call; native_layers.py's _Step mirrors it. Buffers are contiguous
   [m, width] float32: h the residual stream (updated in place), x [hidden], qkv [qkv
   columns], attn [nh * head_dim], o [hidden], gu [2 * inter], act [inter]. */
typedef struct {
    int64_t m, hidden, threads, min_work;
    float *h, *x, *qkv, *attn, *o, *gu, *act;
    const float *cos[2], *sin[2];
    const int64_t* slot_mapping;
    const int64_t* block_table;  /* [m, max_blocks] */
    const int64_t* ctx_lens;     /* [m] */
    int64_t max_blocks;
    int64_t windows[QL_WINDOWS];  /* applied windows (0: the whole context) */
    float* scores;               /* [score_rows, score_len] */
    int64_t score_rows, score_len;
    uint8_t* q8;                 /* the products' scratch */
    int64_t q8_len;
} ql_step;

enum { QL_OP_QKV = 1, QL_OP_ROPE = 2, QL_OP_ATTN = 3, QL_OP_O = 4, QL_OP_GATE_UP = 5,
       QL_OP_DOWN = 6 };

static int ql_mm_run(const ql_mm* p, const float* x, float* y, const ql_step* s) {
    int threads = (int)s->threads;
    if (threads > 1 && s->m * p->work < s->min_work) threads = 1;  /* as QMatmulPlan.run */
    return slotserve_qmatmul_q8_x(p->segs, (int32_t)p->nseg, p->k, x, p->k, s->m, y,
                                  p->columns, s->q8, s->q8_len, threads);
}

typedef struct {
    const ql_fns* f;
    const ql_layer* L;
    const ql_step* s;
    _Atomic int rc;
} ql_attn;

/* Chunk c is sequence c; each thread scores into its own row of the scratch (its slot). */
static void ql_attn_chunk(const pool_job* job, int64_t c, int slot) {
    ql_attn* a = (ql_attn*)job->arg;
    const ql_layer* L = a->L;
    const ql_step* s = a->s;
    int64_t qs = L->qkv.columns;
    int rc = a->f->paged_decode(
        s->qkv, qs, L->k_cache, L->v_cache, L->num_blocks, s->block_table, s->max_blocks,
        s->ctx_lens, s->windows[L->window], s->attn, L->nh * L->head_dim,
        s->scores + slot * s->score_len, s->score_len, c, c + 1, L->kvh, L->nh / L->kvh,
        L->head_dim, L->block_size, (float)L->scale, L->row_bytes, (int)L->kv_code);
    if (rc) atomic_store(&a->rc, rc);
}

/* The step's attention of one layer, one sequence a chunk, claimed as the threads come (each
   sequence is computed alike whichever thread runs it). Why not native_attention's split
   into one contiguous run of sequences per thread: a thread that starts late (preempted on a
   shared machine) then leaves its whole half to wait for, and the sequences' context
   lengths, so their costs, differ. */
static int ql_attention(const ql_fns* f, const ql_layer* L, const ql_step* s) {
    int64_t parts = s->threads < s->m ? s->threads : s->m;
    parts = parts < s->score_rows ? parts : s->score_rows;
    parts = parts < 1 ? 1 : parts;
    ql_attn a = {.f = f, .L = L, .s = s, .rc = 0};
    pool_job job = {ql_attn_chunk, s->m, 0, &a};
    pool_run(&job, (int)parts);
    return atomic_load(&a.rc);
}

/* The row-wise glue (the norms and the gated activation) over rows [r0, r1): each row's
   result is computed alike however the rows are split. */
enum { QL_GLUE_IN_NORM, QL_GLUE_ATTN_NORM, QL_GLUE_ACT, QL_GLUE_FF_NORM };

typedef struct {
    const ql_fns* f;
    const ql_layer* L;
    const ql_step* s;
    int op;
} ql_glue;

static void ql_glue_rows(const ql_glue* g, int64_t r0, int64_t r1) {
    const ql_fns* f = g->f;
    const ql_layer* L = g->L;
    const ql_step* s = g->s;
    int64_t d = s->hidden, n = r1 - r0, at = r0 * d;
    float eps = (float)L->eps;
    switch (g->op) {
    case QL_GLUE_IN_NORM:
        f->rms_norm(s->h + at, d, L->in_w, s->x + at, d, n, d, eps);
        break;
    case QL_GLUE_ATTN_NORM:
        if (L->kind == QL_GEMMA3) f->rms_norm_add(s->h + at, s->o + at, d, L->post_attn_w,
                                                  L->pre_ff_w, s->x + at, n, d, eps);
        else f->add_rms_norm(s->h + at, s->o + at, d, L->post_attn_w, s->x + at, n, d, eps);
        break;
    case QL_GLUE_ACT:
        f->gated_act(s->gu + r0 * 2 * L->inter, n, L->inter, s->act + r0 * L->inter,
                     (int)L->act);
        break;
    default:
        if (L->kind == QL_GEMMA3) {
            f->rms_norm_add(s->h + at, s->o + at, d, L->post_ff_w, NULL, NULL, n, d, eps);
        } else {
            for (int64_t i = at; i < r1 * d; i++) s->h[i] = s->h[i] + s->o[i];  /* h.add_(mlp) */
        }
    }
}

#define QL_GLUE_ROWS 4        /* rows a chunk of the glue */
#define QL_GLUE_MIN_ROWS 16   /* fewer: a few microseconds, less than a hand-off */

static void ql_glue_chunk(const pool_job* job, int64_t c, int slot) {
    (void)slot;
    const ql_glue* g = (const ql_glue*)job->arg;
    int64_t r0 = c * QL_GLUE_ROWS, r1 = r0 + QL_GLUE_ROWS < g->s->m ? r0 + QL_GLUE_ROWS : g->s->m;
    ql_glue_rows(g, r0, r1);
}

/* Why split the glue at all: at 32 rows a layer's norms and GELU are ~0.1 ms that one thread
   ran while the other waited (about 2 ms of a 2-thread step of Gemma 3 270M). */
static void ql_glue_run(const ql_fns* f, const ql_layer* L, const ql_step* s, int op) {
    ql_glue g = {.f = f, .L = L, .s = s, .op = op};
    if (s->threads < 2 || s->m < QL_GLUE_MIN_ROWS) {
        ql_glue_rows(&g, 0, s->m);
        return;
    }
    pool_job job = {ql_glue_chunk, (s->m + QL_GLUE_ROWS - 1) / QL_GLUE_ROWS, 0, &g};
    pool_run(&job, (int)s->threads);
}

static int ql_layer_run(const ql_fns* f, const ql_layer* L, const ql_step* s) {
    int64_t m = s->m;
    int rc;
    ql_glue_run(f, L, s, QL_GLUE_IN_NORM);
    if ((rc = ql_mm_run(&L->qkv, s->x, s->qkv, s))) return QL_OP_QKV << 8 | rc;
    rc = f->qkv_rope_store(s->qkv, L->qkv.columns, m, L->nh, L->kvh, L->head_dim, L->q_norm_w,
                           L->k_norm_w, (float)L->qk_eps, s->cos[L->rope], s->sin[L->rope],
                           L->k_cache, L->v_cache, L->num_blocks * L->block_size,
                           s->slot_mapping, (int)L->kv_code, L->row_bytes);
    if (rc) return QL_OP_ROPE << 8 | rc;
    if ((rc = ql_attention(f, L, s))) return QL_OP_ATTN << 8 | rc;
    if ((rc = ql_mm_run(&L->o, s->attn, s->o, s))) return QL_OP_O << 8 | rc;
    ql_glue_run(f, L, s, QL_GLUE_ATTN_NORM);
    if ((rc = ql_mm_run(&L->gate_up, s->x, s->gu, s))) return QL_OP_GATE_UP << 8 | rc;
    ql_glue_run(f, L, s, QL_GLUE_ACT);
    if ((rc = ql_mm_run(&L->down, s->act, s->o, s))) return QL_OP_DOWN << 8 | rc;
    ql_glue_run(f, L, s, QL_GLUE_FF_NORM);
    return 0;
}

/* Layers [0, n) of `layers` over one step. 0, or (layer + 1) << 16 | op << 8 | the kernel's
   own code: which call failed, and why. */
int slotserve_decode_layers(const ql_fns* f, const ql_layer* layers, int64_t n,
                            const ql_step* s) {
    if (s->m < 1) return 0;
    for (int64_t i = 0; i < n; i++) {
        int rc = ql_layer_run(f, layers + i, s);
        if (rc) return (int)((i + 1) << 16) | rc;
    }
    return 0;
}

#endif
