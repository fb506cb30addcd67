/* kernels_x86.c: SSSE3 (the paper's kernel) and AVX2 versions of the integer
 * dot products and the F32/F16 products. Each function carries its own
 * target attribute, so this file builds without -m flags and one .so runs
 * everywhere; dispatch.c only calls a version the CPU supports.
 */
#include <immintrin.h>
#include <stdlib.h>
#include "kernels.h"

#define FM_SSSE3 __attribute__((target("ssse3")))
#define FM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FM_INLINE static inline __attribute__((always_inline))
#define CHUNK_BLOCKS 256  /* activation blocks prepared per pass: 8192 columns, ~10 KB of stack */

static int imin(int a, int b) { return a < b ? a : b; }

/* ================================================================ SSSE3
 * One Q4_0 x Q8_0 block as DESIGN.md describes it: unpack nibbles, subtract 8;
 * pmaddubsw needs an unsigned operand, so take |w| (psignb w,w) and move w's
 * sign onto the activation (psignb x,w); pmaddwd with ones widens to int32.
 * |w| <= 8 and |x| <= 127, so no pair sum can saturate. */
FM_INLINE FM_SSSE3 __m128i q4_block_ssse3(const block_q4_0 *w, __m128i x0, __m128i x1)
{
    const __m128i m4 = _mm_set1_epi8(0x0F), e8 = _mm_set1_epi8(8);
    const __m128i q = _mm_loadu_si128((const __m128i *)w->qs);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), e8);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), e8);
    const __m128i p0 = _mm_maddubs_epi16(_mm_sign_epi8(lo, lo), _mm_sign_epi8(x0, lo));
    const __m128i p1 = _mm_maddubs_epi16(_mm_sign_epi8(hi, hi), _mm_sign_epi8(x1, hi));
    return _mm_madd_epi16(_mm_add_epi16(p0, p1), _mm_set1_epi16(1));
}

/* Q8_0 x Q8_0: the same sign trick on 2 x 16 bytes; |w| <= 128, |x| <= 127: no saturation. */
FM_INLINE FM_SSSE3 __m128i q8_block_ssse3(const block_q8_0 *w, __m128i x0, __m128i x1)
{
    const __m128i w0 = _mm_loadu_si128((const __m128i *)w->qs);
    const __m128i w1 = _mm_loadu_si128((const __m128i *)(w->qs + 16));
    const __m128i p0 = _mm_maddubs_epi16(_mm_sign_epi8(w0, w0), _mm_sign_epi8(x0, w0));
    const __m128i p1 = _mm_maddubs_epi16(_mm_sign_epi8(w1, w1), _mm_sign_epi8(x1, w1));
    return _mm_add_epi32(_mm_madd_epi16(p0, _mm_set1_epi16(1)), _mm_madd_epi16(p1, _mm_set1_epi16(1)));
}

FM_INLINE FM_SSSE3 float hsum_ps_sse(__m128 v)
{
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/* SSSE3 has no FMA: scale with mul + add. Scales go through the portable fp16 helper. */
#define SSSE3_ACC(acc, isum, s) acc = _mm_add_ps(acc, _mm_mul_ps(_mm_cvtepi32_ps(isum), _mm_set1_ps(s)))

FM_SSSE3 float fm_vec_dot_q4_0_q8_0_ssse3(int n, const block_q4_0 *w, const block_q8_0 *x)
{
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < n / FM_QK; b++) {
        const __m128i x0 = _mm_loadu_si128((const __m128i *)x[b].qs);
        const __m128i x1 = _mm_loadu_si128((const __m128i *)(x[b].qs + 16));
        SSSE3_ACC(acc, q4_block_ssse3(w + b, x0, x1), fm_fp16_to_fp32(w[b].d) * fm_fp16_to_fp32(x[b].d));
    }
    return hsum_ps_sse(acc);
}

FM_SSSE3 float fm_vec_dot_q8_0_q8_0_ssse3(int n, const block_q8_0 *w, const block_q8_0 *x)
{
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < n / FM_QK; b++) {
        const __m128i x0 = _mm_loadu_si128((const __m128i *)x[b].qs);
        const __m128i x1 = _mm_loadu_si128((const __m128i *)(x[b].qs + 16));
        SSSE3_ACC(acc, q8_block_ssse3(w + b, x0, x1), fm_fp16_to_fp32(w[b].d) * fm_fp16_to_fp32(x[b].d));
    }
    return hsum_ps_sse(acc);
}

/* Two rows per pass share the activation loads and its converted scales. */
#define SSSE3_MATVEC(NAME, WTYPE, BLOCKFN)                                                       \
FM_SSSE3 void NAME(const WTYPE *W, const block_q8_0 *x, float *y, int cols, int r0, int r1) \
{                                                                                                  \
    const int nb = cols / FM_QK;                                                                   \
    float dx[CHUNK_BLOCKS];                                                                        \
    for (int c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {                                                \
        const int n = imin(CHUNK_BLOCKS, nb - c0);                                                 \
        const block_q8_0 *xc = x + c0;                                                             \
        for (int b = 0; b < n; b++) dx[b] = fm_fp16_to_fp32(xc[b].d);                              \
        int r = r0;                                                                                \
        for (; r + 1 < r1; r += 2) {                                                               \
            const WTYPE *w0 = W + (size_t)r * nb + c0, *w1 = w0 + nb;                             \
            __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();                                   \
            for (int b = 0; b < n; b++) {                                                          \
                if ((b & 7) == 0) {                                                                \
                    fm_prefetch(w0 + b);                                                           \
                    fm_prefetch(w1 + b);                                                           \
                }                                                                                  \
                const __m128i x0 = _mm_loadu_si128((const __m128i *)xc[b].qs);                     \
                const __m128i x1 = _mm_loadu_si128((const __m128i *)(xc[b].qs + 16));              \
                SSSE3_ACC(a0, BLOCKFN(w0 + b, x0, x1), fm_fp16_to_fp32(w0[b].d) * dx[b]);          \
                SSSE3_ACC(a1, BLOCKFN(w1 + b, x0, x1), fm_fp16_to_fp32(w1[b].d) * dx[b]);          \
            }                                                                                      \
            y[r] = (c0 ? y[r] : 0.0f) + hsum_ps_sse(a0);                                           \
            y[r + 1] = (c0 ? y[r + 1] : 0.0f) + hsum_ps_sse(a1);                                   \
        }                                                                                          \
        if (r < r1) {                                                                              \
            const WTYPE *w0 = W + (size_t)r * nb + c0;                                             \
            __m128 a0 = _mm_setzero_ps();                                                          \
            for (int b = 0; b < n; b++) {                                                          \
                const __m128i x0 = _mm_loadu_si128((const __m128i *)xc[b].qs);                     \
                const __m128i x1 = _mm_loadu_si128((const __m128i *)(xc[b].qs + 16));              \
                SSSE3_ACC(a0, BLOCKFN(w0 + b, x0, x1), fm_fp16_to_fp32(w0[b].d) * dx[b]);          \
            }                                                                                      \
            y[r] = (c0 ? y[r] : 0.0f) + hsum_ps_sse(a0);                                           \
        }                                                                                          \
    }                                                                                              \
}
SSSE3_MATVEC(fm_matvec_q4_0_ssse3, block_q4_0, q4_block_ssse3)
SSSE3_MATVEC(fm_matvec_q8_0_ssse3, block_q8_0, q8_block_ssse3)

/* Batched: row outer, batch inner, so each row is fetched from memory once. */
#define ROWWISE_MATMUL(NAME, WTYPE, DOT, ATTR)                                                        \
ATTR void NAME(const WTYPE *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1) \
{                                                                                                      \
    const int nb = cols / FM_QK;                                                                       \
    for (int r = r0; r < r1; r++)                                                                      \
        for (int b = 0; b < B; b++)                                                                    \
            Y[(size_t)b * ldy + r] = DOT(cols, W + (size_t)r * nb, X + (size_t)b * nb);               \
}
ROWWISE_MATMUL(fm_matmul_q4_0_ssse3, block_q4_0, fm_vec_dot_q4_0_q8_0_ssse3, FM_SSSE3)
ROWWISE_MATMUL(fm_matmul_q8_0_ssse3, block_q8_0, fm_vec_dot_q8_0_q8_0_ssse3, FM_SSSE3)

/* ================================================================ AVX2
 * Q4_0 on AVX2 skips the sign trick: the nibbles (0..15) go into vpmaddubsw
 * as the unsigned operand and the -8 offset becomes a per-block correction
 * -8*sum(x), computed once per activation. The activation is repacked once per
 * call into groups of 8 blocks so that one 32-byte load of two weight blocks'
 * nibbles lines up with it, and the int16 results of 8 blocks are folded to one
 * int32 per block with pack/madd (bounds: 7680, 15360, 30720: no saturation). */
typedef struct {
    __m256i xlo[4], xhi[4]; /* pair k: [x_2k[0..15] | x_2k+1[0..15]], same for [16..31] */
    __m256i corr;           /* -8 * sum(x_b), lanes in block order 0,2,4,6,1,3,5,7 */
    __m256 dx;              /* d_x, same lane order */
} xgroup_avx2;

static const int lane_block8[8] = {0, 2, 4, 6, 1, 3, 5, 7};

FM_AVX2 static void prepare_x_avx2(const block_q8_0 *x, int ngroups, xgroup_avx2 *g)
{
    for (int k = 0; k < ngroups; k++, x += 8) {
        int32_t corr[8];
        float dx[8];
        for (int j = 0; j < 4; j++) {
            const __m128i a0 = _mm_loadu_si128((const __m128i *)x[2 * j].qs);
            const __m128i a1 = _mm_loadu_si128((const __m128i *)(x[2 * j].qs + 16));
            const __m128i b0 = _mm_loadu_si128((const __m128i *)x[2 * j + 1].qs);
            const __m128i b1 = _mm_loadu_si128((const __m128i *)(x[2 * j + 1].qs + 16));
            g[k].xlo[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(a0), b0, 1);
            g[k].xhi[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(a1), b1, 1);
        }
        for (int l = 0; l < 8; l++) {
            const block_q8_0 *xb = x + lane_block8[l];
            int s = 0;
            for (int j = 0; j < FM_QK; j++) s += xb->qs[j];
            corr[l] = -8 * s;
            dx[l] = _cvtsh_ss(xb->d);
        }
        g[k].corr = _mm256_loadu_si256((const __m256i *)corr);
        g[k].dx = _mm256_loadu_ps(dx);
    }
}

/* 8 weight scales (18 bytes apart) in lane order 0,2,4,6,1,3,5,7. */
FM_INLINE FM_AVX2 __m256 dw8_avx2(const block_q4_0 *w)
{
    __m128i v = _mm_cvtsi32_si128(w[0].d);
    v = _mm_insert_epi16(v, w[2].d, 1);
    v = _mm_insert_epi16(v, w[4].d, 2);
    v = _mm_insert_epi16(v, w[6].d, 3);
    v = _mm_insert_epi16(v, w[1].d, 4);
    v = _mm_insert_epi16(v, w[3].d, 5);
    v = _mm_insert_epi16(v, w[5].d, 6);
    v = _mm_insert_epi16(v, w[7].d, 7);
    return _mm256_cvtph_ps(v);
}

/* int16 pair sums of 4 pairs of blocks -> one int32 per block, lanes 0,2,4,6,1,3,5,7. */
FM_INLINE FM_AVX2 __m256i fold8_avx2(__m256i p0, __m256i p1, __m256i p2, __m256i p3)
{
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i a = _mm256_madd_epi16(_mm256_packs_epi32(_mm256_madd_epi16(p0, one), _mm256_madd_epi16(p1, one)), one);
    const __m256i b = _mm256_madd_epi16(_mm256_packs_epi32(_mm256_madd_epi16(p2, one), _mm256_madd_epi16(p3, one)), one);
    return _mm256_madd_epi16(_mm256_packs_epi32(a, b), one);
}

FM_INLINE FM_AVX2 __m256i load_pair_q4(const block_q4_0 *w)
{
    const __m128i a = _mm_loadu_si128((const __m128i *)w[0].qs);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(a), _mm_loadu_si128((const __m128i *)w[1].qs), 1);
}

/* 8 weight blocks unpacked for vpmaddubsw: pair j's low and high nibbles, and the scales. */
typedef struct {
    __m256i lo[4], hi[4];
    __m256 dw;
} wgroup_avx2;

FM_INLINE FM_AVX2 void unpack_group_q4_avx2(const block_q4_0 *w, wgroup_avx2 *u)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m256i q = load_pair_q4(w + 2 * j);
        u->lo[j] = _mm256_and_si256(q, m4);
        u->hi[j] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
    u->dw = dw8_avx2(w);
}

/* acc += one unpacked weight group . one prepared activation group. */
FM_INLINE FM_AVX2 __m256 group_dot_avx2(const wgroup_avx2 *u, const xgroup_avx2 *g, __m256 acc)
{
    __m256i p[4];
    for (int j = 0; j < 4; j++)
        p[j] = _mm256_add_epi16(_mm256_maddubs_epi16(u->lo[j], g->xlo[j]), _mm256_maddubs_epi16(u->hi[j], g->xhi[j]));
    const __m256i s = _mm256_add_epi32(fold8_avx2(p[0], p[1], p[2], p[3]), g->corr);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(u->dw, g->dx), acc);
}

FM_INLINE FM_AVX2 float hsum_ps_avx(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block, for tails and the single dot product: int32 sum (offset trick). */
FM_INLINE FM_AVX2 int q4_block_sumi_avx2(const block_q4_0 *w, const block_q8_0 *x)
{
    const __m128i m4 = _mm_set1_epi8(0x0F), one = _mm_set1_epi16(1);
    const __m128i q = _mm_loadu_si128((const __m128i *)w->qs);
    const __m128i x0 = _mm_loadu_si128((const __m128i *)x->qs);
    const __m128i x1 = _mm_loadu_si128((const __m128i *)(x->qs + 16));
    const __m128i p = _mm_add_epi16(_mm_maddubs_epi16(_mm_and_si128(q, m4), x0),
                                    _mm_maddubs_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), m4), x1));
    /* sum(x) via maddubs with ones as the unsigned operand */
    const __m128i sx = _mm_add_epi16(_mm_maddubs_epi16(_mm_set1_epi8(1), x0), _mm_maddubs_epi16(_mm_set1_epi8(1), x1));
    __m128i s = _mm_madd_epi16(_mm_sub_epi16(p, _mm_slli_epi16(sx, 3)), one);
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

FM_AVX2 float fm_vec_dot_q4_0_q8_0_avx2(int n, const block_q4_0 *w, const block_q8_0 *x)
{
    float sum = 0.0f;
    for (int b = 0; b < n / FM_QK; b++)
        sum += (float)q4_block_sumi_avx2(w + b, x + b) * (_cvtsh_ss(w[b].d) * _cvtsh_ss(x[b].d));
    return sum;
}

/* One row straight from memory: ng groups, then nt tail blocks one by one. */
FM_INLINE FM_AVX2 float row_q4_0_avx2(const block_q4_0 *w, const xgroup_avx2 *g, int ng, const block_q8_0 *xt, int nt)
{
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < ng; k++) {
        wgroup_avx2 u;
        fm_prefetch(w + 8 * k);
        unpack_group_q4_avx2(w + 8 * k, &u);
        acc = group_dot_avx2(&u, g + k, acc);
    }
    return hsum_ps_avx(acc) + fm_vec_dot_q4_0_q8_0_avx2(nt * FM_QK, w + 8 * ng, xt);
}

/* One row at a time: two interleaved rows were slower here (short rows of 2048
 * columns: 11 vs 16 GB/s on one core), the memory streams matter more than ILP,
 * and a group already has 4 independent chains. */
FM_AVX2 void fm_matvec_q4_0_avx2(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK;
    xgroup_avx2 g[CHUNK_BLOCKS / 8];
    for (int c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
        const int n = imin(CHUNK_BLOCKS, nb - c0), ng = n / 8;
        prepare_x_avx2(x + c0, ng, g);
        for (int r = r0; r < r1; r++) {
            const float s = row_q4_0_avx2(W + (size_t)r * nb + c0, g, ng, x + c0 + 8 * ng, n - 8 * ng);
            y[r] = c0 ? y[r] + s : s;
        }
    }
}

/* Batched Q4_0, a small GEMM: activations are prepared once for the whole batch
 * (heap); a tile of MM_ROWS rows x MM_GROUPS groups is unpacked once (9 KB, stays
 * in L1) and used against every activation, so the nibble unpacking and the scale
 * gathering are paid once per batch instead of once per token. */
#define MM_ROWS 4
#define MM_GROUPS 8

FM_AVX2 static void tile_q4_0_avx2(const wgroup_avx2 (*u)[MM_GROUPS], int nr, int nk, const xgroup_avx2 *g,
                                   int ng, int B, float *Y, int ldy, int accumulate)
{
    for (int b = 0; b < B; b++) {
        const xgroup_avx2 *gb = g + (size_t)b * ng;
        for (int i = 0; i < nr; i++) {
            __m256 acc = _mm256_setzero_ps();
            for (int k = 0; k < nk; k++) acc = group_dot_avx2(&u[i][k], gb + k, acc);
            float *yp = Y + (size_t)b * ldy + i;
            *yp = accumulate ? *yp + hsum_ps_avx(acc) : hsum_ps_avx(acc);
        }
    }
}

FM_AVX2 void fm_matmul_q4_0_avx2(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B,
                                 int ldy, int r0, int r1)
{
    const int nb = cols / FM_QK, ng = nb / 8, nt = nb - 8 * ng;
    xgroup_avx2 *g = ng ? aligned_alloc(64, (size_t)B * ng * sizeof(xgroup_avx2)) : NULL;
    if (!g) {  /* under 8 blocks, or out of memory: the per-block path is still right */
        for (int r = r0; r < r1; r++)
            for (int b = 0; b < B; b++)
                Y[(size_t)b * ldy + r] = fm_vec_dot_q4_0_q8_0_avx2(cols, W + (size_t)r * nb, X + (size_t)b * nb);
        return;
    }
    for (int b = 0; b < B; b++) prepare_x_avx2(X + (size_t)b * nb, ng, g + (size_t)b * ng);
    wgroup_avx2 u[MM_ROWS][MM_GROUPS];
    for (int rt = r0; rt < r1; rt += MM_ROWS) {
        const int nr = imin(MM_ROWS, r1 - rt);
        for (int k0 = 0; k0 < ng; k0 += MM_GROUPS) {
            const int nk = imin(MM_GROUPS, ng - k0);
            for (int i = 0; i < nr; i++)
                for (int k = 0; k < nk; k++) unpack_group_q4_avx2(W + (size_t)(rt + i) * nb + 8 * (k0 + k), &u[i][k]);
            tile_q4_0_avx2(u, nr, nk, g + k0, ng, B, Y + rt, ldy, k0 > 0);
        }
        for (int i = 0; nt && i < nr; i++)
            for (int b = 0; b < B; b++)
                Y[(size_t)b * ldy + rt + i] += fm_vec_dot_q4_0_q8_0_avx2(nt * FM_QK, W + (size_t)(rt + i) * nb + 8 * ng,
                                                                         X + (size_t)b * nb + 8 * ng);
    }
    free(g);
}

/* Q8_0 x Q8_0: 34-byte blocks leave more time per byte; the sign trick per block is enough. */
FM_INLINE FM_AVX2 __m256 q8_block_avx2(const block_q8_0 *w, __m256i xq, float s, __m256 acc)
{
    const __m256i wq = _mm256_loadu_si256((const __m256i *)w->qs);
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
    const __m256i i = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(s), acc);
}

FM_AVX2 float fm_vec_dot_q8_0_q8_0_avx2(int n, const block_q8_0 *w, const block_q8_0 *x)
{
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / FM_QK; b++)
        acc = q8_block_avx2(w + b, _mm256_loadu_si256((const __m256i *)x[b].qs),
                            _cvtsh_ss(w[b].d) * _cvtsh_ss(x[b].d), acc);
    return hsum_ps_avx(acc);
}

/* One row, two accumulators (an FMA chain per block would bound the loop), prefetching. */
FM_INLINE FM_AVX2 float row_q8_0_avx2(const block_q8_0 *w, const block_q8_0 *x, const float *dx, int nb)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        if ((b & 3) == 0) fm_prefetch(w + b);  /* 4 blocks = 136 B per 3 prefetched lines */
        a0 = q8_block_avx2(w + b, _mm256_loadu_si256((const __m256i *)x[b].qs), _cvtsh_ss(w[b].d) * dx[b], a0);
        a1 = q8_block_avx2(w + b + 1, _mm256_loadu_si256((const __m256i *)x[b + 1].qs),
                           _cvtsh_ss(w[b + 1].d) * dx[b + 1], a1);
    }
    if (b < nb) a0 = q8_block_avx2(w + b, _mm256_loadu_si256((const __m256i *)x[b].qs), _cvtsh_ss(w[b].d) * dx[b], a0);
    return hsum_ps_avx(_mm256_add_ps(a0, a1));
}

FM_AVX2 void fm_matvec_q8_0_avx2(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK;
    float dx[CHUNK_BLOCKS];
    for (int c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
        const int n = imin(CHUNK_BLOCKS, nb - c0);
        for (int b = 0; b < n; b++) dx[b] = _cvtsh_ss(x[c0 + b].d);
        for (int r = r0; r < r1; r++) {
            const float s = row_q8_0_avx2(W + (size_t)r * nb + c0, x + c0, dx, n);
            y[r] = c0 ? y[r] + s : s;
        }
    }
}
ROWWISE_MATMUL(fm_matmul_q8_0_avx2, block_q8_0, fm_vec_dot_q8_0_q8_0_avx2, FM_AVX2)
