/* The elementwise glue of one decoder layer for the CPU in float32, fused so that a decode
 * step pays one call per piece instead of a chain of torch operators (see
 * slotserve/models/native_fused.py for why, how it is built and called, and the torch
 * reference each function must equal):
 *
 *  - RMSNorm of rows, alone, after adding a residual (Llama: h += x; out = norm(h)) or added
 *    to a residual (Gemma 3: h += norm(x); optionally out = norm2(h));
 *  - the gated activation of the MLP (SiLU or tanh-GELU gate times up);
 *  - the attention glue: per-head q/k RMSNorm, RoPE in place, and the new K/V rows written
 *    into the paged cache in its storage type (float32, bfloat16, float16, or int8 rows:
 *    q8_0 blocks of 32 values along the head, their float16 scales after the D bytes);
 *  - the step's rows of the RoPE tables, in the (c, c) / (-s, s) form the RoPE above takes.
 *
 * The arithmetic is the torch formula's, operation for operation (built with
 * -ffp-contract=off: no fused multiply-adds the torch kernels would not do), except that the
 * RMSNorm sum of squares is accumulated in double: the reductions can differ in the last bit
 * from torch's, nothing else.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef USE_MVEC
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) float tanhf(float);
#endif

enum { SLOTSERVE_OK = 0, SLOTSERVE_BAD_SLOT = 2 };
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_INT8 = 3 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

static inline float inv_rms(const float* x, int64_t d, float eps) {
    double ss = 0.0;
#pragma omp simd reduction(+:ss)
    for (int64_t i = 0; i < d; i++) ss += (double)x[i] * (double)x[i];
    return 1.0f / sqrtf((float)(ss / (double)d) + eps);
}

/* out = (x * inv_rms(x)) * w, one row of d; out may be x. */
static inline void norm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
    float r = inv_rms(x, d, eps);
#pragma omp simd
    for (int64_t i = 0; i < d; i++) out[i] = (x[i] * r) * w[i];
}

/* out[t] = norm(x[t]) * w for t < rows (row strides in floats). */
void slotserve_rms_norm(const float* x, int64_t x_stride, const float* w, float* out,
                        int64_t out_stride, int64_t rows, int64_t d, float eps) {
    for (int64_t t = 0; t < rows; t++) norm_row(x + t * x_stride, w, out + t * out_stride, d, eps);
}

/* Llama's order: h[t] += x[t]; out[t] = norm(h[t]) * w. h and out contiguous [rows, d]. */
void slotserve_add_rms_norm(float* h, const float* x, int64_t x_stride, const float* w,
                            float* out, int64_t rows, int64_t d, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        float* hr = h + t * d;
        const float* xr = x + t * x_stride;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) hr[i] = hr[i] + xr[i];
        norm_row(hr, w, out + t * d, d, eps);
    }
}

/* Gemma 3's order: h[t] += norm(x[t]) * w; then, when w2 is given, out[t] = norm(h[t]) * w2.
   h (and out) contiguous [rows, d]. */
void slotserve_rms_norm_add(float* h, const float* x, int64_t x_stride, const float* w,
                            const float* w2, float* out, int64_t rows, int64_t d, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        float* hr = h + t * d;
        const float* xr = x + t * x_stride;
        float r = inv_rms(xr, d, eps);
#pragma omp simd
        for (int64_t i = 0; i < d; i++) hr[i] = hr[i] + (xr[i] * r) * w[i];
        if (w2) norm_row(hr, w2, out + t * d, d, eps);
    }
}

/* out[t, i] = act(gu[t, i]) * gu[t, inter + i]; gu [rows, 2 * inter], out [rows, inter]. */
void slotserve_gated_act(const float* gu, int64_t rows, int64_t inter, float* out, int act) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;  /* sqrt(2 / pi) */
    for (int64_t t = 0; t < rows; t++) {
        const float* g = gu + t * 2 * inter;
        const float* u = g + inter;
        float* o = out + t * inter;
        if (act == ACT_GELU_TANH) {
#pragma omp simd
            for (int64_t i = 0; i < inter; i++) {
                float x = g[i];
                float inner = beta * (x + kappa * (x * x * x));
                o[i] = (0.5f * x * (1.0f + tanhf(inner))) * u[i];
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < inter; i++) {
                float x = g[i];
                o[i] = (x / (1.0f + expf(-x))) * u[i];
            }
        }
    }
}

/* x * cos + roll(x, d / 2) * sin in place; sin holds (-s, s) (models/layers.py apply_rope). */
static inline void rope_row(float* x, const float* cos, const float* sin, int64_t d) {
    float tmp[d];
    int64_t half = d / 2;
    memcpy(tmp, x, sizeof(float) * (size_t)d);
#pragma omp simd
    for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
#pragma omp simd
    for (int64_t i = half; i < d; i++) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, NaN kept a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One head row of d floats into the cache row at `dst` in the cache's storage type. */
static void store_row(const float* x, void* dst, int64_t d, int kv_dtype) {
    if (kv_dtype == KV_F32) {
        memcpy(dst, x, sizeof(float) * (size_t)d);
    } else if (kv_dtype == KV_BF16) {
        uint16_t* o = dst;
        for (int64_t i = 0; i < d; i++) o[i] = to_bf16(x[i]);
    } else if (kv_dtype == KV_F16) {
        _Float16* o = dst;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = (_Float16)x[i];
    } else {  /* int8, llama.cpp's q8_0 along the row: blocks of 32 values (or the whole row
                 when d is no multiple of 32), each round(x / scale) with scale = absmax / 127;
                 the float16 scales follow the d values */
        int8_t* o = dst;
        int64_t qk = d % 32 == 0 ? 32 : d;
        for (int64_t b0 = 0; b0 < d; b0 += qk) {
            float amax = 0.0f;
#pragma omp simd reduction(max:amax)
            for (int64_t i = b0; i < b0 + qk; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
#pragma omp simd
            for (int64_t i = b0; i < b0 + qk; i++) o[i] = (int8_t)nearbyintf(x[i] * inv);
            _Float16 s16 = (_Float16)scale;
            memcpy(o + d + 2 * (b0 / qk), &s16, sizeof s16);
        }
    }
}

/* The attention glue of one layer. qkv [rows, (nh + 2 * kvh) * d] (rows qkv_stride floats
   apart): q heads, k heads, v heads. q and k heads are normed (when qw / kw are given) and
   rotated in place with cos / sin [rows, d]; then k and v rows go to the caches at
   slot_mapping[t] (a flat index block * block_size + offset < num_slots), each cache row
   [kvh, row_bytes]. Every slot is checked before anything is written. */
int slotserve_qkv_rope_store(float* qkv, int64_t qkv_stride, int64_t rows, int64_t nh,
                             int64_t kvh, int64_t d, const float* qw, const float* kw,
                             float eps, const float* cos, const float* sin, void* k_cache,
                             void* v_cache, int64_t num_slots, const int64_t* slot_mapping,
                             int kv_dtype, int64_t row_bytes) {
    for (int64_t t = 0; t < rows; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return SLOTSERVE_BAD_SLOT;
    for (int64_t t = 0; t < rows; t++) {
        float* row = qkv + t * qkv_stride;
        const float* c = cos + t * d;
        const float* s = sin + t * d;
        for (int64_t h = 0; h < nh + kvh; h++) {
            float* x = row + h * d;
            const float* w = h < nh ? qw : kw;
            if (w) norm_row(x, w, x, d, eps);
            rope_row(x, c, s, d);
        }
        int64_t slot = slot_mapping[t];
        for (int64_t j = 0; j < kvh; j++) {
            int64_t at = (slot * kvh + j) * row_bytes;
            store_row(row + (nh + j) * d, (char*)k_cache + at, d, kv_dtype);
            store_row(row + (nh + kvh + j) * d, (char*)v_cache + at, d, kv_dtype);
        }
    }
    return SLOTSERVE_OK;
}

/* outc[t] = (c, c) and outs[t] = (-s, s) for c, s the rows pos[t] of the half tables cos, sin
   [max_pos, half] (models/fused.py: TorchOps.rope_rows, four torch operators per table:
   after the output projection has streamed its weights each costs tens of microseconds of
   its own code coming back into the caches). A position outside the tables: SLOTSERVE_BAD_SLOT,
   nothing written past the rows before it. */
int slotserve_rope_rows(const float* cos, const float* sin, int64_t half, int64_t max_pos,
                        const int64_t* pos, int64_t rows, float* outc, float* outs) {
    for (int64_t t = 0; t < rows; t++) {
        int64_t p = pos[t];
        if (p < 0 || p >= max_pos) return SLOTSERVE_BAD_SLOT;
        const float *c = cos + p * half, *s = sin + p * half;
        float *oc = outc + t * 2 * half, *os = outs + t * 2 * half;
        for (int64_t i = 0; i < half; i++) {
            oc[i] = c[i];
            oc[half + i] = c[i];
            os[i] = -s[i];
            os[half + i] = s[i];
        }
    }
    return SLOTSERVE_OK;
}
