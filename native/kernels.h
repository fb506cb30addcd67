/* kernels.h: the public C API of the CPU kernels, and the per-ISA table behind it.
 *
 * Conventions for every kernel:
 *   - `n` / `cols` count elements and are a multiple of 32 (whole blocks);
 *   - a weight matrix W has rows of cols/32 blocks (or cols floats), row r
 *     starting at W + r*(cols/32); only rows [row_begin, row_end) are touched,
 *     so a thread pool can split one matrix between threads;
 *   - Q8_0 activations come from fm_quantize_row_q8_0, so their ints lie in
 *     [-127, 127] (the SIMD sign trick assumes -128 never occurs there);
 *   - batched kernels: X holds B activation rows back to back (cols/32 blocks
 *     or cols floats each), Y is row-major [B][ldy] with ldy >= row_end, and
 *     Y[b*ldy + r] = W[r] . X[b]. Each weight row is read from memory once per
 *     call whatever B is.
 * Results of different ISAs differ only by float summation order.
 */
#ifndef FERMOE_KERNELS_H
#define FERMOE_KERNELS_H

#include <stddef.h>
#include "fermoe_blocks.h"

enum { FM_ISA_SCALAR = 0, FM_ISA_SSSE3 = 1, FM_ISA_AVX2 = 2, FM_ISA_AVX512VNNI = 3, FM_ISA_COUNT = 4 };

/* ---- public API (dispatched to the selected ISA) ---- */
void fm_quantize_row_q8_0(const float *x, block_q8_0 *y, int n);
float fm_vec_dot_q4_0_q8_0(int n, const block_q4_0 *w, const block_q8_0 *x);
float fm_vec_dot_q8_0_q8_0(int n, const block_q8_0 *w, const block_q8_0 *x);

void fm_matvec_q4_0(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int row_begin, int row_end);
void fm_matvec_q8_0(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int row_begin, int row_end);
void fm_matvec_f32(const float *W, const float *x, float *y, int cols, int row_begin, int row_end);
void fm_matvec_f16(const uint16_t *W, const float *x, float *y, int cols, int row_begin, int row_end);

/* fp16 rows (the KV cache): exact to fp32; from fp32 rounded to nearest even, as numpy rounds */
void fm_fp16_to_fp32_row(const uint16_t *x, float *y, int n);
void fm_fp32_to_fp16_row(const float *x, uint16_t *y, int n);

/* Attention over a run of n positions (attention.c), for the G query heads that share
 * one KV head: rows[j] points at position j's hd K (or V) elements, fp16 when f16 is
 * set, else fp32. Each result depends on its own inputs only, in a fixed order, so a
 * position scores alike in every run of positions it falls in.
 *   scores:     s[h * lds + j] = q_h . k_j with q_h = q + h * qstride, h < G, j < n
 *   accumulate: acc[h * hd + i] += p[h * ldp + j] * v_j[i], over j = 0 .. n-1 in order */
void fm_attn_scores(const float *q, int qstride, int G, const void *const *rows, int f16, int n, int hd,
                    float *s, int lds);
void fm_attn_accumulate(const float *p, int ldp, int G, const void *const *rows, int f16, int n, int hd,
                        float *acc);

void fm_matmul_q4_0(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int row_begin, int row_end);
void fm_matmul_q8_0(const block_q8_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int row_begin, int row_end);
void fm_matmul_f32(const float *W, const float *X, float *Y, int cols, int B, int ldy, int row_begin, int row_end);

/* ---- ISA selection (dispatch.c) ---- */
int fm_init_dispatch(void);        /* apply FERMOE_ISA; 0 ok, -1 unknown name, -2 CPU lacks it,
                                    * -3 FERMOE_MAX_ISA names no ISA */
int fm_best_isa(void);             /* the best ISA this CPU and OS support (at most FERMOE_MAX_ISA) */
int fm_isa_supported(int isa);     /* 1 if this CPU and OS can run it */
int fm_set_isa(int isa);           /* returns isa, or -1 if unknown or unsupported (nothing changes) */
int fm_get_isa(void);
const char *fm_isa_name(int isa);  /* "scalar", "ssse3", "avx2", "avx512vnni"; NULL if out of range */
int fm_isa_from_name(const char *name); /* -1 if unknown */

/* How far ahead (bytes) the matrix-vector kernels prefetch the rows they stream:
 * a caller that splits a matrix between threads can warm the first FM_PF_DIST
 * bytes of a task, which the task's own prefetches skip. */
#ifndef FM_PF_DIST
#define FM_PF_DIST 8192
#endif

/* ---- the per-ISA implementations ----
 * One table per ISA, each defined in its own file (kernels_<isa>.c) from functions
 * named fm_<op>_<isa>; dispatch.c points the public API at one of them. */
typedef struct {
    void (*quantize_row_q8_0)(const float *, block_q8_0 *, int);
    float (*dot_q4_0_q8_0)(int, const block_q4_0 *, const block_q8_0 *);
    float (*dot_q8_0_q8_0)(int, const block_q8_0 *, const block_q8_0 *);
    void (*matvec_q4_0)(const block_q4_0 *, const block_q8_0 *, float *, int, int, int);
    void (*matvec_q8_0)(const block_q8_0 *, const block_q8_0 *, float *, int, int, int);
    void (*matvec_f32)(const float *, const float *, float *, int, int, int);
    void (*matvec_f16)(const uint16_t *, const float *, float *, int, int, int);
    void (*matmul_q4_0)(const block_q4_0 *, const block_q8_0 *, float *, int, int, int, int, int);
    void (*matmul_q8_0)(const block_q8_0 *, const block_q8_0 *, float *, int, int, int, int, int);
    void (*matmul_f32)(const float *, const float *, float *, int, int, int, int, int);
    void (*fp16_to_fp32_row)(const uint16_t *, float *, int);
    void (*fp32_to_fp16_row)(const float *, uint16_t *, int);
    void (*attn_scores)(const float *, int, int, const void *const *, int, int, int, float *, int);
    void (*attn_accumulate)(const float *, int, int, const void *const *, int, int, int, float *);
} fm_kernels;

extern const fm_kernels fm_kernels_scalar;      /* kernels_scalar.c */
extern const fm_kernels fm_kernels_ssse3;       /* kernels_ssse3.c */
extern const fm_kernels fm_kernels_avx2;        /* kernels_avx2.c */
extern const fm_kernels fm_kernels_avx512vnni;  /* kernels_avx512vnni.c */

#endif /* FERMOE_KERNELS_H */
