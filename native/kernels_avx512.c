/* kernels_avx512.c: AVX-512 VNNI versions of the integer dot products.
 * vpdpbusd multiplies unsigned bytes by signed bytes and adds groups of 4 into
 * int32 lanes in one instruction. Its unsigned operand is the weight:
 *   Q4_0: the raw nibbles (0..15), and the -8 offset becomes -8*sum(x) per block;
 *   Q8_0: w + 128 (w xor 0x80), and the offset becomes -128*sum(x) per block.
 * Corrections are applied to the int32 sums, never in float (no cancellation).
 * No AMX anywhere (it faults on our machines).
 */
#include <immintrin.h>
#include <stdlib.h>
#include "kernels.h"

#define FM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define FM_INLINE static inline __attribute__((always_inline))
#define CHUNK_BLOCKS 256  /* activation blocks prepared per pass: 16 groups, 10 KB of stack */

static int imin(int a, int b) { return a < b ? a : b; }

/* A group of 16 activation blocks, laid out for 512-bit weight loads: zmm k holds
 * the nibbles of weight blocks 4k..4k+3, one per 128-bit lane, and xlo[k]/xhi[k]
 * hold the matching activation halves. After fold16 the int32 of block 4k+L sits
 * in element 4L+k; corr and dx use that order too. */
typedef struct {
    __m512i xlo[4], xhi[4];
    __m512i corr;  /* -8 * sum(x_b) */
    __m512 dx;
} xgroup_vnni;

FM_VNNI static void prepare_x_vnni(const block_q8_0 *x, int ngroups, xgroup_vnni *g)
{
    for (int k = 0; k < ngroups; k++, x += 16) {
        int32_t corr[16];
        float dx[16];
        for (int q = 0; q < 4; q++) {
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int l = 0; l < 4; l++) {
                const block_q8_0 *xb = x + 4 * q + l;
                lo = _mm512_inserti32x4(lo, _mm_loadu_si128((const __m128i *)xb->qs), l);
                hi = _mm512_inserti32x4(hi, _mm_loadu_si128((const __m128i *)(xb->qs + 16)), l);
            }
            g[k].xlo[q] = lo;
            g[k].xhi[q] = hi;
        }
        for (int e = 0; e < 16; e++) {
            const block_q8_0 *xb = x + 4 * (e & 3) + (e >> 2);  /* element 4L+k <-> block 4k+L */
            int s = 0;
            for (int j = 0; j < FM_QK; j++) s += xb->qs[j];
            corr[e] = -8 * s;
            dx[e] = _cvtsh_ss(xb->d);
        }
        g[k].corr = _mm512_loadu_si512(corr);
        g[k].dx = _mm512_loadu_ps(dx);
    }
}

FM_INLINE FM_VNNI __m512i load_quad_q4(const block_q4_0 *w)
{
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)w[0].qs));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w[1].qs), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w[2].qs), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w[3].qs), 3);
}

/* 16 weight scales in fold16 order, gathered in integer registers (18 bytes apart). */
FM_INLINE FM_VNNI __m512 dw16_vnni(const block_q4_0 *w)
{
    uint64_t u[4];
    for (int l = 0; l < 4; l++)
        u[l] = w[l].d | (uint64_t)w[4 + l].d << 16 | (uint64_t)w[8 + l].d << 32 | (uint64_t)w[12 + l].d << 48;
    return _mm512_cvtph_ps(_mm256_set_epi64x((long long)u[3], (long long)u[2], (long long)u[1], (long long)u[0]));
}

/* 4 x 16 int32 partial sums (4 per block, each <= 15360) -> one int32 per block
 * with pack/madd; intermediate sums (30720, 61440) never saturate int16 packs. */
FM_INLINE FM_VNNI __m512i fold16_vnni(__m512i i0, __m512i i1, __m512i i2, __m512i i3)
{
    const __m512i one = _mm512_set1_epi16(1);
    const __m512i a = _mm512_madd_epi16(_mm512_packs_epi32(i0, i1), one);
    const __m512i b = _mm512_madd_epi16(_mm512_packs_epi32(i2, i3), one);
    return _mm512_madd_epi16(_mm512_packs_epi32(a, b), one);
}

/* 16 weight blocks unpacked for vpdpbusd: quad k's low and high nibbles, and the scales. */
typedef struct {
    __m512i lo[4], hi[4];
    __m512 dw;
} wgroup_vnni;

FM_INLINE FM_VNNI void unpack_group_q4_vnni(const block_q4_0 *w, wgroup_vnni *u)
{
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        const __m512i q = load_quad_q4(w + 4 * k);
        u->lo[k] = _mm512_and_si512(q, m4);
        u->hi[k] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    }
    u->dw = dw16_vnni(w);
}

/* acc += one unpacked weight group . one prepared activation group. */
FM_INLINE FM_VNNI __m512 group_dot_vnni(const wgroup_vnni *u, const xgroup_vnni *g, __m512 acc)
{
    __m512i i[4];
    for (int k = 0; k < 4; k++)
        i[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u->lo[k], g->xlo[k]), u->hi[k], g->xhi[k]);
    const __m512i s = _mm512_add_epi32(fold16_vnni(i[0], i[1], i[2], i[3]), g->corr);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(u->dw, g->dx), acc);
}

FM_INLINE FM_VNNI int hsum_epi32_128(__m128i s)
{
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One block with 128-bit VNNI (tails and the single dot product). */
FM_INLINE FM_VNNI int q4_block_sumi_vnni(const block_q4_0 *w, const block_q8_0 *x)
{
    const __m128i m4 = _mm_set1_epi8(0x0F), e8 = _mm_set1_epi8(8), z = _mm_setzero_si128();
    const __m128i q = _mm_loadu_si128((const __m128i *)w->qs);
    const __m128i x0 = _mm_loadu_si128((const __m128i *)x->qs);
    const __m128i x1 = _mm_loadu_si128((const __m128i *)(x->qs + 16));
    const __m128i s = _mm_dpbusd_epi32(_mm_dpbusd_epi32(z, _mm_and_si128(q, m4), x0),
                                       _mm_and_si128(_mm_srli_epi16(q, 4), m4), x1);
    const __m128i c = _mm_dpbusd_epi32(_mm_dpbusd_epi32(z, e8, x0), e8, x1);
    return hsum_epi32_128(_mm_sub_epi32(s, c));
}

FM_VNNI float fm_vec_dot_q4_0_q8_0_avx512vnni(int n, const block_q4_0 *w, const block_q8_0 *x)
{
    float sum = 0.0f;
    for (int b = 0; b < n / FM_QK; b++)
        sum += (float)q4_block_sumi_vnni(w + b, x + b) * (_cvtsh_ss(w[b].d) * _cvtsh_ss(x[b].d));
    return sum;
}

/* One row straight from memory: ng groups (288 B, 4.5 lines each), then nt tail blocks. */
FM_INLINE FM_VNNI float row_q4_0_vnni(const block_q4_0 *w, const xgroup_vnni *g, int ng, const block_q8_0 *xt, int nt)
{
    __m512 acc = _mm512_setzero_ps();
    for (int k = 0; k < ng; k++) {
        wgroup_vnni u;
        fm_prefetch(w + 16 * k);
        fm_prefetch((const char *)(w + 16 * k) + 192);
        unpack_group_q4_vnni(w + 16 * k, &u);
        acc = group_dot_vnni(&u, g + k, acc);
    }
    return _mm512_reduce_add_ps(acc) + fm_vec_dot_q4_0_q8_0_avx512vnni(nt * FM_QK, w + 16 * ng, xt);
}

/* One row at a time, as on AVX2 (see kernels_x86.c). */
FM_VNNI void fm_matvec_q4_0_avx512vnni(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK;
    xgroup_vnni g[CHUNK_BLOCKS / 16];
    for (int c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
        const int n = imin(CHUNK_BLOCKS, nb - c0), ng = n / 16;
        prepare_x_vnni(x + c0, ng, g);
        for (int r = r0; r < r1; r++) {
            const float s = row_q4_0_vnni(W + (size_t)r * nb + c0, g, ng, x + c0 + 16 * ng, n - 16 * ng);
            y[r] = c0 ? y[r] + s : s;
        }
    }
}

/* Batched: as on AVX2, a tile of MM_ROWS rows x MM_GROUPS groups (9 KB) is unpacked
 * once and used against the whole batch, prepared once on the heap. */
#define MM_ROWS 4
#define MM_GROUPS 4

FM_VNNI static void tile_q4_0_vnni(const wgroup_vnni (*u)[MM_GROUPS], int nr, int nk, const xgroup_vnni *g,
                                   int ng, int B, float *Y, int ldy, int accumulate)
{
    for (int b = 0; b < B; b++) {
        const xgroup_vnni *gb = g + (size_t)b * ng;
        for (int i = 0; i < nr; i++) {
            __m512 acc = _mm512_setzero_ps();
            for (int k = 0; k < nk; k++) acc = group_dot_vnni(&u[i][k], gb + k, acc);
            float *yp = Y + (size_t)b * ldy + i;
            *yp = accumulate ? *yp + _mm512_reduce_add_ps(acc) : _mm512_reduce_add_ps(acc);
        }
    }
}

FM_VNNI void fm_matmul_q4_0_avx512vnni(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B,
                                       int ldy, int r0, int r1)
{
    const int nb = cols / FM_QK, ng = nb / 16, nt = nb - 16 * ng;
    xgroup_vnni *g = ng ? aligned_alloc(64, (size_t)B * ng * sizeof(xgroup_vnni)) : NULL;
    if (!g) {  /* under 16 blocks, or out of memory: the per-block path is still right */
        for (int r = r0; r < r1; r++)
            for (int b = 0; b < B; b++)
                Y[(size_t)b * ldy + r] = fm_vec_dot_q4_0_q8_0_avx512vnni(cols, W + (size_t)r * nb, X + (size_t)b * nb);
        return;
    }
    for (int b = 0; b < B; b++) prepare_x_vnni(X + (size_t)b * nb, ng, g + (size_t)b * ng);
    wgroup_vnni u[MM_ROWS][MM_GROUPS];
    for (int rt = r0; rt < r1; rt += MM_ROWS) {
        const int nr = imin(MM_ROWS, r1 - rt);
        for (int k0 = 0; k0 < ng; k0 += MM_GROUPS) {
            const int nk = imin(MM_GROUPS, ng - k0);
            for (int i = 0; i < nr; i++)
                for (int k = 0; k < nk; k++) unpack_group_q4_vnni(W + (size_t)(rt + i) * nb + 16 * (k0 + k), &u[i][k]);
            tile_q4_0_vnni(u, nr, nk, g + k0, ng, B, Y + rt, ldy, k0 > 0);
        }
        for (int i = 0; nt && i < nr; i++)
            for (int b = 0; b < B; b++)
                Y[(size_t)b * ldy + rt + i] += fm_vec_dot_q4_0_q8_0_avx512vnni(
                    nt * FM_QK, W + (size_t)(rt + i) * nb + 16 * ng, X + (size_t)b * nb + 16 * ng);
    }
    free(g);
}

/* ---------------------------------------------------------------- Q8_0 x Q8_0
 * 256-bit VNNI per block: 34-byte blocks leave enough time per byte. negc is
 * -128*sum(x) spread over the lanes, computed once per block and shared by rows. */
FM_INLINE FM_VNNI __m256i q8_negc_vnni(__m256i xq)
{
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), xq));
}

FM_INLINE FM_VNNI __m256 q8_block_vnni(const block_q8_0 *w, __m256i xq, __m256i negc, float s, __m256 acc)
{
    const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)w->qs), _mm256_set1_epi8((char)0x80));
    const __m256i i = _mm256_dpbusd_epi32(negc, u, xq);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(s), acc);
}

FM_INLINE FM_VNNI float hsum256_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

FM_VNNI float fm_vec_dot_q8_0_q8_0_avx512vnni(int n, const block_q8_0 *w, const block_q8_0 *x)
{
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / FM_QK; b++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].qs);
        acc = q8_block_vnni(w + b, xq, q8_negc_vnni(xq), _cvtsh_ss(w[b].d) * _cvtsh_ss(x[b].d), acc);
    }
    return hsum256_ps(acc);
}

/* One row, two accumulators, prefetching; negc is recomputed per row (cheap, in L1). */
FM_INLINE FM_VNNI __m256 q8_step_vnni(const block_q8_0 *w, const block_q8_0 *x, float dx, __m256 acc)
{
    const __m256i xq = _mm256_loadu_si256((const __m256i *)x->qs);
    return q8_block_vnni(w, xq, q8_negc_vnni(xq), _cvtsh_ss(w->d) * dx, acc);
}

FM_INLINE FM_VNNI float row_q8_0_vnni(const block_q8_0 *w, const block_q8_0 *x, const float *dx, int nb)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        if ((b & 3) == 0) fm_prefetch(w + b);
        a0 = q8_step_vnni(w + b, x + b, dx[b], a0);
        a1 = q8_step_vnni(w + b + 1, x + b + 1, dx[b + 1], a1);
    }
    if (b < nb) a0 = q8_step_vnni(w + b, x + b, dx[b], a0);
    return hsum256_ps(_mm256_add_ps(a0, a1));
}

FM_VNNI void fm_matvec_q8_0_avx512vnni(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK;
    float dx[CHUNK_BLOCKS];
    for (int c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
        const int n = imin(CHUNK_BLOCKS, nb - c0);
        for (int b = 0; b < n; b++) dx[b] = _cvtsh_ss(x[c0 + b].d);
        for (int r = r0; r < r1; r++) {
            const float s = row_q8_0_vnni(W + (size_t)r * nb + c0, x + c0, dx, n);
            y[r] = c0 ? y[r] + s : s;
        }
    }
}

FM_VNNI void fm_matmul_q8_0_avx512vnni(const block_q8_0 *W, const block_q8_0 *X, float *Y, int cols, int B,
                                       int ldy, int r0, int r1)
{
    const int nb = cols / FM_QK;
    for (int r = r0; r < r1; r++)  /* row outer: each row is fetched once, then hit in L1 */
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = fm_vec_dot_q8_0_q8_0_avx512vnni(cols, W + (size_t)r * nb, X + (size_t)b * nb);
}
