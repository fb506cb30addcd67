/* kernels_avx512vnni.c: the AVX-512 VNNI kernels: the integer dot products, the
 * matrix-vector, few-token and tiled batched products, the F32 and F16 products
 * (AVX-512F); the table of the avx512vnni ISA, which borrows AVX2's quantiser, fp16
 * rows and attention kernels.
 * vpdpbusd multiplies unsigned bytes by signed bytes and adds groups of 4 into
 * int32 lanes in one instruction. Its unsigned operand is the weight:
 *   Q4_0: the raw nibbles (0..15), and the -8 offset becomes -8*sum(x) per block;
 *   Q8_0: w + 128 (w xor 0x80), and the offset becomes -128*sum(x) per block.
 * Corrections are applied to the int32 sums, never in float (no cancellation).
 * No AMX anywhere (it faults on our machines).
 */
#include "x86.h"

#define FM_TARGET FM_AVX512VNNI  /* for the templates */
#define FM_GB 16                 /* blocks a group: 4 per 128-bit lane of a 512-bit vector */

/* A group of 16 activation blocks, laid out for 512-bit weight loads: zmm k holds
 * the nibbles of weight blocks 4k..4k+3, one per 128-bit lane, and xlo[k]/xhi[k]
 * hold the matching activation halves. After fold16 the int32 of block 4k+L sits
 * in element 4L+k; corr and dx use that order too. */
typedef struct {
    __m512i xlo[4], xhi[4];
    __m512i corr;  /* -8 * sum(x_b) */
    __m512 dx;
} xgroup_avx512vnni;

/* 16 bytes at offset off of the 4 Q8_0 blocks x[0..3], one per 128-bit lane. */
FM_INLINE FM_AVX512VNNI __m512i load_quad_q8(const block_q8_0 *x, int off)
{
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(x[0].qs + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(x[1].qs + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(x[2].qs + off)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(x[3].qs + off)), 3);
}

FM_AVX512VNNI static void prepare_x_avx512vnni(const block_q8_0 *x, int ngroups, xgroup_avx512vnni *g)
{
    for (int k = 0; k < ngroups; k++, x += 16) {
        int32_t corr[16];
        float dx[16];
        for (int q = 0; q < 4; q++) {
            g[k].xlo[q] = load_quad_q8(x + 4 * q, 0);
            g[k].xhi[q] = load_quad_q8(x + 4 * q, 16);
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

FM_INLINE FM_AVX512VNNI __m512i load_quad_q4(const block_q4_0 *w)
{
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)w[0].qs));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w[1].qs), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w[2].qs), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)w[3].qs), 3);
}

/* 16 weight scales in fold16 order, gathered in integer registers (18 bytes apart). */
FM_INLINE FM_AVX512VNNI __m512 dw16_avx512vnni(const block_q4_0 *w)
{
    uint64_t u[4];
    for (int l = 0; l < 4; l++)
        u[l] = w[l].d | (uint64_t)w[4 + l].d << 16 | (uint64_t)w[8 + l].d << 32 | (uint64_t)w[12 + l].d << 48;
    return _mm512_cvtph_ps(_mm256_set_epi64x((long long)u[3], (long long)u[2], (long long)u[1], (long long)u[0]));
}

/* 4 x 16 int32 partial sums (4 per block, each <= 15360) -> one int32 per block
 * with pack/madd; intermediate sums (30720, 61440) never saturate int16 packs. */
FM_INLINE FM_AVX512VNNI __m512i fold16_avx512vnni(__m512i i0, __m512i i1, __m512i i2, __m512i i3)
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
} wgroup_avx512vnni;

FM_INLINE FM_AVX512VNNI void unpack_group_q4_avx512vnni(const block_q4_0 *w, wgroup_avx512vnni *u)
{
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        const __m512i q = load_quad_q4(w + 4 * k);
        u->lo[k] = _mm512_and_si512(q, m4);
        u->hi[k] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    }
    u->dw = dw16_avx512vnni(w);
}

/* acc += one unpacked weight group . one prepared activation group. */
FM_INLINE FM_AVX512VNNI __m512 group_dot_avx512vnni(const wgroup_avx512vnni *u, const xgroup_avx512vnni *g, __m512 acc)
{
    __m512i i[4];
    for (int k = 0; k < 4; k++)
        i[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u->lo[k], g->xlo[k]),
                                   u->hi[k], g->xhi[k]);
    const __m512i s = _mm512_add_epi32(fold16_avx512vnni(i[0], i[1], i[2], i[3]), g->corr);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(u->dw, g->dx), acc);
}

FM_INLINE FM_AVX512VNNI int hsum_epi32_avx512vnni(__m128i s)
{
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One block with 128-bit VNNI (tails and the single dot product). */
FM_INLINE FM_AVX512VNNI int q4_block_sumi_avx512vnni(const block_q4_0 *w, const block_q8_0 *x)
{
    const __m128i m4 = _mm_set1_epi8(0x0F), e8 = _mm_set1_epi8(8), z = _mm_setzero_si128();
    const __m128i q = _mm_loadu_si128((const __m128i *)w->qs);
    const __m128i x0 = _mm_loadu_si128((const __m128i *)x->qs);
    const __m128i x1 = _mm_loadu_si128((const __m128i *)(x->qs + 16));
    const __m128i s = _mm_dpbusd_epi32(_mm_dpbusd_epi32(z, _mm_and_si128(q, m4), x0),
                                       _mm_and_si128(_mm_srli_epi16(q, 4), m4), x1);
    const __m128i c = _mm_dpbusd_epi32(_mm_dpbusd_epi32(z, e8, x0), e8, x1);
    return hsum_epi32_avx512vnni(_mm_sub_epi32(s, c));
}

/* Out of line, as the dot products (tails of every row loop) always were: inlined there
 * they change gcc's schedule of those loops, slower on AVX-512. */
FM_AVX512VNNI __attribute__((noinline)) static float fm_vec_dot_q4_0_q8_0_avx512vnni(int n, const block_q4_0 *w,
                                                                                     const block_q8_0 *x)
{
    float sum = 0.0f;
    for (int b = 0; b < n / FM_QK; b++)
        sum += (float)q4_block_sumi_avx512vnni(w + b, x + b) * (_cvtsh_ss(w[b].d) * _cvtsh_ss(x[b].d));
    return sum;
}

/* k-chunks (groups) of the batched products below: the matrix-vector products sum
 * in the same pieces, so a row rounds alike in both (see kernels_avx2.c). */
#define AVX512VNNI_Q4_KC 8
#define AVX512VNNI_Q8_KC 4

/* T tokens' sums over ng groups (288 B, 4.5 lines each) of one row straight from
 * memory (g: T rows of gs groups): each group unpacked once, then dotted with every
 * token's activations; one token is the matrix-vector product's row, more the
 * few-token product's (group_matvec_template.h). */
FM_INLINE FM_AVX512VNNI void row_tokens_q4_0_avx512vnni(const block_q4_0 *w, const xgroup_avx512vnni *g, int gs,
                                                        int ng, const int T, float *s)
{
    __m512 acc[FM_FEW_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int k = 0; k < ng; k++) {
        wgroup_avx512vnni u;
        fm_prefetch(w + 16 * k);
        fm_prefetch((const char *)(w + 16 * k) + 192);
        unpack_group_q4_avx512vnni(w + 16 * k, &u);
        for (int t = 0; t < T; t++) acc[t] = group_dot_avx512vnni(&u, g + (size_t)t * gs + k, acc[t]);
    }
    for (int t = 0; t < T; t++) s[t] = _mm512_reduce_add_ps(acc[t]);
}

FM_INLINE FM_AVX512VNNI float row_q4_0_avx512vnni(const block_q4_0 *w, const xgroup_avx512vnni *g, int ng)
{
    float s;
    row_tokens_q4_0_avx512vnni(w, g, 0, ng, 1, &s);
    return s;
}

/* One row at a time, as on AVX2 (see kernels_avx2.c). */
#define GROUP_MATVEC_NAME fm_matvec_q4_0_avx512vnni
#define GROUP_FEW_NAME matmul_few_q4_0_avx512vnni
#define GROUP_XG xgroup_avx512vnni
#define GROUP_KC AVX512VNNI_Q4_KC
#define GROUP_PREP prepare_x_avx512vnni
#define GROUP_ROW row_q4_0_avx512vnni
#define GROUP_ROW_TOKENS row_tokens_q4_0_avx512vnni
#define GROUP_DOT fm_vec_dot_q4_0_q8_0_avx512vnni
#include "group_matvec_template.h"

/* ---------------------------------------------------------------- batched (AVX-512 VNNI)
 * The tiled GEMM (tiled_matmul_template.h) with 512-bit vectors: a group is
 * 16 blocks; after the in-lane 4x4 transpose, block 4p+L sits in 32-bit element
 * 4L+p (the fold16/dw16 order above). vpdpbusd sums the 4 products of a lane
 * into int32 itself, so the 8 vectors of a group go into one accumulator that
 * starts at the block's correction: no fold at all, then one convert, one mul,
 * one FMA per 16 blocks of one row and one token. Weights are the unsigned
 * operand: Q4_0 nibbles (correction -8*sum(x)), Q8_0 w + 128 (-128*sum(x)), so
 * one kernel serves both. Register blocking: 4 rows x 2 tokens (8 accumulators,
 * 8 sums, 6 operands: 22 of the 32 registers). */
typedef struct {
    __m512i v[8];  /* v[m]: x[4m..4m+3] of the 16 blocks; v[4+m]: x[16+4m..16+4m+3] */
    __m512i corr;  /* -8 * sum(x_b) for Q4_0 weights, -128 * sum(x_b) for Q8_0 */
    __m512 dx;
} xt16_avx512vnni;       /* 640 bytes: one token's group of 16 activation blocks */

typedef struct {
    __m512i v[8];  /* unsigned weights (nibbles, or w + 128), element order as xt16_avx512vnni */
    __m512 dw;
} wt16_avx512vnni;       /* 576 bytes: one row's group of 16 weight blocks */

/* In-lane 4x4 transpose of 32-bit elements: a[m] element 4L+p <- a[p] element 4L+m. */
FM_INLINE FM_AVX512VNNI void transpose4_epi32_avx512vnni(__m512i a[4])
{
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    a[0] = _mm512_unpacklo_epi64(t0, t2);
    a[1] = _mm512_unpackhi_epi64(t0, t2);
    a[2] = _mm512_unpacklo_epi64(t1, t3);
    a[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 16 Q8_0 blocks' ints in the group layout. */
FM_INLINE FM_AVX512VNNI void load_q8_group16_avx512vnni(const block_q8_0 *x, __m512i v[8])
{
    __m512i a[4], b[4];
    for (int q = 0; q < 4; q++) {
        a[q] = load_quad_q8(x + 4 * q, 0);
        b[q] = load_quad_q8(x + 4 * q, 16);
    }
    transpose4_epi32_avx512vnni(a);
    transpose4_epi32_avx512vnni(b);
    for (int m = 0; m < 4; m++) {
        v[m] = a[m];
        v[4 + m] = b[m];
    }
}

/* 16 Q8_0 scales (34 bytes apart) in the group order, as dw16_avx512vnni. */
FM_INLINE FM_AVX512VNNI __m512 d16_q8_avx512vnni(const block_q8_0 *x)
{
    uint64_t u[4];
    for (int l = 0; l < 4; l++)
        u[l] = x[l].d | (uint64_t)x[4 + l].d << 16 | (uint64_t)x[8 + l].d << 32 | (uint64_t)x[12 + l].d << 48;
    return _mm512_cvtph_ps(_mm256_set_epi64x((long long)u[3], (long long)u[2], (long long)u[1], (long long)u[0]));
}

/* One token's groups; corr = -(sum(x) << shift): shift 3 for Q4_0 weights, 7 for Q8_0. */
FM_INLINE FM_AVX512VNNI void prepare_xt16_avx512vnni(const block_q8_0 *x, int ng, xt16_avx512vnni *g, int shift)
{
    const __m512i one8 = _mm512_set1_epi8(1);
    for (int k = 0; k < ng; k++, x += 16) {
        load_q8_group16_avx512vnni(x, g[k].v);
        __m512i s = _mm512_setzero_si512();
        for (int m = 0; m < 8; m++) s = _mm512_dpbusd_epi32(s, one8, g[k].v[m]);
        g[k].corr = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_sll_epi32(s, _mm_cvtsi32_si128(shift)));
        g[k].dx = d16_q8_avx512vnni(x);
    }
}

FM_AVX512VNNI static void prepare_xt16_q4_avx512vnni(const block_q8_0 *x, int ng,
                                                     xt16_avx512vnni *g) { prepare_xt16_avx512vnni(x, ng, g, 3); }
FM_AVX512VNNI static void prepare_xt16_q8_avx512vnni(const block_q8_0 *x, int ng,
                                                     xt16_avx512vnni *g) { prepare_xt16_avx512vnni(x, ng, g, 7); }

FM_INLINE FM_AVX512VNNI void unpack_wt16_q4_avx512vnni(const block_q4_0 *w, wt16_avx512vnni *u)
{
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i q[4];
    for (int k = 0; k < 4; k++) q[k] = load_quad_q4(w + 4 * k);
    transpose4_epi32_avx512vnni(q);
    for (int m = 0; m < 4; m++) {
        u->v[m] = _mm512_and_si512(q[m], m4);
        u->v[4 + m] = _mm512_and_si512(_mm512_srli_epi16(q[m], 4), m4);
    }
    u->dw = dw16_avx512vnni(w);
}

FM_INLINE FM_AVX512VNNI void unpack_wt16_q8_avx512vnni(const block_q8_0 *w, wt16_avx512vnni *u)
{
    load_q8_group16_avx512vnni(w, u->v);
    for (int m = 0; m < 8; m++) u->v[m] = _mm512_xor_si512(u->v[m], _mm512_set1_epi8((char)0x80));
    u->dw = d16_q8_avx512vnni(w);
}

/* R rows (wstride groups apart) x T tokens (xstride groups apart) over nk groups. */
FM_INLINE FM_AVX512VNNI void kernel_avx512vnni(const wt16_avx512vnni *w, int wstride, const xt16_avx512vnni *x,
                                               int xstride, int nk,
                                   float *Y, int ldy, int acc_out, const int R, const int T)
{
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int k = 0; k < nk; k++) {
        __m512i s[4][2];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) s[r][t] = _mm512_load_si512(&x[(size_t)t * xstride + k].corr);
        for (int m = 0; m < 8; m++) {
            __m512i wv[4], xv[2];
            for (int r = 0; r < R; r++) {
                wv[r] = _mm512_load_si512(&w[(size_t)r * wstride + k].v[m]);
                FM_KEEP_V(wv[r]);
            }
            for (int t = 0; t < T; t++) {
                xv[t] = _mm512_load_si512(&x[(size_t)t * xstride + k].v[m]);
                FM_KEEP_V(xv[t]);
            }
            for (int r = 0; r < R; r++)
                for (int t = 0; t < T; t++) {
                    s[r][t] = _mm512_dpbusd_epi32(s[r][t], wv[r], xv[t]);
                    FM_KEEP_V(s[r][t]);
                }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][t]),
                                            _mm512_mul_ps(w[(size_t)r * wstride + k].dw, x[(size_t)t * xstride + k].dx),
                                            acc[r][t]);
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float *y = Y + (size_t)t * ldy + r;
            const float v = _mm512_reduce_add_ps(acc[r][t]);
            *y = acc_out ? *y + v : v;
        }
}

#define TILED_NAME matmul_tiled_q4_0_avx512vnni
#define TILED_W block_q4_0
#define TILED_WT wt16_avx512vnni
#define TILED_XT xt16_avx512vnni
#define TILED_KC AVX512VNNI_Q4_KC
#define TILED_RB 4
#define TILED_PREP prepare_xt16_q4_avx512vnni
#define TILED_UNPACK unpack_wt16_q4_avx512vnni
#define TILED_KERNEL kernel_avx512vnni
#define TILED_DOT fm_vec_dot_q4_0_q8_0_avx512vnni
#define TILED_MATVEC fm_matvec_q4_0_avx512vnni
#include "tiled_matmul_template.h"

/* A few tokens (group_matvec_template.h) on rows of at least FM_FEW_MIN_COLS columns,
 * as on AVX2. */
FM_AVX512VNNI static void fm_matmul_q4_0_avx512vnni(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B,
                                                    int ldy, int r0, int r1)
{
    if (B >= 2 && B <= FM_FEW_TOKENS && cols >= FM_FEW_MIN_COLS)
        matmul_few_q4_0_avx512vnni(W, X, Y, cols, B, ldy, r0, r1);
    else matmul_tiled_q4_0_avx512vnni(W, X, Y, cols, B, ldy, r0, r1);
}

/* ---------------------------------------------------------------- Q8_0 x Q8_0
 * 256-bit VNNI per block: 34-byte blocks leave enough time per byte. negc is
 * -128*sum(x) spread over the lanes, computed once per block and shared by rows. */
FM_INLINE FM_AVX512VNNI __m256i q8_negc_avx512vnni(__m256i xq)
{
    return _mm256_sub_epi32(_mm256_setzero_si256(),
                            _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), xq));
}

FM_INLINE FM_AVX512VNNI __m256 q8_block_avx512vnni(const block_q8_0 *w, __m256i xq, __m256i negc, float s, __m256 acc)
{
    const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)w->qs), _mm256_set1_epi8((char)0x80));
    const __m256i i = _mm256_dpbusd_epi32(negc, u, xq);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(s), acc);
}

FM_INLINE FM_AVX512VNNI float hsum_halves_avx512vnni(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

FM_AVX512VNNI __attribute__((noinline)) static float fm_vec_dot_q8_0_q8_0_avx512vnni(int n, const block_q8_0 *w,
                                                                                     const block_q8_0 *x)
{
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / FM_QK; b++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].qs);
        acc = q8_block_avx512vnni(w + b, xq, q8_negc_avx512vnni(xq), _cvtsh_ss(w[b].d) * _cvtsh_ss(x[b].d), acc);
    }
    return hsum_halves_avx512vnni(acc);
}

/* The tiled product at one row and one token: each row's groups are unpacked as the
 * tiled product unpacks them (AVX512VNNI_Q8_KC at a time, its k-chunk) and summed by
 * the same kernel, then the tail blocks by the dot product, so every row rounds
 * exactly as in the batched product (the tests hold every ISA to it). */
FM_AVX512VNNI static void fm_matvec_q8_0_avx512vnni(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols,
                                                    int r0, int r1)
{
    const int nb = cols / FM_QK, ng = nb / 16;
    _Alignas(64) xt16_avx512vnni g[AVX512VNNI_Q8_KC];
    _Alignas(64) wt16_avx512vnni tile[AVX512VNNI_Q8_KC];
    for (int k0 = 0; k0 < ng; k0 += AVX512VNNI_Q8_KC) {
        const int nk = ng - k0 < AVX512VNNI_Q8_KC ? ng - k0 : AVX512VNNI_Q8_KC;
        prepare_xt16_q8_avx512vnni(x + 16 * k0, nk, g);
        for (int r = r0; r < r1; r++) {
            const block_q8_0 *w = W + (size_t)r * nb + 16 * k0;
            for (int k = 0; k < nk; k++) {
                for (size_t o = 0; o < 16 * sizeof(block_q8_0); o += 192)
                    fm_prefetch((const char *)(w + 16 * k) + o);
                unpack_wt16_q8_avx512vnni(w + 16 * k, &tile[k]);
            }
            kernel_avx512vnni(tile, nk, g, nk, nk, y + r, 1, k0 > 0, 1, 1);
        }
    }
    matvec_tail_q8_0(fm_vec_dot_q8_0_q8_0_avx512vnni, W, x, y, cols, 16, r0, r1);
}

#define TILED_NAME fm_matmul_q8_0_avx512vnni
#define TILED_W block_q8_0
#define TILED_WT wt16_avx512vnni
#define TILED_XT xt16_avx512vnni
#define TILED_KC AVX512VNNI_Q8_KC
#define TILED_RB 4
#define TILED_PREP prepare_xt16_q8_avx512vnni
#define TILED_UNPACK unpack_wt16_q8_avx512vnni
#define TILED_KERNEL kernel_avx512vnni
#define TILED_DOT fm_vec_dot_q8_0_q8_0_avx512vnni
#define TILED_MATVEC fm_matvec_q8_0_avx512vnni
#include "tiled_matmul_template.h"

/* ---------------------------------------------------------------- F32 and F16 (AVX-512F)
 * As kernels_avx2.c's, 16 floats a vector. */

/* 16 floats of a row from element i: fp16 widened when f16 is set, else fp32. */
FM_INLINE FM_AVX512VNNI __m512 load16_avx512vnni(const void *row, int f16, int i)
{
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)))
               : _mm512_loadu_ps((const float *)row + i);
}

FM_INLINE FM_AVX512VNNI float dot_avx512vnni(int n, const void *w, const int f16, const float *x)
{
    const size_t esize = f16 ? 2 : 4;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int j = 0;
    for (; j + 64 <= n; j += 64) {
        fm_prefetch((const char *)w + j * esize);
        fm_prefetch((const char *)w + (j + 48) * esize);
        a0 = _mm512_fmadd_ps(load16_avx512vnni(w, f16, j), _mm512_loadu_ps(x + j), a0);
        a1 = _mm512_fmadd_ps(load16_avx512vnni(w, f16, j + 16), _mm512_loadu_ps(x + j + 16), a1);
        a2 = _mm512_fmadd_ps(load16_avx512vnni(w, f16, j + 32), _mm512_loadu_ps(x + j + 32), a2);
        a3 = _mm512_fmadd_ps(load16_avx512vnni(w, f16, j + 48), _mm512_loadu_ps(x + j + 48), a3);
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; j < n; j++) sum += (f16 ? _cvtsh_ss(((const uint16_t *)w)[j]) : ((const float *)w)[j]) * x[j];
    return sum;
}

FM_AVX512VNNI static float dot_f32_avx512vnni(int n, const float *w, const float *x)
{
    return dot_avx512vnni(n, w, 0, x);
}

FM_AVX512VNNI static float dot_f16_avx512vnni(int n, const uint16_t *w, const float *x)
{
    return dot_avx512vnni(n, w, 1, x);
}

FM_AVX512VNNI static void fm_matvec_f32_avx512vnni(const float *W, const float *x, float *y, int cols, int r0, int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f32_avx512vnni(cols, W + (size_t)r * cols, x);
}

FM_AVX512VNNI static void fm_matvec_f16_avx512vnni(const uint16_t *W, const float *x, float *y, int cols, int r0,
                                                   int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f16_avx512vnni(cols, W + (size_t)r * cols, x);
}

/* Row by row, as on AVX2 (see fm_matmul_f32_avx2). */
FM_AVX512VNNI static void fm_matmul_f32_avx512vnni(const float *W, const float *X, float *Y, int cols, int B, int ldy,
                                                   int r0, int r1)
{
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = dot_f32_avx512vnni(cols, W + (size_t)r * cols, X + (size_t)b * cols);
}

const fm_kernels fm_kernels_avx512vnni = {
    .quantize_row_q8_0 = fm_quantize_row_q8_0_avx2,
    .dot_q4_0_q8_0 = fm_vec_dot_q4_0_q8_0_avx512vnni,
    .dot_q8_0_q8_0 = fm_vec_dot_q8_0_q8_0_avx512vnni,
    .matvec_q4_0 = fm_matvec_q4_0_avx512vnni,
    .matvec_q8_0 = fm_matvec_q8_0_avx512vnni,
    .matvec_f32 = fm_matvec_f32_avx512vnni,
    .matvec_f16 = fm_matvec_f16_avx512vnni,
    .matmul_q4_0 = fm_matmul_q4_0_avx512vnni,
    .matmul_q8_0 = fm_matmul_q8_0_avx512vnni,
    .matmul_f32 = fm_matmul_f32_avx512vnni,
    .fp16_to_fp32_row = fm_fp16_to_fp32_row_avx2,
    .fp32_to_fp16_row = fm_fp32_to_fp16_row_avx2,
    .attn_scores = fm_attn_scores_avx2,
    .attn_accumulate = fm_attn_accumulate_avx2,
};
