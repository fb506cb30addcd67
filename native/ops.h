/* Small elementwise ops of the forward pass (scalar C; the compiler vectorises them). */
#ifndef FM_OPS_H
#define FM_OPS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "fermoe_blocks.h"
#include "model.h"

/* e^x for the elementwise ops, branch-free so loops over it vectorise (libm's
 * expf is a call per element, a visible share of a prefill). Cody-Waite reduction
 * x = n ln2 + r, |r| <= ln2/2, then Cephes' degree-7 polynomial for e^r and 2^n
 * through the exponent bits: within 2 ulp of e^x. Inputs are clamped to
 * [-87.3, 88], where 2^n stays a normal float; e^x underflows to ~1e-38 and
 * overflows to ~1.7e38 instead of 0 and inf, which no caller can tell apart. */
static inline float fm_expf(float x) {
    x = x < 88.0f ? x : 88.0f;
    x = x > -87.3f ? x : -87.3f;
    const float shift = 12582912.0f;            /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + shift) - shift;
    float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline float fm_silu(float x) { return x / (1.0f + fm_expf(-x)); }
static inline float fm_sigmoid(float x) { return 1.0f / (1.0f + fm_expf(-x)); }
static inline float fm_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Eight running sums, added up in a fixed order at the end: the loop vectorises
 * and no add waits on the one before it. One running sum is a chain of dependent
 * adds (an add's latency per element), and a token runs 81 norms on the caller
 * between parallel regions. */
static inline float fm_dot(const float *a, const float *b, int n) {
    float s[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    float t = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* y = x / rms(x) * w (GGUF norm weights are plain multipliers). y may be x. */
static inline void fm_rmsnorm(float *y, const float *x, const float *w, int n, float eps) {
    float inv = 1.0f / sqrtf(fm_dot(x, x, n) / n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
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
