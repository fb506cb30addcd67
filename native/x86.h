/* x86.h: what every x86 kernel file shares. Each function carries the target
 * attribute of its instruction set, so the files build without -m flags and one .so
 * runs everywhere; dispatch.c only calls a version the CPU supports. */
#ifndef FERMOE_X86_H
#define FERMOE_X86_H

#include <immintrin.h>

#define FM_SSSE3 __attribute__((target("ssse3")))
#define FM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FM_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))        /* the float kernels */
#define FM_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define FM_INLINE static inline __attribute__((always_inline))

/* Activation blocks the matrix-vector products prepare per pass (on the stack: 8192
 * columns, ~10 KB). */
#define CHUNK_BLOCKS 256

/* An empty asm that pins a vector in a register at this point: without it GCC
 * reassociates the sums of a group into a tree, hoists all the products and
 * spills them. */
#define FM_KEEP(v) __asm__("" : "+x"(v))

#endif
