/* kernels_scalar.c: the plain C reference (`_generic`) of every kernel.
 * The SIMD versions are tested against these, and these against the numpy spec.
 * Portable C only: no intrinsics, no F16C (fp16 goes through fermoe_blocks.h).
 */
#include <math.h>
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

void fm_quantize_row_q8_0_generic(const float *x, block_q8_0 *y, int n)
{
    for (int b = 0; b < n / FM_QK; b++) quantize_block_q8_0(x + b * FM_QK, y + b);
}

/* ---------------------------------------------------------------- dot products */

float fm_vec_dot_q4_0_q8_0_generic(int n, const block_q4_0 *w, const block_q8_0 *x)
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

float fm_vec_dot_q8_0_q8_0_generic(int n, const block_q8_0 *w, const block_q8_0 *x)
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

void fm_matvec_q4_0_generic(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++) y[r] = fm_vec_dot_q4_0_q8_0_generic(cols, W + (size_t)r * nb, x);
}

void fm_matvec_q8_0_generic(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++) y[r] = fm_vec_dot_q8_0_q8_0_generic(cols, W + (size_t)r * nb, x);
}

void fm_matvec_f32_generic(const float *W, const float *x, float *y, int cols, int r0, int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f32(cols, W + (size_t)r * cols, x);
}

void fm_matvec_f16_generic(const uint16_t *W, const float *x, float *y, int cols, int r0, int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f16(cols, W + (size_t)r * cols, x);
}

/* ---------------------------------------------------------------- batched
 * Row outer, batch inner: the row (a few KB) stays in L1 while the B
 * activations stream past it, so memory sees each weight once. */

void fm_matmul_q4_0_generic(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = fm_vec_dot_q4_0_q8_0_generic(cols, W + (size_t)r * nb, X + (size_t)b * nb);
}

void fm_matmul_q8_0_generic(const block_q8_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = fm_vec_dot_q8_0_q8_0_generic(cols, W + (size_t)r * nb, X + (size_t)b * nb);
}

void fm_matmul_f32_generic(const float *W, const float *X, float *Y, int cols, int B, int ldy, int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = dot_f32(cols, W + (size_t)r * cols, X + (size_t)b * cols);
}
