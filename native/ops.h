/* Small elementwise ops of the forward pass (scalar C; the compiler vectorises them). */
#ifndef FM_OPS_H
#define FM_OPS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "fermoe_blocks.h"
#include "model.h"

static inline float fm_silu(float x) { return x / (1.0f + expf(-x)); }
static inline float fm_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float fm_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* y = x / rms(x) * w (GGUF norm weights are plain multipliers). y may be x. */
static inline void fm_rmsnorm(float *y, const float *x, const float *w, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static inline float fm_dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One row of a weight matrix as floats (embedding lookup). */
static inline void fm_dequant_row(const fm_tensor *t, int row, float *out) {
    int n = t->cols;
    if (t->type == FM_F32) {
        const float *src = (const float *)t->data + (int64_t)row * n;
        for (int i = 0; i < n; i++) out[i] = src[i];
    } else if (t->type == FM_Q8_0) {
        const block_q8_0 *b = (const block_q8_0 *)t->data + (int64_t)row * (n / 32);
        for (int i = 0; i < n / 32; i++) {
            float d = fm_fp16_to_fp32(b[i].d);
            for (int j = 0; j < 32; j++) out[i * 32 + j] = d * b[i].qs[j];
        }
    } else {
        const block_q4_0 *b = (const block_q4_0 *)t->data + (int64_t)row * (n / 32);
        for (int i = 0; i < n / 32; i++) {
            float d = fm_fp16_to_fp32(b[i].d);
            for (int j = 0; j < 16; j++) {
                out[i * 32 + j] = d * ((b[i].qs[j] & 0x0F) - 8);
                out[i * 32 + j + 16] = d * ((b[i].qs[j] >> 4) - 8);
            }
        }
    }
}

#endif
