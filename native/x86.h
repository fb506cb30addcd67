/* x86.h: what every x86 kernel file shares (kernels_ssse3.c, kernels_avx2.c,
 * kernels_avx512vnni.c). Each function carries the target attribute of its
 * instruction set, so the files build without -m flags and one .so runs
 * everywhere; dispatch.c only picks a table the CPU supports. */
#ifndef FERMOE_X86_H
#define FERMOE_X86_H

#include <immintrin.h>
#include "kernels.h"

/* One target attribute per ISA, named as FERMOE_ISA names it. */
#define FM_SSSE3 __attribute__((target("ssse3")))
#define FM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FM_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

#define FM_INLINE static inline __attribute__((always_inline))

/* Activation blocks the matrix-vector products prepare per pass (on the stack: 8192
 * columns, ~10 KB). */
#define CHUNK_BLOCKS 256

/* An empty asm that pins a vector in a register at this point: without it GCC
 * reassociates the sums of a group into a tree, hoists all the products and
 * spills them. FM_KEEP_V: the same for any of AVX-512's 32 vector registers. */
#define FM_KEEP(v) __asm__("" : "+x"(v))
#define FM_KEEP_V(v) __asm__("" : "+v"(v))

/* Software prefetch for the matrix-vector loops: the hardware prefetcher alone
 * leaves a core's reads well below the machine's bandwidth once the loop also
 * computes, so a row stream asks for the 3 lines FM_PF_DIST bytes ahead of where
 * it reads (past the row's end that is the next rows: a matrix is contiguous).
 * Prefetches never fault, not even past the end of the matrix. */
FM_INLINE void fm_prefetch(const void *p)
{
    const char *a = (const char *)p + FM_PF_DIST;
    __builtin_prefetch(a, 0, 3);
    __builtin_prefetch(a + 64, 0, 3);
    __builtin_prefetch(a + 128, 0, 3);
}

/* Bytes of the tiled product's unpacked weight tile (on the stack): it stays in L1
 * next to two tokens' activations (tiled_matmul_template.h). */
#define FM_TILE_BYTES 18432

/* The tiled products' prepared activations: per thread, grown on demand, freed
 * when the thread exits; NULL if out of memory (kernel_scratch.c). */
void *fm_kernel_scratch(size_t n);

/* The few-token product (group_matvec_template.h) takes 2 to FM_FEW_TOKENS tokens,
 * on rows of FM_FEW_MIN_COLS or more: shorter rows stay tiled, which on an expert's
 * down projection is as fast or faster. */
#define FM_FEW_TOKENS 4
#define FM_FEW_MIN_COLS 1024

/* The last step of a matrix-vector product over groups of gb blocks: rows with no
 * whole group are the tail alone; the tail blocks are added last, as the batched
 * product adds them, and rows without a tail make no call. */
FM_INLINE void matvec_tail_q4_0(float (*dot)(int, const block_q4_0 *, const block_q8_0 *), const block_q4_0 *W,
                                const block_q8_0 *x, float *y, int cols, int gb, int r0, int r1)
{
    const int nb = cols / FM_QK, ng = nb / gb, nt = nb - gb * ng;
    for (int r = r0; r < r1; r++) {
        if (!ng) y[r] = 0.0f;
        if (nt) y[r] += dot(nt * FM_QK, W + (size_t)r * nb + gb * ng, x + gb * ng);
    }
}

FM_INLINE void matvec_tail_q8_0(float (*dot)(int, const block_q8_0 *, const block_q8_0 *), const block_q8_0 *W,
                                const block_q8_0 *x, float *y, int cols, int gb, int r0, int r1)
{
    const int nb = cols / FM_QK, ng = nb / gb, nt = nb - gb * ng;
    for (int r = r0; r < r1; r++) {
        if (!ng) y[r] = 0.0f;
        if (nt) y[r] += dot(nt * FM_QK, W + (size_t)r * nb + gb * ng, x + gb * ng);
    }
}

/* Kernels a SIMD table borrows from a lower ISA: the scalar ones where an ISA has
 * no faster version (kernels_scalar.c), AVX2's float kernels for AVX-512
 * (kernels_avx2.c). */
void fm_quantize_row_q8_0_scalar(const float *x, block_q8_0 *y, int n);
void fm_matvec_f16_scalar(const uint16_t *W, const float *x, float *y, int cols, int r0, int r1);
void fm_fp16_to_fp32_row_scalar(const uint16_t *x, float *y, int n);
void fm_fp32_to_fp16_row_scalar(const float *x, uint16_t *y, int n);
void fm_attn_scores_scalar(const float *q, int qstride, int G, const void *const *rows, int f16, int n, int hd,
                           float *s, int lds);
void fm_attn_accumulate_scalar(const float *p, int ldp, int G, const void *const *rows, int f16, int n, int hd,
                               float *acc);
void fm_quantize_row_q8_0_avx2(const float *x, block_q8_0 *y, int n);
void fm_fp16_to_fp32_row_avx2(const uint16_t *x, float *y, int n);
void fm_fp32_to_fp16_row_avx2(const float *x, uint16_t *y, int n);
void fm_attn_scores_avx2(const float *q, int qstride, int G, const void *const *rows, int f16, int n, int hd,
                         float *s, int lds);
void fm_attn_accumulate_avx2(const float *p, int ldp, int G, const void *const *rows, int f16, int n, int hd,
                             float *acc);

/* Token pasting for the names a template makes (FM_CAT(name, _rows)). */
#define FM_CAT_(a, b) a##b
#define FM_CAT(a, b) FM_CAT_(a, b)

#endif
