/* reduce.cuh: a block-wide sum through shared memory, behind __syncthreads at
 * every step (no warp shuffles, no implicit warp synchrony: Fermi's rules), in a
 * fixed order, so every launch sums alike. */
#ifndef FM_REDUCE_CUH
#define FM_REDUCE_CUH

#include "prelude.cuh"

#define FM_REDUCE_THREADS 1024

/* The sum of v over the block's threads, returned to every thread. blockDim.x must
 * be a power of two (and blockDim.y = z = 1); scratch holds blockDim.x floats of
 * shared memory, free again when this returns. */
FM_DEVICE float fm_block_sum(float v, float *scratch)
{
    unsigned t = threadIdx.x;
    scratch[t] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) scratch[t] += scratch[t + s];
        __syncthreads();
    }
    float total = scratch[0];
    __syncthreads();
    return total;
}

#endif /* FM_REDUCE_CUH */
