/* norm.cu: RMSNorm of rows (GGUF norm weights are plain multipliers).
 *
 *   rmsnorm        y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w        x [rows, n] (row stride ldx),
 *                                                                    y [rows, n] (ldy), w [n]
 *   rmsnorm_gated  y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w * silu(z[r])
 *                  (the Gated DeltaNet output: a row is one head's dv values; x, y, z [rows, n])
 *
 * grid: rows; block: 256 threads (a power of two: fm_block_sum). y may be x. */
#include "prelude.cuh"
#include "reduce.cuh"

#define FM_NORM_THREADS 256

FM_DEVICE float fm_row_inv_rms(const float *x, int n, float eps, float *scratch)
{
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss = fm_fma(x[i], x[i], ss);
    float total = fm_block_sum(ss, scratch);
    return 1.0f / fm_sqrtf(total / (float)n + eps);
}

FM_KERNEL void rmsnorm(float *y, const float *x, const float *w, int rows, int n, int ldy, int ldx, float eps)
{
    __shared__ float scratch[FM_NORM_THREADS];
    const float *xr = x + (long long)blockIdx.x * ldx;
    float *yr = y + (long long)blockIdx.x * ldy;
    float inv = fm_row_inv_rms(xr, n, eps, scratch);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

FM_KERNEL void rmsnorm_gated(float *y, const float *x, const float *z, const float *w, int rows, int n, float eps)
{
    __shared__ float scratch[FM_NORM_THREADS];
    long long off = (long long)blockIdx.x * n;
    float inv = fm_row_inv_rms(x + off, n, eps, scratch);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[off + i] = x[off + i] * inv * w[i] * fm_siluf(z[off + i]);
}
