/* fermoe_blocks.h: the ggml block layouts we compute with, shared by the C
 * kernels and the CUDA ones. Plain C: no host-only headers, so nvcc can
 * include it too. Layouts are byte-exact with llama.cpp (ggml-common.h) and with
 * the numpy spec in shared/quants.py:
 *
 *   block_q4_0  18 B | d fp16 | qs[16]: lo nibble = elem j, hi nibble = elem j+16 |
 *               x = (q - 8) * d
 *   block_q8_0  34 B | d fp16 | qs[32] int8 |  x = q * d
 *
 * Blocks are packed back to back (18 and 34 are not multiples of 4), so the
 * fp16 scale is read as a uint16_t at 2-byte alignment. The CUDA kernels
 * (native/cuda) include it under nvcc and clang (__CUDA__) alike.
 */
#ifndef FERMOE_BLOCKS_H
#define FERMOE_BLOCKS_H

#include <stdint.h>

#define FM_QK 32 /* elements per Q4_0 / Q8_0 block */

typedef struct {
    uint16_t d;           /* fp16 scale */
    uint8_t qs[FM_QK / 2];  /* nibbles: element j low, element j+16 high */
} block_q4_0;

typedef struct {
    uint16_t d;           /* fp16 scale */
    int8_t qs[FM_QK];
} block_q8_0;

#ifdef __cplusplus
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes");
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes");
#else
_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes");
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes");
#endif

#if defined(__CUDACC__) || defined(__CUDA__)
#define FM_HD static __host__ __device__ __forceinline__
#else
#define FM_HD static inline
#endif

/* Bit casts through a union: defined in C, accepted by nvcc. */
typedef union { float f; uint32_t u; } fm_f32_bits;

/* IEEE half -> float, exact for every input (subnormals, inf, NaN payloads). */
FM_HD float fm_fp16_to_fp32(uint16_t h)
{
    fm_f32_bits r;
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    if (em >= 0x7c00u) {                 /* inf / NaN: keep the payload */
        r.u = 0x7f800000u | ((em & 0x3ffu) << 13);
    } else if (em >= 0x0400u) {          /* normal: rebias the exponent 15 -> 127 */
        r.u = (em << 13) + 0x38000000u;
    } else {                             /* zero / subnormal: em * 2^-24 is exact */
        r.f = (float)em * 5.9604644775390625e-8f;
    }
    r.u |= sign;
    return r.f;
}

/* float -> IEEE half, round to nearest even; NaN stays NaN (numpy's rules, so
 * stored scales match shared.quants bit for bit). */
FM_HD uint16_t fm_fp32_to_fp16(float f)
{
    fm_f32_bits v;
    v.f = f;
    uint16_t sign = (uint16_t)((v.u >> 16) & 0x8000u);
    uint32_t ax = v.u & 0x7fffffffu;
    if (ax >= 0x7f800000u) {             /* inf / NaN */
        uint16_t r = (uint16_t)(0x7c00u + ((ax & 0x7fffffu) >> 13));
        if (ax > 0x7f800000u && r == 0x7c00u) r++;  /* a NaN must not become inf */
        return sign | r;
    }
    if (ax >= 0x47800000u) return sign | 0x7c00u;  /* >= 2^16: overflow */
    if (ax >= 0x38800000u) {             /* normal half (>= 2^-14) */
        uint32_t h = (ax - 0x38000000u) >> 13;
        uint32_t rem = ax & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;  /* may carry to inf: correct */
        return sign | (uint16_t)h;
    }
    if (ax <= 0x33000000u) return sign; /* <= 2^-25 rounds to (signed) zero */
    {                                    /* subnormal half: value / 2^-24, rounded */
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - (ax >> 23);  /* 14..24 */
        uint32_t h = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return sign | (uint16_t)h;
    }
}

#endif /* FERMOE_BLOCKS_H */
