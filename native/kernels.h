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

/* ---- memory bandwidth probe (membench.c), for bench/kernels.py ---- */
uint64_t fm_read_sum(const void *buf, size_t nbytes); /* sums the 64-bit words of the first nbytes & ~127 bytes */
/* The same sum, the loop asking for each line FM_PF_DIST bytes ahead as the
 * matrix-vector kernels do (fm_prefetch): what their software prefetch costs a
 * plain stream, which without it runs on the hardware prefetchers alone. */
uint64_t fm_read_sum_prefetched(const void *buf, size_t nbytes);

/* ---- the per-ISA implementations ---- */
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

/* Software prefetch for the matrix-vector loops: the hardware prefetcher alone
 * leaves a core's reads well below the machine's bandwidth once the loop also
 * computes, so a row stream asks for the 3 lines FM_PF_DIST bytes ahead of where
 * it reads (past the row's end that is the next rows: a matrix is contiguous).
 * Prefetches never fault, not even past the end of the matrix. */
#ifndef FM_PF_DIST
#define FM_PF_DIST 8192
#endif
static inline __attribute__((always_inline)) void fm_prefetch(const void *p)
{
    const char *a = (const char *)p + FM_PF_DIST;
    __builtin_prefetch(a, 0, 3);
    __builtin_prefetch(a + 64, 0, 3);
    __builtin_prefetch(a + 128, 0, 3);
}

/* ---- internal to the kernel files: the batched (tiled) driver ----
 * fm_matmul_* (SSSE3, AVX2, AVX-512 VNNI; Q4_0 and Q8_0 weights) is a small GEMM
 * in a "transposed" block layout: a group of GB blocks (4 with 128-bit vectors, 8
 * with 256-bit, 16 with 512-bit) becomes 8 vectors, vector m holding 4
 * consecutive bytes of each of the GB blocks, one block per 32-bit lane.
 * Weights and activations are laid out alike, so one vpmaddubsw/vpdpbusd
 * multiplies 4 elements of every block at once and the products of all 8
 * vectors land in the same lanes: they are summed there (int16 or int32) before
 * one conversion and one scaling per group, instead of one reduction per block.
 * The driver prepares the B activations once per call (PREP, into per-thread
 * scratch), unpacks a tile of rows x up to KC groups of weights once (UNPACK, on
 * the stack, FM_TILE_BYTES: it stays in L1 next to two tokens' activations) and
 * runs KERNEL(w, wstride, x, xstride, nk, Y, ldy, accumulate, R, T) over it for
 * every token, RB rows x 2 tokens at a time (then 2 and 1 row, 1 token), so each
 * loaded vector feeds several products. Blocks past the last whole group go
 * through the per-block DOT; B = 1 goes to MATVEC. */
#define FM_TILE_BYTES 18432
void *fm_kernel_scratch(size_t n);  /* kernels_ssse3.c: per-thread, grown on demand, NULL if out of memory */

#define FM_TILE_ROWS(KERNEL, RB, T, nk0)                                                                    \
    do {                                                                                                    \
        for (; i + (RB) <= nr; i += (RB)) KERNEL(tile + i * nk0, nk0, xb, ng, nk0, yb + i, ldy, k0 > 0, (RB), T); \
        if ((RB) > 2 && i + 2 <= nr) {                                                                      \
            KERNEL(tile + i * nk0, nk0, xb, ng, nk0, yb + i, ldy, k0 > 0, 2, T);                            \
            i += 2;                                                                                         \
        }                                                                                                   \
        if (i < nr) KERNEL(tile + i * nk0, nk0, xb, ng, nk0, yb + i, ldy, k0 > 0, 1, T);                    \
    } while (0)

#define FM_TILED_MATMUL(NAME, WTYPE, WT, XT, GB, KC, RB, PREP, UNPACK, KERNEL, DOT, MATVEC, ATTR)           \
ATTR void NAME(const WTYPE *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1)     \
{                                                                                                            \
    _Static_assert((RB) * (KC) * sizeof(WT) <= FM_TILE_BYTES, "a tile must hold RB rows");                  \
    const int nb = cols / FM_QK, ng = nb / (GB), nt = nb - (GB) * ng;                                        \
    if (r0 >= r1 || B <= 0) return;                                                                          \
    if (B == 1) {  /* one token: the matrix-vector product is faster (no unpacking) */                      \
        MATVEC(W, X, Y, cols, r0, r1);                                                                       \
        return;                                                                                              \
    }                                                                                                        \
    XT *g = ng ? (XT *)fm_kernel_scratch((size_t)B * ng * sizeof(XT)) : NULL;                                \
    if (!g) {  /* under one group, or out of memory: the per-block path is still right */                   \
        for (int r = r0; r < r1; r++)                                                                        \
            for (int b = 0; b < B; b++)                                                                      \
                Y[(size_t)b * ldy + r] = DOT(cols, W + (size_t)r * nb, X + (size_t)b * nb);                  \
        return;                                                                                              \
    }                                                                                                        \
    for (int b = 0; b < B; b++) PREP(X + (size_t)b * nb, ng, g + (size_t)b * ng);                            \
    const int kc = ng < (KC) ? ng : (KC);                                                                    \
    int rt_rows = (int)(FM_TILE_BYTES / (kc * sizeof(WT))) / (RB) * (RB);                                    \
    if (rt_rows > 64) rt_rows = 64;                                                                          \
    _Alignas(64) WT tile[FM_TILE_BYTES / sizeof(WT)];                                                        \
    for (int rt = r0; rt < r1; rt += rt_rows) {                                                              \
        const int nr = r1 - rt < rt_rows ? r1 - rt : rt_rows;                                                \
        for (int k0 = 0; k0 < ng; k0 += kc) {                                                                \
            const int nk = ng - k0 < kc ? ng - k0 : kc;                                                      \
            for (int i = 0; i < nr; i++) {                                                                   \
                const WTYPE *w = W + (size_t)(rt + i) * nb + (GB) * k0;                                      \
                for (int k = 0; k < nk; k++) {                                                               \
                    for (size_t o = 0; o < (GB) * sizeof(WTYPE); o += 192)  /* 3 lines a call */            \
                        fm_prefetch((const char *)(w + (GB) * k) + o);                                       \
                    UNPACK(w + (GB) * k, &tile[i * nk + k]);                                                 \
                }                                                                                            \
            }                                                                                                \
            for (int b = 0; b < B; b += 2) {                                                                 \
                const XT *xb = g + (size_t)b * ng + k0;                                                      \
                float *yb = Y + (size_t)b * ldy + rt;                                                        \
                int i = 0;                                                                                   \
                if (b + 1 < B) FM_TILE_ROWS(KERNEL, RB, 2, nk);                                              \
                else FM_TILE_ROWS(KERNEL, RB, 1, nk);                                                        \
            }                                                                                                \
        }                                                                                                    \
        for (int i = 0; nt && i < nr; i++)                                                                   \
            for (int b = 0; b < B; b++)                                                                      \
                Y[(size_t)b * ldy + rt + i] += DOT(nt * FM_QK, W + (size_t)(rt + i) * nb + (GB) * ng,        \
                                                   X + (size_t)b * nb + (GB) * ng);                          \
    }                                                                                                        \
}

/* The last step of both matvec macros below: rows with no whole group are the tail
 * alone; the tail blocks are added last, as the batched product adds them. */
#define FM_MATVEC_TAIL(GB, DOT)                                                                          \
    for (int r = r0; r < r1; r++) {                                                                      \
        if (!ng) y[r] = 0.0f;                                                                            \
        if (nt) y[r] += DOT(nt * FM_QK, W + (size_t)r * nb + (GB) * ng, x + (GB) * ng);                  \
    }

/* A matrix-vector product that is the tiled GEMM above at one row and one token:
 * each row's groups are unpacked as the GEMM unpacks them (KC at a time, its
 * k-chunk) and summed by the same KERNEL, then the tail blocks by DOT, so every
 * row rounds exactly as in the batched product and a prompt gives the same bits
 * whole, chunked or token by token (serving relies on it). ISAs whose matvec is
 * specialised for speed (Q4_0 on every SIMD ISA) keep that same summation order
 * by hand, and the tests hold every ISA to it. */
#define FM_KERNEL_MATVEC(NAME, WTYPE, WT, XT, GB, KC, PREP, UNPACK, KERNEL, DOT, ATTR)                    \
ATTR void NAME(const WTYPE *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)                 \
{                                                                                                        \
    const int nb = cols / FM_QK, ng = nb / (GB), nt = nb - (GB) * ng;                                    \
    _Alignas(64) XT g[KC];                                                                               \
    _Alignas(64) WT tile[KC];                                                                            \
    for (int k0 = 0; k0 < ng; k0 += (KC)) {                                                              \
        const int nk = ng - k0 < (KC) ? ng - k0 : (KC);                                                  \
        PREP(x + (GB) * k0, nk, g);                                                                      \
        for (int r = r0; r < r1; r++) {                                                                  \
            const WTYPE *w = W + (size_t)r * nb + (GB) * k0;                                             \
            for (int k = 0; k < nk; k++) {                                                               \
                for (size_t o = 0; o < (GB) * sizeof(WTYPE); o += 192)                                   \
                    fm_prefetch((const char *)(w + (GB) * k) + o);                                       \
                UNPACK(w + (GB) * k, &tile[k]);                                                          \
            }                                                                                            \
            KERNEL(tile, nk, g, nk, nk, y + r, 1, k0 > 0, 1, 1);                                         \
        }                                                                                                \
    }                                                                                                    \
    FM_MATVEC_TAIL(GB, DOT);                                                                             \
}

/* The specialised Q4_0 matrix-vector products (SSSE3, AVX2, AVX-512): activations
 * prepared CHUNK groups at a time into XG groups by PREP; each row summed by
 * ROW(w, g, n) -> float over at most KC groups at a time (the batched product's
 * k-chunk), those sums added in order, then the tail blocks by DOT; rows without
 * a tail make no call. */
#define FM_GROUP_MATVEC(NAME, XG, GB, KC, CHUNK, PREP, ROW, DOT, ATTR)                                    \
ATTR void NAME(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)           \
{                                                                                                        \
    const int nb = cols / FM_QK, ng = nb / (GB), nt = nb - (GB) * ng;                                    \
    XG g[CHUNK];                                                                                         \
    _Static_assert((CHUNK) % (KC) == 0, "an activation chunk holds whole k-chunks");                    \
    for (int k0 = 0; k0 < ng; k0 += (CHUNK)) {                                                           \
        const int nk = ng - k0 < (CHUNK) ? ng - k0 : (CHUNK);                                            \
        PREP(x + (GB) * k0, nk, g);                                                                      \
        for (int r = r0; r < r1; r++) {                                                                  \
            const block_q4_0 *w = W + (size_t)r * nb + (GB) * k0;                                        \
            float v = k0 ? y[r] : 0.0f;                                                                  \
            for (int k = 0; k < nk; k += (KC)) {                                                         \
                const float s = ROW(w + (GB) * k, g + k, nk - k < (KC) ? nk - k : (KC));                 \
                v = k0 + k ? v + s : s;                                                                  \
            }                                                                                            \
            y[r] = v;                                                                                    \
        }                                                                                                \
    }                                                                                                    \
    FM_MATVEC_TAIL(GB, DOT);                                                                             \
}

/* The batched product for 2 to FM_FEW_TOKENS tokens (a decode round of a few
 * sequences; an expert's gate and up for its ~4 tokens of a 64-token prompt): the
 * loop of FM_GROUP_MATVEC, each weight group unpacked once and multiplied by every
 * token's activations, where unpacking into the tiled product's layout is a large
 * share of its time at so few tokens. ROWT(w, g, gs, ng, T, s) sums T tokens over
 * ng <= KC groups of one row (g: T rows of gs prepared groups) into s[T], each as
 * ROW sums it, so every (row, token) rounds as the matrix-vector product rounds it.
 * 40 KB of stack. */
#define FM_FEW_TOKENS 4
#define FM_FEW_MIN_COLS 1024  /* shorter rows stay tiled: on an expert's down projection it is as fast or faster */
#define FM_FEW_MATMUL(NAME, XG, GB, KC, CHUNK, PREP, ROWT, DOT, ATTR)                                       \
ATTR void NAME(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1) \
{                                                                                                        \
    const int nb = cols / FM_QK, ng = nb / (GB), nt = nb - (GB) * ng;                                    \
    XG g[FM_FEW_TOKENS * (CHUNK)];                                                                       \
    for (int k0 = 0; k0 < ng; k0 += (CHUNK)) {                                                           \
        const int nk = ng - k0 < (CHUNK) ? ng - k0 : (CHUNK);                                            \
        for (int b = 0; b < B; b++) PREP(X + (size_t)b * nb + (GB) * k0, nk, g + b * (CHUNK));           \
        for (int r = r0; r < r1; r++) {                                                                  \
            const block_q4_0 *w = W + (size_t)r * nb + (GB) * k0;                                        \
            for (int k = 0; k < nk; k += (KC)) {                                                         \
                const int n = nk - k < (KC) ? nk - k : (KC);                                             \
                float s[FM_FEW_TOKENS];                                                                  \
                switch (B) {                                                                             \
                case 2: ROWT(w + (GB) * k, g + k, (CHUNK), n, 2, s); break;                              \
                case 3: ROWT(w + (GB) * k, g + k, (CHUNK), n, 3, s); break;                              \
                default: ROWT(w + (GB) * k, g + k, (CHUNK), n, 4, s); break;                             \
                }                                                                                        \
                for (int b = 0; b < B; b++) {                                                            \
                    float *y = Y + (size_t)b * ldy + r;                                                  \
                    *y = k0 + k ? *y + s[b] : s[b];                                                      \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int r = r0; r < r1; r++)                                                                        \
        for (int b = 0; b < B; b++) {                                                                    \
            float *y = Y + (size_t)b * ldy + r;                                                          \
            if (!ng) *y = 0.0f;                                                                          \
            if (nt) *y += DOT(nt * FM_QK, W + (size_t)r * nb + (GB) * ng, X + (size_t)b * nb + (GB) * ng); \
        }                                                                                                \
}

/* fm_matmul_q4_0_<isa>: FEW for 2 to MAXB tokens on rows of FM_FEW_MIN_COLS or more,
 * else the tiled TILED. */
#define FM_FEW_OR_TILED(NAME, FEW, TILED, MAXB, ATTR)                                                    \
ATTR void NAME(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1) \
{                                                                                                        \
    _Static_assert((MAXB) <= FM_FEW_TOKENS, "FM_FEW_MATMUL takes at most FM_FEW_TOKENS tokens");        \
    if (B >= 2 && B <= (MAXB) && cols >= FM_FEW_MIN_COLS) FEW(W, X, Y, cols, B, ldy, r0, r1);            \
    else TILED(W, X, Y, cols, B, ldy, r0, r1);                                                           \
}

/* Per-ISA implementations, named fm_<op>_<isa>; dispatch.c builds one table per ISA. */
#define FM_DECLARE_INT_KERNELS(isa)                                                                         \
    float fm_vec_dot_q4_0_q8_0_##isa(int n, const block_q4_0 *w, const block_q8_0 *x);                      \
    float fm_vec_dot_q8_0_q8_0_##isa(int n, const block_q8_0 *w, const block_q8_0 *x);                      \
    void fm_matvec_q4_0_##isa(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1); \
    void fm_matvec_q8_0_##isa(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1); \
    void fm_matmul_q4_0_##isa(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1); \
    void fm_matmul_q8_0_##isa(const block_q8_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1);
#define FM_DECLARE_F32_KERNELS(isa)                                                                         \
    void fm_matvec_f32_##isa(const float *W, const float *x, float *y, int cols, int r0, int r1);            \
    void fm_matmul_f32_##isa(const float *W, const float *X, float *Y, int cols, int B, int ldy, int r0, int r1);

FM_DECLARE_INT_KERNELS(generic)     /* kernels_scalar.c */
FM_DECLARE_F32_KERNELS(generic)
FM_DECLARE_INT_KERNELS(ssse3)       /* kernels_ssse3.c */
FM_DECLARE_INT_KERNELS(avx2)        /* kernels_avx2.c */
FM_DECLARE_INT_KERNELS(avx512vnni)  /* kernels_avx512vnni.c */
FM_DECLARE_F32_KERNELS(ssse3)       /* kernels_float_x86.c, as the next three */
FM_DECLARE_F32_KERNELS(avx2)
FM_DECLARE_F32_KERNELS(avx512vnni)
void fm_quantize_row_q8_0_generic(const float *x, block_q8_0 *y, int n);
void fm_quantize_row_q8_0_avx2(const float *x, block_q8_0 *y, int n);
void fm_matvec_f16_generic(const uint16_t *W, const float *x, float *y, int cols, int r0, int r1);
void fm_matvec_f16_avx2(const uint16_t *W, const float *x, float *y, int cols, int r0, int r1);
void fm_matvec_f16_avx512vnni(const uint16_t *W, const float *x, float *y, int cols, int r0, int r1);
void fm_fp16_to_fp32_row_generic(const uint16_t *x, float *y, int n);
void fm_fp32_to_fp16_row_generic(const float *x, uint16_t *y, int n);
void fm_fp16_to_fp32_row_avx2(const uint16_t *x, float *y, int n);
void fm_fp32_to_fp16_row_avx2(const float *x, uint16_t *y, int n);
#define FM_DECLARE_ATTN_KERNELS(isa)                                                                        \
    void fm_attn_scores_##isa(const float *q, int qstride, int G, const void *const *rows, int f16, int n, int hd, \
                              float *s, int lds);                                                           \
    void fm_attn_accumulate_##isa(const float *p, int ldp, int G, const void *const *rows, int f16, int n, int hd, \
                                  float *acc);
FM_DECLARE_ATTN_KERNELS(generic)    /* kernels_scalar.c */
FM_DECLARE_ATTN_KERNELS(avx2)       /* kernels_float_x86.c */

#endif /* FERMOE_KERNELS_H */
