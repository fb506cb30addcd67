/* kernels_scalar.c: the plain C reference (`_scalar`) of every kernel.
 * The SIMD versions are tested against these, and these against the numpy spec.
 * Portable C only: no intrinsics, no F16C (fp16 goes through fermoe_blocks.h).
 * The functions not static here are borrowed by the SIMD tables (x86.h).
 */
#include <math.h>
#include <string.h>
#include "kernels.h"

/* ---------------------------------------------------------------- quantise */

/* One Q8_0 block, with the arithmetic of shared.quants._q_q8_0 (and ggml):
 * d = amax/127 in fp32, ints = roundf(x * (1/d)), d stored as fp16. */
static void quantize_block_q8_0(const float *x, block_q8_0 *y)
{
    float amax = 0.0f;
    for (int j = 0; j < FM_QK; j++) {
        float v = fabsf(x[j]);
        if (v > amax || v != v) amax = v;  /* a NaN sticks, as in numpy's max */
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    /* inf/NaN inputs or a 1/d overflow give non-finite products: the spec makes them 0. */
    const int bad = !isfinite(d) || isinf(id);
    for (int j = 0; j < FM_QK; j++) {
        float v = x[j] * id;
        y->qs[j] = (bad && !isfinite(v)) ? 0 : (int8_t)roundf(v);
    }
    y->d = fm_fp32_to_fp16(d);
}

void fm_quantize_row_q8_0_scalar(const float *x, block_q8_0 *y, int n)
{
    for (int b = 0; b < n / FM_QK; b++) quantize_block_q8_0(x + b * FM_QK, y + b);
}

/* ---------------------------------------------------------------- dot products */

static float fm_vec_dot_q4_0_q8_0_scalar(int n, const block_q4_0 *w, const block_q8_0 *x)
{
    float sum = 0.0f;
    for (int b = 0; b < n / FM_QK; b++) {
        int sumi = 0;
        for (int j = 0; j < FM_QK / 2; j++) {
            int lo = (w[b].qs[j] & 0x0F) - 8, hi = (w[b].qs[j] >> 4) - 8;
            sumi += lo * x[b].qs[j] + hi * x[b].qs[j + FM_QK / 2];
        }
        sum += (float)sumi * (fm_fp16_to_fp32(w[b].d) * fm_fp16_to_fp32(x[b].d));
    }
    return sum;
}

static float fm_vec_dot_q8_0_q8_0_scalar(int n, const block_q8_0 *w, const block_q8_0 *x)
{
    float sum = 0.0f;
    for (int b = 0; b < n / FM_QK; b++) {
        int sumi = 0;
        for (int j = 0; j < FM_QK; j++) sumi += w[b].qs[j] * x[b].qs[j];
        sum += (float)sumi * (fm_fp16_to_fp32(w[b].d) * fm_fp16_to_fp32(x[b].d));
    }
    return sum;
}

static float dot_f32(int n, const float *w, const float *x)
{
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += w[j] * x[j];
    return sum;
}

static float dot_f16(int n, const uint16_t *w, const float *x)
{
    float sum = 0.0f;
    for (int j = 0; j < n; j++) sum += fm_fp16_to_fp32(w[j]) * x[j];
    return sum;
}

/* ---------------------------------------------------------------- matrix-vector */

static void fm_matvec_q4_0_scalar(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++) y[r] = fm_vec_dot_q4_0_q8_0_scalar(cols, W + (size_t)r * nb, x);
}

static void fm_matvec_q8_0_scalar(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++) y[r] = fm_vec_dot_q8_0_q8_0_scalar(cols, W + (size_t)r * nb, x);
}

static void fm_matvec_f32_scalar(const float *W, const float *x, float *y, int cols, int r0, int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f32(cols, W + (size_t)r * cols, x);
}

void fm_matvec_f16_scalar(const uint16_t *W, const float *x, float *y, int cols, int r0, int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f16(cols, W + (size_t)r * cols, x);
}

/* ---------------------------------------------------------------- fp16 rows (the KV cache) */

void fm_fp16_to_fp32_row_scalar(const uint16_t *x, float *y, int n)
{
    for (int i = 0; i < n; i++) y[i] = fm_fp16_to_fp32(x[i]);
}

void fm_fp32_to_fp16_row_scalar(const float *x, uint16_t *y, int n)
{
    for (int i = 0; i < n; i++) y[i] = fm_fp32_to_fp16(x[i]);
}

/* ---------------------------------------------------------------- attention (fm_attn_*)
 * q . k with 8 running sums in a fixed order: a generic vector, two SSE registers on
 * any x86-64, and still fast enough for the CPUs without AVX2. */
typedef float v8f __attribute__((vector_size(32)));

static float dot8(const float *q, const float *k, int n)
{
    v8f s = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f a, b;
        memcpy(&a, q + i, sizeof a);
        memcpy(&b, k + i, sizeof b);
        s += a * b;
    }
    for (; i < n; i++) s[0] += q[i] * k[i];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

static const float *attn_row(const void *row, int f16, float *buf, int hd)
{
    if (!f16) return row;
    fm_fp16_to_fp32_row_scalar(row, buf, hd);
    return buf;
}

void fm_attn_scores_scalar(const float *q, int qstride, int G, const void *const *rows, int f16, int n, int hd,
                            float *s, int lds)
{
    float buf[hd];
    for (int j = 0; j < n; j++) {
        const float *k = attn_row(rows[j], f16, buf, hd);
        for (int h = 0; h < G; h++) s[(size_t)h * lds + j] = dot8(q + (size_t)h * qstride, k, hd);
    }
}

void fm_attn_accumulate_scalar(const float *p, int ldp, int G, const void *const *rows, int f16, int n, int hd,
                                float *acc)
{
    float buf[hd];
    for (int j = 0; j < n; j++) {
        const float *v = attn_row(rows[j], f16, buf, hd);
        for (int h = 0; h < G; h++) {
            const float w = p[(size_t)h * ldp + j];
            float *a = acc + (size_t)h * hd;
            for (int i = 0; i < hd; i++) a[i] += w * v[i];
        }
    }
}

/* ---------------------------------------------------------------- batched
 * Row outer, batch inner: the row (a few KB) stays in L1 while the B
 * activations stream past it, so memory sees each weight once. */

static void fm_matmul_q4_0_scalar(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0,
                                  int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = fm_vec_dot_q4_0_q8_0_scalar(cols, W + (size_t)r * nb, X + (size_t)b * nb);
}

static void fm_matmul_q8_0_scalar(const block_q8_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0,
                                  int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = fm_vec_dot_q8_0_q8_0_scalar(cols, W + (size_t)r * nb, X + (size_t)b * nb);
}

static void fm_matmul_f32_scalar(const float *W, const float *X, float *Y, int cols, int B, int ldy, int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = dot_f32(cols, W + (size_t)r * cols, X + (size_t)b * cols);
}

const fm_kernels fm_kernels_scalar = {
    .quantize_row_q8_0 = fm_quantize_row_q8_0_scalar,
    .dot_q4_0_q8_0 = fm_vec_dot_q4_0_q8_0_scalar,
    .dot_q8_0_q8_0 = fm_vec_dot_q8_0_q8_0_scalar,
    .matvec_q4_0 = fm_matvec_q4_0_scalar,
    .matvec_q8_0 = fm_matvec_q8_0_scalar,
    .matvec_f32 = fm_matvec_f32_scalar,
    .matvec_f16 = fm_matvec_f16_scalar,
    .matmul_q4_0 = fm_matmul_q4_0_scalar,
    .matmul_q8_0 = fm_matmul_q8_0_scalar,
    .matmul_f32 = fm_matmul_f32_scalar,
    .fp16_to_fp32_row = fm_fp16_to_fp32_row_scalar,
    .fp32_to_fp16_row = fm_fp32_to_fp16_row_scalar,
    .attn_scores = fm_attn_scores_scalar,
    .attn_accumulate = fm_attn_accumulate_scalar,
};
