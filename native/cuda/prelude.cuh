/* prelude.cuh: what every kernel source of this folder is compiled with, on the
 * three toolchains that build them (gpu_worker/cuda_source.py puts it first):
 *
 *   nvcc (pycuda, the real GPU)   CUDA's own qualifiers and no include directive
 *                                 (pycuda's disk cache then hashes the source itself)
 *   clang-14, sm_20 PTX           the Fermi check (no CUDA headers: qualifiers,
 *                                 atomics and the fast math are spelled here)
 *   g++, FM_EMULATE               the host emulation: emulate.h runs each block's
 *                                 threads as fibers that switch at __syncthreads
 *
 * The kernels keep to the Fermi (sm_20) feature set: fp32 arithmetic and FMA,
 * 32-bit integer and fp32-add atomics, at most 48 KB of static shared memory and
 * 1024 threads a block, every exchange through shared memory behind
 * __syncthreads (no warp shuffles or votes, no implicit warp synchrony). fp16 is
 * storage only, decoded with integer operations (fermoe_blocks.h).
 *
 * Math goes through fm_* names so each toolchain maps it to what it has:
 * fm_expf / fm_log2f are the hardware approximations on the GPU (ex2.approx,
 * lg2.approx: ~2 ulp), fm_rsqrtf rsqrt.approx; fm_sqrtf and division round
 * correctly. */
#ifndef FM_PRELUDE_CUH
#define FM_PRELUDE_CUH

#if defined(FM_EMULATE)
#include "emulate.h"
#define FM_DEVICE static inline
#define fm_fma(a, b, c) ((a) * (b) + (c))
#define fm_expf(x) expf(x)
#define fm_log2f(x) log2f(x)
#define fm_sqrtf(x) sqrtf(x)
#define fm_rsqrtf(x) (1.0f / sqrtf(x))

#elif defined(__clang__) && defined(__CUDA__) && !defined(__NVCC__)
#include <__clang_cuda_builtin_vars.h>
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __forceinline__ __attribute__((always_inline))
#define __restrict__ __restrict
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#define FM_DEVICE static __device__ __forceinline__
#define fm_fma(a, b, c) __nvvm_fma_rn_f((a), (b), (c))
#define fm_expf(x) __nvvm_ex2_approx_f((x) * 1.4426950408889634f)
#define fm_log2f(x) __nvvm_lg2_approx_f(x)
#define fm_sqrtf(x) __nvvm_sqrt_rn_f(x)
#define fm_rsqrtf(x) __nvvm_rsqrt_approx_f(x)
#define fabsf(x) __builtin_fabsf(x)
#define fmaxf(a, b) __builtin_fmaxf((a), (b))
#define fminf(a, b) __builtin_fminf((a), (b))
FM_DEVICE int atomicAdd(int *p, int v) { return __nvvm_atom_add_gen_i(p, v); }
FM_DEVICE float atomicAdd(float *p, float v) { return __nvvm_atom_add_gen_f(p, v); }

#else /* nvcc */
#define FM_DEVICE static __device__ __forceinline__
#define fm_fma(a, b, c) __fmaf_rn((a), (b), (c))
#define fm_expf(x) __expf(x)
#define fm_log2f(x) __log2f(x)
#define fm_sqrtf(x) __fsqrt_rn(x)
#define fm_rsqrtf(x) rsqrtf(x)
#endif

#if !defined(FM_EMULATE)
/* <stdint.h>'s types as glibc defines them on LP64 (a typedef may be repeated in
 * C++: nvcc's implicit headers define some of them already) */
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef short int16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long uint64_t;
typedef long int64_t;
#endif

#define FM_KERNEL extern "C" __global__

/* Occupancy a kernel asks for: threads a block, blocks an SM (caps its registers) */
#if defined(FM_EMULATE)
#define FM_BOUNDS(threads, blocks)
#else
#define FM_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#endif

/* 16-byte aligned shared arrays and a four-float load (128-bit where the GPU has it) */
#define FM_ALIGN16 __attribute__((aligned(16)))
typedef struct FM_ALIGN16 {
    float x, y, z, w;
} fm_f4;

#define FM_LN2 0.6931471805599453f

FM_DEVICE float fm_neg_inf(void)
{
    union { unsigned u; float f; } b;
    b.u = 0xff800000u;
    return b.f;
}

FM_DEVICE int fm_mini(int a, int b) { return a < b ? a : b; }

FM_DEVICE float fm_sigmoidf(float x) { return 1.0f / (1.0f + fm_expf(-x)); }
FM_DEVICE float fm_siluf(float x) { return x / (1.0f + fm_expf(-x)); }

/* log(1 + e^x) without overflow: max(x, 0) + log(1 + e^-|x|). */
FM_DEVICE float fm_softplusf(float x)
{
    float e = fm_expf(-fabsf(x));
    return fmaxf(x, 0.0f) + fm_log2f(1.0f + e) * FM_LN2;
}

#endif /* FM_PRELUDE_CUH */
