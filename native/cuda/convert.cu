/* convert.cu: fp32 <-> fp16 bits, rounded to nearest even (fermoe_blocks.h's integer
 * conversions: fp16 is storage only). The attention KV handed to a state kept in f16
 * crosses PCIe and lands in its pages at half the bytes, with nothing left to convert.
 *   to_f16  dst[i] = fp16(src[i]), i < n   (grid ceil(n / 256), block 256) */
#include "prelude.cuh"
#include "../fermoe_blocks.h"

FM_KERNEL void to_f16(uint16_t *dst, const float *src, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = fm_fp32_to_fp16(src[i]);
}

/*   from_f16  dst[i] = fp32(src[i]), i < n: a spilled attention layer's K and V coming back
 *             from the state's fp16 pages into the device's fp32 slot (exact: every fp16
 *             value is an fp32 one).  (grid ceil(n / 256), block 256) */
FM_KERNEL void from_f16(float *dst, const uint16_t *src, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = fm_fp16_to_fp32(src[i]);
}
