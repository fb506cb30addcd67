/* probe.cu: the fp32 FMA rate the benchmark's floor is computed from.
 *
 *   fma_peak  every thread runs `iters` rounds of 8 independent FMA chains of 8
 *             (64 FMAs a round: 128 FLOP), then writes one sum so nothing is
 *             optimised away. grid and block as the caller likes (many of 256). */
#include "prelude.cuh"

FM_KERNEL void fma_peak(float *out, int iters, float seed)
{
    float a[8];
    for (int i = 0; i < 8; i++) a[i] = seed + (float)(threadIdx.x + i);
    const float m = 0.999f, c = 1e-3f;
    for (int it = 0; it < iters; it++)
        for (int r = 0; r < 8; r++)
            for (int i = 0; i < 8; i++) a[i] = fm_fma(a[i], m, c);
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += a[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
