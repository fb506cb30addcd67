/* kernels_avx2.c: the AVX2 kernels (with FMA and F16C): the integer dot products,
 * the matrix-vector products (Q4_0 straight from the GGUF layout), the few-token and
 * tiled batched products; the F32 and F16 products, fp16 rows, the attention
 * kernels over the KV cache and the Q8_0 quantiser; the table of the avx2 ISA.
 */
#include <math.h>
#include "x86.h"

#define FM_TARGET FM_AVX2  /* for the templates */
#define FM_GB 8            /* blocks a group: one per 32-bit lane of a 256-bit vector */

static int imin(int a, int b) { return a < b ? a : b; }

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

/* Out of line: inlined into fm_matvec_q4_0_avx2 it changes gcc's schedule of the
 * row loop there, which then runs slower in cache. */
FM_AVX2 __attribute__((noinline)) static void prepare_x_avx2(const block_q8_0 *x, int ngroups, xgroup_avx2 *g)
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

/* Four fp16 scales packed in a 64-bit integer register. The empty asm keeps the
 * value in a general register: without it gcc's SLP pass turns the loads and
 * shifts back into vector shuffles, the very pipe this avoids. */
FM_INLINE uint64_t d4_gpr(uint16_t a, uint16_t b, uint16_t c, uint16_t d)
{
    uint64_t v = (uint64_t)a | (uint64_t)b << 16;
    __asm__("" : "+r"(v));
    v |= (uint64_t)c << 32 | (uint64_t)d << 48;
    __asm__("" : "+r"(v));
    return v;
}

/* 8 weight scales (18 bytes apart) in lane order 0,2,4,6,1,3,5,7. Gathered with
 * scalar loads and shifts on the integer pipes: eight vpinsrw would queue on the
 * vector shuffle pipes that unpacking and folding need. */
FM_INLINE FM_AVX2 __m256 dw8_avx2(const block_q4_0 *w)
{
    const uint64_t even = d4_gpr(w[0].d, w[2].d, w[4].d, w[6].d);
    const uint64_t odd = d4_gpr(w[1].d, w[3].d, w[5].d, w[7].d);
    return _mm256_cvtph_ps(_mm_set_epi64x((int64_t)odd, (int64_t)even));
}

/* int16 pair sums of 4 pairs of blocks -> one int32 per block, lanes 0,2,4,6,1,3,5,7.
 * Two pairs' halves are added as int16 first (the bounds above: 15360, then 30720
 * packed: exact), so the fold takes 3 vpmaddwd where folding each pair apart takes
 * 7: they run on the multiply pipes vpmaddubsw needs, which the few-token product
 * keeps busiest. */
FM_INLINE FM_AVX2 __m256i fold8_avx2(__m256i p0, __m256i p1, __m256i p2, __m256i p3)
{
    const __m256i one = _mm256_set1_epi16(1);
    const __m256i s01 = _mm256_add_epi16(_mm256_unpacklo_epi64(p0, p1), _mm256_unpackhi_epi64(p0, p1));
    const __m256i s23 = _mm256_add_epi16(_mm256_unpacklo_epi64(p2, p3), _mm256_unpackhi_epi64(p2, p3));
    return _mm256_madd_epi16(_mm256_packs_epi32(_mm256_madd_epi16(s01, one), _mm256_madd_epi16(s23, one)), one);
}

/* Blocks w[0] and w[1]'s nibbles in the low and high 128-bit lanes. w[0].qs is
 * bytes 2..17 of the pair, w[1].qs bytes 20..35: the low half of a 32-byte load at
 * +2 and the high half of one at +4, joined by a blend. Plain loads: no broadcast
 * or lane insert on the shuffle pipes, and nothing read past the pair. */
FM_INLINE FM_AVX2 __m256i load_pair_q4(const block_q4_0 *w)
{
    const char *p = (const char *)w;
    const __m256i a = _mm256_loadu_si256((const __m256i *)(p + 2));
    const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 4));
    return _mm256_blend_epi32(a, b, 0xF0);
}

/* The first half of a group's dot product: pair j's int16 products, low nibbles
 * by x[0..15] plus high nibbles by x[16..31] (<= 2 * 2 * 15 * 127). */
FM_INLINE FM_AVX2 void group_products_avx2(const block_q4_0 *w, const xgroup_avx2 *g, __m256i p[4])
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m256i q = load_pair_q4(w + 2 * j);
        p[j] = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(q, m4), g->xlo[j]),
                                _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), g->xhi[j]));
    }
}

/* The second half: fold to one int32 a block, correct, scale, accumulate. */
FM_INLINE FM_AVX2 __m256 group_sum_avx2(const block_q4_0 *w, const xgroup_avx2 *g, const __m256i p[4], __m256 acc)
{
    const __m256i s = _mm256_add_epi32(fold8_avx2(p[0], p[1], p[2], p[3]), g->corr);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw8_avx2(w), g->dx), acc);
}

/* ((v0+v1)+(v2+v3)) + ((v4+v5)+(v6+v7)): the association store_sums_avx2's 2x2
 * path uses too, so a row's dot product rounds the same in the matrix-vector
 * product and in every tile of the batched one. The forward is then bitwise
 * independent of how a prompt is chunked (served output = local output). */
FM_INLINE FM_AVX2 float hsum_adjacent_avx2(__m256 v)
{
    __m256 h = _mm256_hadd_ps(v, v);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
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

/* Out of line, as the dot products (tails of every row loop) always were: inlined there
 * they change gcc's schedule of those loops, slower on AVX-512. */
FM_AVX2 __attribute__((noinline)) static float fm_vec_dot_q4_0_q8_0_avx2(int n, const block_q4_0 *w,
                                                                         const block_q8_0 *x)
{
    float sum = 0.0f;
    for (int b = 0; b < n / FM_QK; b++)
        sum += (float)q4_block_sumi_avx2(w + b, x + b) * (_cvtsh_ss(w[b].d) * _cvtsh_ss(x[b].d));
    return sum;
}

/* One row straight from memory over ng >= 1 groups, software-pipelined: group k's
 * loads and products are issued beside group k-1's fold and scaling, so the long
 * dependency chain of one group overlaps the next (the out-of-order window alone
 * does not overlap them). The sum still runs in group order. */
FM_INLINE FM_AVX2 float row_q4_0_avx2(const block_q4_0 *w, const xgroup_avx2 *g, int ng)
{
    __m256 acc = _mm256_setzero_ps();
    __m256i p[4], next[4];
    fm_prefetch(w);
    group_products_avx2(w, g, p);
    for (int k = 1; k < ng; k++) {
        fm_prefetch(w + 8 * k);
        group_products_avx2(w + 8 * k, g + k, next);
        acc = group_sum_avx2(w + 8 * (k - 1), g + k - 1, p, acc);
        for (int j = 0; j < 4; j++) p[j] = next[j];
    }
    return hsum_adjacent_avx2(group_sum_avx2(w + 8 * (ng - 1), g + ng - 1, p, acc));
}

/* One row at a time: two interleaved rows read slower (two memory streams a thread
 * matter more than the extra ILP, and a group already has 4 independent chains).
 * Rows without tail blocks make no tail call: an expert's down projection has only
 * 2 groups a row, so an empty call would be a large share of its time. */
#define AVX2_Q4_KC 16           /* groups per k-chunk of fm_matmul_q4_0_avx2 */
#define AVX2_Q8_KC 8

/* T tokens' sums over ng groups (one k-chunk) of one row, g: T rows of gs groups; each
 * group's nibbles are unpacked once for all of them (the few-token product). */
FM_INLINE FM_AVX2 void row_tokens_q4_0_avx2(const block_q4_0 *w, const xgroup_avx2 *g, int gs, int ng, const int T,
                                            float *s)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[FM_FEW_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int k = 0; k < ng; k++, w += 8) {
        __m256i lo[4], hi[4];
        fm_prefetch(w);
        for (int j = 0; j < 4; j++) {
            const __m256i q = load_pair_q4(w + 2 * j);
            lo[j] = _mm256_and_si256(q, m4);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        const __m256 dw = dw8_avx2(w);
        for (int t = 0; t < T; t++) {
            const xgroup_avx2 *x = g + (size_t)t * gs + k;
            __m256i p[4];
            for (int j = 0; j < 4; j++)
                p[j] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], x->xlo[j]), _mm256_maddubs_epi16(hi[j], x->xhi[j]));
            const __m256i si = _mm256_add_epi32(fold8_avx2(p[0], p[1], p[2], p[3]), x->corr);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(dw, x->dx), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) s[t] = hsum_adjacent_avx2(acc[t]);
}

#define GROUP_MATVEC_NAME fm_matvec_q4_0_avx2
#define GROUP_FEW_NAME matmul_few_q4_0_avx2
#define GROUP_XG xgroup_avx2
#define GROUP_KC AVX2_Q4_KC
#define GROUP_PREP prepare_x_avx2
#define GROUP_ROW row_q4_0_avx2
#define GROUP_ROW_TOKENS row_tokens_q4_0_avx2
#define GROUP_DOT fm_vec_dot_q4_0_q8_0_avx2
#include "group_matvec_template.h"

/* ---------------------------------------------------------------- batched (AVX2)
 * The tiled GEMM (tiled_matmul_template.h) with 256-bit vectors: a group is 8
 * blocks, one per 32-bit lane in the order 0,2,4,6,1,3,5,7 (the low 128 bits
 * hold blocks 0,2,4,6, as dw8_avx2). Q4_0 as on SSSE3: nibbles unsigned, -8*sum(x)
 * per block, the 8 products of a group summed in int16, then 9 multiplies per 8
 * blocks where the per-pair fold of the matvec needs 15. Per 8 blocks of one row
 * and one token: 8 vpmaddubsw, 7 vpaddw, 1 vpmaddwd, 1 vpaddd, 1 convert, 1 mul,
 * 1 FMA. Q8_0: the sign trick, each product widened at once.
 * Bound by the number of vector ops, so wider register blocks (3x2 to 4x4) are no
 * faster; at a few tokens the unpacking is a large share (hence the few-token product). */
typedef struct {
    __m256i v[8];  /* v[m]: x[4m..4m+3] of the 8 blocks; v[4+m]: x[16+4m..16+4m+3] */
    __m256i corr;  /* -8 * sum(x_b), int32 per lane */
    __m256 dx;
} xt8_avx2;        /* 320 bytes: one token's group of 8 activation blocks */

typedef struct {
    __m256i v[8];  /* nibbles 0..15, element order as xt8_avx2 */
    __m256 dw;
} wt8_avx2;        /* 288 bytes: one row's group of 8 weight blocks */

typedef struct {
    __m256i v[8], a[8];  /* w and |w|, element order as xt8_avx2 */
    __m256 dw;
} wq8t8_avx2;

FM_INLINE FM_AVX2 __m256i load_2x128(const void *lo, const void *hi)
{
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                   _mm_loadu_si128((const __m128i *)hi), 1);
}

/* In-lane 4x4 transpose of 32-bit elements: a[m] lane p <- a[p] lane m (both 128-bit halves). */
FM_INLINE FM_AVX2 void transpose4_epi32_avx2(__m256i a[4])
{
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    a[0] = _mm256_unpacklo_epi64(t0, t2);
    a[1] = _mm256_unpackhi_epi64(t0, t2);
    a[2] = _mm256_unpacklo_epi64(t1, t3);
    a[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* 8 Q8_0 blocks' ints in the group layout: pair j = blocks 2j | 2j+1 in the two halves. */
FM_INLINE FM_AVX2 void load_q8_group8_avx2(const block_q8_0 *x, __m256i v[8])
{
    __m256i a[4], b[4];
    for (int j = 0; j < 4; j++) {
        a[j] = load_2x128(x[2 * j].qs, x[2 * j + 1].qs);
        b[j] = load_2x128(x[2 * j].qs + 16, x[2 * j + 1].qs + 16);
    }
    transpose4_epi32_avx2(a);
    transpose4_epi32_avx2(b);
    for (int m = 0; m < 4; m++) {
        v[m] = a[m];
        v[4 + m] = b[m];
    }
}

/* 8 Q8_0 scales (34 bytes apart) in lane order 0,2,4,6,1,3,5,7. */
FM_INLINE FM_AVX2 __m256 d8_q8_avx2(const block_q8_0 *x)
{
    const uint64_t even = d4_gpr(x[0].d, x[2].d, x[4].d, x[6].d);
    const uint64_t odd = d4_gpr(x[1].d, x[3].d, x[5].d, x[7].d);
    return _mm256_cvtph_ps(_mm_set_epi64x((int64_t)odd, (int64_t)even));
}

FM_AVX2 static void prepare_xt8_avx2(const block_q8_0 *x, int ng, xt8_avx2 *g)
{
    const __m256i one8 = _mm256_set1_epi8(1);
    for (int k = 0; k < ng; k++, x += 8) {
        load_q8_group8_avx2(x, g[k].v);
        __m256i s = _mm256_setzero_si256();  /* int16 pair sums of x: <= 8 * 2 * 127 */
        for (int m = 0; m < 8; m++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(one8, g[k].v[m]));
        g[k].corr = _mm256_madd_epi16(s, _mm256_set1_epi16(-8));
        g[k].dx = d8_q8_avx2(x);
    }
}

FM_INLINE FM_AVX2 void unpack_wt8_avx2(const block_q4_0 *w, wt8_avx2 *u)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i q[4];
    for (int j = 0; j < 4; j++) q[j] = load_2x128(w[2 * j].qs, w[2 * j + 1].qs);
    transpose4_epi32_avx2(q);
    for (int m = 0; m < 4; m++) {
        u->v[m] = _mm256_and_si256(q[m], m4);
        u->v[4 + m] = _mm256_and_si256(_mm256_srli_epi16(q[m], 4), m4);
    }
    u->dw = dw8_avx2(w);
}

FM_INLINE FM_AVX2 void unpack_wq8t8_avx2(const block_q8_0 *w, wq8t8_avx2 *u)
{
    load_q8_group8_avx2(w, u->v);
    for (int m = 0; m < 8; m++) u->a[m] = _mm256_sign_epi8(u->v[m], u->v[m]);
    u->dw = d8_q8_avx2(w);
}

/* The R x T sums of a kernel into Y (added when acc_out); 2 x 2 in one go. */
FM_INLINE FM_AVX2 void store_sums_avx2(__m256 acc[2][2], float *Y, int ldy, int acc_out, const int R, const int T)
{
    if (R == 2 && T == 2) {  /* [r0t0, r1t0, r0t1, r1t1] */
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][0], acc[1][0]), _mm256_hadd_ps(acc[0][1], acc[1][1]));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        __m64 *y0 = (__m64 *)Y, *y1 = (__m64 *)(Y + ldy);
        if (acc_out) s = _mm_add_ps(s, _mm_loadh_pi(_mm_loadl_pi(_mm_setzero_ps(), y0), y1));
        _mm_storel_pi(y0, s);
        _mm_storeh_pi(y1, s);
        return;
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float *y = Y + (size_t)t * ldy + r;
            const float v = hsum_adjacent_avx2(acc[r][t]);
            *y = acc_out ? *y + v : v;
        }
}

/* R rows (wstride groups apart) x T tokens (xstride groups apart) over nk groups. */
FM_INLINE FM_AVX2 void kernel_q4_avx2(const wt8_avx2 *w, int wstride, const xt8_avx2 *x, int xstride, int nk,
                                      float *Y, int ldy, int acc_out, const int R, const int T)
{
    const __m256i one16 = _mm256_set1_epi16(1);
    __m256 acc[2][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (int k = 0; k < nk; k++) {
        __m256i p[2][2];
        for (int m = 0; m < 8; m++) {
            __m256i wv[2], xv[2];
            for (int r = 0; r < R; r++) {
                wv[r] = _mm256_load_si256(&w[(size_t)r * wstride + k].v[m]);
                FM_KEEP(wv[r]);
            }
            for (int t = 0; t < T; t++) {
                xv[t] = _mm256_load_si256(&x[(size_t)t * xstride + k].v[m]);
                FM_KEEP(xv[t]);
            }
            for (int r = 0; r < R; r++)
                for (int t = 0; t < T; t++) {
                    const __m256i q = _mm256_maddubs_epi16(wv[r], xv[t]);
                    p[r][t] = m ? _mm256_add_epi16(p[r][t], q) : q;
                    FM_KEEP(p[r][t]);
                }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) {
                const xt8_avx2 *xg = &x[(size_t)t * xstride + k];
                const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(p[r][t], one16), xg->corr);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w[(size_t)r * wstride + k].dw, xg->dx),
                                            acc[r][t]);
            }
    }
    store_sums_avx2(acc, Y, ldy, acc_out, R, T);
}

FM_INLINE FM_AVX2 void kernel_q8_avx2(const wq8t8_avx2 *w, int wstride, const xt8_avx2 *x, int xstride, int nk,
                                      float *Y, int ldy, int acc_out, const int R, const int T)
{
    const __m256i one16 = _mm256_set1_epi16(1);
    __m256 acc[2][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (int k = 0; k < nk; k++) {
        __m256i s[2][2];
        for (int m = 0; m < 8; m++) {
            __m256i av[2], xv[2];
            for (int r = 0; r < R; r++) {
                av[r] = _mm256_load_si256(&w[(size_t)r * wstride + k].a[m]);
                FM_KEEP(av[r]);
            }
            for (int t = 0; t < T; t++) {
                xv[t] = _mm256_load_si256(&x[(size_t)t * xstride + k].v[m]);
                FM_KEEP(xv[t]);
            }
            for (int r = 0; r < R; r++)
                for (int t = 0; t < T; t++) {
                    const __m256i sx = _mm256_sign_epi8(xv[t], w[(size_t)r * wstride + k].v[m]);
                    const __m256i q = _mm256_madd_epi16(_mm256_maddubs_epi16(av[r], sx), one16);
                    s[r][t] = m ? _mm256_add_epi32(s[r][t], q) : q;
                    FM_KEEP(s[r][t]);
                }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][t]),
                                            _mm256_mul_ps(w[(size_t)r * wstride + k].dw, x[(size_t)t * xstride + k].dx),
                                            acc[r][t]);
    }
    store_sums_avx2(acc, Y, ldy, acc_out, R, T);
}

#define TILED_NAME matmul_tiled_q4_0_avx2
#define TILED_W block_q4_0
#define TILED_WT wt8_avx2
#define TILED_XT xt8_avx2
#define TILED_KC AVX2_Q4_KC
#define TILED_RB 2
#define TILED_PREP prepare_xt8_avx2
#define TILED_UNPACK unpack_wt8_avx2
#define TILED_KERNEL kernel_q4_avx2
#define TILED_DOT fm_vec_dot_q4_0_q8_0_avx2
#define TILED_MATVEC fm_matvec_q4_0_avx2
#include "tiled_matmul_template.h"

/* A few tokens (group_matvec_template.h) on rows of at least FM_FEW_MIN_COLS columns:
 * faster than the tiled product for a decode round of 2 to 4 sequences and an
 * expert's gate and up, not on an expert's down projection (512 columns), whose short
 * rows stay tiled. */
FM_AVX2 static void fm_matmul_q4_0_avx2(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy,
                                        int r0, int r1)
{
    if (B >= 2 && B <= FM_FEW_TOKENS && cols >= FM_FEW_MIN_COLS) matmul_few_q4_0_avx2(W, X, Y, cols, B, ldy, r0, r1);
    else matmul_tiled_q4_0_avx2(W, X, Y, cols, B, ldy, r0, r1);
}

/* Q8_0 x Q8_0: 34-byte blocks leave more time per byte; the sign trick per block is enough. */
FM_INLINE FM_AVX2 __m256 q8_block_avx2(const block_q8_0 *w, __m256i xq, float s, __m256 acc)
{
    const __m256i wq = _mm256_loadu_si256((const __m256i *)w->qs);
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
    const __m256i i = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(s), acc);
}

FM_AVX2 __attribute__((noinline)) static float fm_vec_dot_q8_0_q8_0_avx2(int n, const block_q8_0 *w,
                                                                         const block_q8_0 *x)
{
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / FM_QK; b++)
        acc = q8_block_avx2(w + b, _mm256_loadu_si256((const __m256i *)x[b].qs),
                            _cvtsh_ss(w[b].d) * _cvtsh_ss(x[b].d), acc);
    return hsum_adjacent_avx2(acc);
}

/* One block's 32 products as 8 int32 partial sums (the sign trick, as q8_block_avx2). */
FM_INLINE FM_AVX2 __m256i q8_partials_avx2(const block_q8_0 *w, const block_q8_0 *x)
{
    const __m256i wq = _mm256_loadu_si256((const __m256i *)w->qs), xq = _mm256_loadu_si256((const __m256i *)x->qs);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq)),
                             _mm256_set1_epi16(1));
}

/* The exact int32 totals of 8 blocks in the batched product's lane order
 * 0,2,4,6,1,3,5,7: two rounds of vphaddd leave each block's low and high halves
 * in the two 128-bit lanes, one add of the lanes swapped into place finishes. */
FM_INLINE FM_AVX2 __m256i q8_group_totals_avx2(const block_q8_0 *w, const block_q8_0 *x)
{
    __m256i v[8];
    for (int j = 0; j < 8; j++) v[j] = q8_partials_avx2(w + lane_block8[j], x + lane_block8[j]);
    const __m256i even = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i odd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(even, odd, 0x20), _mm256_permute2x128_si256(even, odd, 0x31));
}

/* As the batched product computes a row for one token (see fm_matvec_q4_0_avx2), by
 * hand: unpacking each row into the tiled layout (as fm_matvec_q8_0_avx512vnni does)
 * is slower here.
 * acc += float(block totals) * (d_w * d_x) per group of 8 blocks, one horizontal
 * sum per AVX2_Q8_KC groups, the tail blocks last. */
FM_AVX2 static void fm_matvec_q8_0_avx2(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    const int nb = cols / FM_QK, ng = nb / 8;
    __m256 dx[CHUNK_BLOCKS / 8];
    _Static_assert(CHUNK_BLOCKS / 8 % AVX2_Q8_KC == 0, "an activation chunk holds whole k-chunks");
    for (int k0 = 0; k0 < ng; k0 += CHUNK_BLOCKS / 8) {
        const int nk = imin(CHUNK_BLOCKS / 8, ng - k0);
        const block_q8_0 *xc = x + 8 * k0;
        for (int k = 0; k < nk; k++) dx[k] = d8_q8_avx2(xc + 8 * k);
        for (int r = r0; r < r1; r++) {
            const block_q8_0 *w = W + (size_t)r * nb + 8 * k0;
            float v = k0 ? y[r] : 0.0f;
            for (int kc = 0; kc < nk; kc += AVX2_Q8_KC) {
                __m256 acc = _mm256_setzero_ps();
                for (int k = kc; k < imin(kc + AVX2_Q8_KC, nk); k++) {
                    fm_prefetch(w + 8 * k);
                    fm_prefetch((const char *)(w + 8 * k) + 192);
                    const __m256 d = _mm256_mul_ps(d8_q8_avx2(w + 8 * k), dx[k]);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_group_totals_avx2(w + 8 * k, xc + 8 * k)), d, acc);
                }
                const float s = hsum_adjacent_avx2(acc);
                v = k0 + kc ? v + s : s;
            }
            y[r] = v;
        }
    }
    matvec_tail_q8_0(fm_vec_dot_q8_0_q8_0_avx2, W, x, y, cols, 8, r0, r1);
}

#define TILED_NAME fm_matmul_q8_0_avx2
#define TILED_W block_q8_0
#define TILED_WT wq8t8_avx2
#define TILED_XT xt8_avx2
#define TILED_KC AVX2_Q8_KC
#define TILED_RB 2
#define TILED_PREP prepare_xt8_avx2
#define TILED_UNPACK unpack_wq8t8_avx2
#define TILED_KERNEL kernel_q8_avx2
#define TILED_DOT fm_vec_dot_q8_0_q8_0_avx2
#define TILED_MATVEC fm_matvec_q8_0_avx2
#include "tiled_matmul_template.h"


/* ---------------------------------------------------------------- F32 and F16 (AVX2 + FMA + F16C)
 * The F32/F16 tensors are the small ones (norm-adjacent vectors, the router): these
 * only need to stay memory-bound. */

/* (v0+v4)+(v2+v6) and (v1+v5)+(v3+v7), then those two added. */
FM_INLINE FM_AVX2 float hsum_halves_avx2(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 floats of a row from element i: fp16 widened when f16 is set, else fp32 (f16 is a
 * constant wherever this is inlined). */
FM_INLINE FM_AVX2 __m256 load8_avx2(const void *row, int f16, int i)
{
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)))
               : _mm256_loadu_ps((const float *)row + i);
}

/* w . x over n elements of fp16 (f16 set) or fp32 weights. Four accumulators hide the
 * FMA latency; prefetch as the quantised loops do (one call covers 192 B: 32 F32 =
 * 128 B, 32 F16 = 64 B per step). */
FM_INLINE FM_AVX2 float dot_avx2(int n, const void *w, const int f16, const float *x)
{
    const size_t esize = f16 ? 2 : 4;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int j = 0;
    for (; j + 32 <= n; j += 32) {
        fm_prefetch((const char *)w + j * esize);
        a0 = _mm256_fmadd_ps(load8_avx2(w, f16, j), _mm256_loadu_ps(x + j), a0);
        a1 = _mm256_fmadd_ps(load8_avx2(w, f16, j + 8), _mm256_loadu_ps(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(load8_avx2(w, f16, j + 16), _mm256_loadu_ps(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(load8_avx2(w, f16, j + 24), _mm256_loadu_ps(x + j + 24), a3);
    }
    float sum = hsum_halves_avx2(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; j < n; j++) sum += (f16 ? _cvtsh_ss(((const uint16_t *)w)[j]) : ((const float *)w)[j]) * x[j];
    return sum;
}

FM_AVX2 static float dot_f32_avx2(int n, const float *w, const float *x) { return dot_avx2(n, w, 0, x); }
FM_AVX2 static float dot_f16_avx2(int n, const uint16_t *w, const float *x) { return dot_avx2(n, w, 1, x); }

FM_AVX2 static void fm_matvec_f32_avx2(const float *W, const float *x, float *y, int cols, int r0, int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f32_avx2(cols, W + (size_t)r * cols, x);
}

FM_AVX2 static void fm_matvec_f16_avx2(const uint16_t *W, const float *x, float *y, int cols, int r0, int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f16_avx2(cols, W + (size_t)r * cols, x);
}

/* Batched F32 is row by row with the same dot product as the matrix-vector one:
 * each (row, token) then rounds identically whatever the batch, which keeps the
 * forward bitwise independent of prompt chunking. F32 matrices are small here
 * (routers), so a register-blocked version would not pay for that. */
FM_AVX2 static void fm_matmul_f32_avx2(const float *W, const float *X, float *Y, int cols, int B, int ldy, int r0,
                                       int r1)
{
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = dot_f32_avx2(cols, W + (size_t)r * cols, X + (size_t)b * cols);
}

/* fp16 <-> fp32 rows with F16C, 8 at a time: exact one way, round to nearest even
 * the other, as fm_fp16_to_fp32 / fm_fp32_to_fp16 (and numpy) round. */
FM_AVX2 void fm_fp16_to_fp32_row_avx2(const uint16_t *x, float *y, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = _cvtsh_ss(x[i]);
}

FM_AVX2 void fm_fp32_to_fp16_row_avx2(const float *x, uint16_t *y, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = fm_fp32_to_fp16(x[i]);
}

/* ---------------------------------------------------------------- attention (AVX2 + F16C)
 * Register tiles of 4 query heads (of a grouped-query KV head's G): each q.k keeps its
 * own 8-lane accumulator along the head dimension and one hsum8x8 reduction, and each
 * head's weighted sum its own FMA chain over the positions in order, so every result is
 * the same whichever tile computed it (and whatever G or n the call had).
 * Scores: 4 heads x 3 positions, 12 accumulators, 7 loads for 12 FMAs (one K row against
 * all G heads needs a q load per FMA); then 4 heads x 1 position for n % 3, and 1-3 heads
 * (G % 4) one position at a time. Weighted sum: 4 heads x 24 floats of the head
 * dimension stay in registers over all n positions, 3 V loads (fp16 widened on the way)
 * and 4 broadcasts for 12 FMAs. Needs hd % 8 == 0, else the scalar kernels run.
 * The scores prefetch the K rows SCORE_PF_ROWS positions ahead: rows are a page stride
 * apart, beyond the hardware prefetcher, so at long contexts the scores would wait
 * on memory. */
#define SCORE_PF_ROWS 6

/* The 8 sums of a[0..7], in that order, with one hadd tree: lane l of a[h] holds the
 * terms i = l (mod 8), summed ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). */
FM_INLINE FM_AVX2 __m256 hsum8x8(const __m256 a[8])
{
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

FM_INLINE FM_AVX2 void score_pf(const void *const *rows, int f16, int n, int hd, int j)
{
    if (j + SCORE_PF_ROWS >= n) return;
    const size_t row_bytes = (size_t)hd * (f16 ? 2 : 4);
    for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((const char *)rows[j + SCORE_PF_ROWS] + o, 0, 3);
}

/* s[h * lds + j + c] = q_h . k_{j+c} for 4 heads h and the C <= 3 positions from j. */
FM_INLINE FM_AVX2 void scores_4xC(const float *q, int qstride, const void *const *rows, int f16, int hd, float *s,
                                  int lds, int j, const int C)
{
    __m256 a[12];
    for (int x = 0; x < 12; x++) a[x] = _mm256_setzero_ps();
    const void *r0 = rows[j], *r1 = rows[j + (C > 1)], *r2 = rows[j + (C > 2) * 2];
    for (int i = 0; i < hd; i += 8) {
        const __m256 k0 = load8_avx2(r0, f16, i);
        const __m256 k1 = C > 1 ? load8_avx2(r1, f16, i) : k0;
        const __m256 k2 = C > 2 ? load8_avx2(r2, f16, i) : k0;
        for (int h = 0; h < 4; h++) {
            const __m256 qv = _mm256_loadu_ps(q + (size_t)h * qstride + i);
            a[h * C] = _mm256_fmadd_ps(qv, k0, a[h * C]);
            if (C > 1) a[h * C + 1] = _mm256_fmadd_ps(qv, k1, a[h * C + 1]);
            if (C > 2) a[h * C + 2] = _mm256_fmadd_ps(qv, k2, a[h * C + 2]);
        }
    }
    float out[16];
    _mm256_storeu_ps(out, hsum8x8(a));
    if (C > 2) {
        const __m256 b[8] = {a[8], a[9], a[10], a[11], a[8], a[9], a[10], a[11]};
        _mm256_storeu_ps(out + 8, hsum8x8(b));
    }
    for (int h = 0; h < 4; h++)
        for (int c = 0; c < C; c++) s[(size_t)h * lds + j + c] = out[h * C + c];
}

/* s[h * lds] = q_h . row for NH <= 8 heads. */
FM_INLINE FM_AVX2 void scores_heads(const float *q, int qstride, const void *row, int f16, int hd, float *s, int lds,
                                    const int NH)
{
    __m256 a[8];
    for (int h = 0; h < 8; h++) a[h] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        const __m256 k = load8_avx2(row, f16, i);
        for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * qstride + i), k, a[h]);
    }
    float out[8];
    _mm256_storeu_ps(out, hsum8x8(a));
    for (int h = 0; h < NH; h++) s[(size_t)h * lds] = out[h];
}

FM_INLINE FM_AVX2 void scores_rows(const float *q, int qstride, int G, const void *const *rows, const int f16, int n,
                                   int hd, float *s, int lds)
{
    int h0 = 0;
    for (; h0 + 4 <= G; h0 += 4) {
        const float *qh = q + (size_t)h0 * qstride;
        float *sh = s + (size_t)h0 * lds;
        int j = 0;
        for (; j + 3 <= n; j += 3) {
            score_pf(rows, f16, n, hd, j);
            score_pf(rows, f16, n, hd, j + 1);
            score_pf(rows, f16, n, hd, j + 2);
            scores_4xC(qh, qstride, rows, f16, hd, sh, lds, j, 3);
        }
        for (; j < n; j++) scores_4xC(qh, qstride, rows, f16, hd, sh, lds, j, 1);
    }
    const int nh = G - h0;
    const float *qh = q + (size_t)h0 * qstride;
    float *sh = s + (size_t)h0 * lds;
    for (int j = 0; j < n && nh; j++) {
        switch (nh) {
        case 3: scores_heads(qh, qstride, rows[j], f16, hd, sh + j, lds, 3); break;
        case 2: scores_heads(qh, qstride, rows[j], f16, hd, sh + j, lds, 2); break;
        default: scores_heads(qh, qstride, rows[j], f16, hd, sh + j, lds, 1);
        }
    }
}

/* acc[h * hd + i + 8b] += p[h * ldp + j] * v_j[i + 8b] over j in order, NH <= 4 heads,
 * I <= 3 runs of 8 floats. */
FM_INLINE FM_AVX2 void accumulate_tile(const float *p, int ldp, const void *const *rows, int f16, int n, int hd,
                                       float *acc, int i, const int NH, const int I)
{
    __m256 a[4][3];
    for (int h = 0; h < NH; h++)
        for (int b = 0; b < I; b++) a[h][b] = _mm256_loadu_ps(acc + (size_t)h * hd + i + 8 * b);
    for (int j = 0; j < n; j++) {
        __m256 v[3];
        for (int b = 0; b < I; b++) v[b] = load8_avx2(rows[j], f16, i + 8 * b);
        for (int h = 0; h < NH; h++) {
            const __m256 w = _mm256_broadcast_ss(p + (size_t)h * ldp + j);
            for (int b = 0; b < I; b++) a[h][b] = _mm256_fmadd_ps(w, v[b], a[h][b]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int b = 0; b < I; b++) _mm256_storeu_ps(acc + (size_t)h * hd + i + 8 * b, a[h][b]);
}

/* All of hd for NH <= 4 heads: 24 floats at a time, then 8. */
FM_INLINE FM_AVX2 void accumulate_heads(const float *p, int ldp, const void *const *rows, int f16, int n, int hd,
                                        float *acc, const int NH)
{
    int i = 0;
    for (; i + 24 <= hd; i += 24) accumulate_tile(p, ldp, rows, f16, n, hd, acc, i, NH, 3);
    for (; i < hd; i += 8) accumulate_tile(p, ldp, rows, f16, n, hd, acc, i, NH, 1);
}

FM_INLINE FM_AVX2 void accumulate_rows(const float *p, int ldp, int G, const void *const *rows, const int f16, int n,
                                       int hd, float *acc)
{
    for (int h0 = 0; h0 < G; h0 += 4) {
        const float *ph = p + (size_t)h0 * ldp;
        float *ah = acc + (size_t)h0 * hd;
        switch (G - h0) {
        case 3: accumulate_heads(ph, ldp, rows, f16, n, hd, ah, 3); break;
        case 2: accumulate_heads(ph, ldp, rows, f16, n, hd, ah, 2); break;
        case 1: accumulate_heads(ph, ldp, rows, f16, n, hd, ah, 1); break;
        default: accumulate_heads(ph, ldp, rows, f16, n, hd, ah, 4);
        }
    }
}

FM_AVX2 void fm_attn_scores_avx2(const float *q, int qstride, int G, const void *const *rows, int f16, int n, int hd,
                                 float *s, int lds)
{
    if (hd % 8) fm_attn_scores_scalar(q, qstride, G, rows, f16, n, hd, s, lds);
    else if (f16) scores_rows(q, qstride, G, rows, 1, n, hd, s, lds);
    else scores_rows(q, qstride, G, rows, 0, n, hd, s, lds);
}

FM_AVX2 void fm_attn_accumulate_avx2(const float *p, int ldp, int G, const void *const *rows, int f16, int n, int hd,
                                     float *acc)
{
    if (hd % 8) fm_attn_accumulate_scalar(p, ldp, G, rows, f16, n, hd, acc);
    else if (f16) accumulate_rows(p, ldp, G, rows, 1, n, hd, acc);
    else accumulate_rows(p, ldp, G, rows, 0, n, hd, acc);
}

/* ---------------------------------------------------------------- Q8_0 quantiser (AVX2)
 * Bit-exact with the scalar one: the same fp32 d and 1/d, and roundf's
 * half-away-from-zero rebuilt from round-to-nearest-even plus a tie fix (as
 * shared.quants does). Blocks holding inf/NaN or a tiny max take the scalar path. */

FM_INLINE FM_AVX2 __m256i round_half_away_epi32(__m256 v)
{
    const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
    __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* v - r is exact; a tie sent toward zero leaves +-0.5 with v's sign */
    const __m256 tie = _mm256_cmp_ps(_mm256_sub_ps(v, r), _mm256_or_ps(sign, _mm256_set1_ps(0.5f)), _CMP_EQ_OQ);
    r = _mm256_add_ps(r, _mm256_and_ps(tie, _mm256_or_ps(sign, _mm256_set1_ps(1.0f))));
    return _mm256_cvtps_epi32(r);
}

FM_AVX2 void fm_quantize_row_q8_0_avx2(const float *x, block_q8_0 *y, int n)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < n / FM_QK; b++) {
        const float *xb = x + b * FM_QK;
        __m256 v[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            m = _mm256_max_ps(m, _mm256_and_ps(v[k], abs_mask));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        if (_mm256_movemask_ps(nan) || !isfinite(d) || isinf(id)) {
            fm_quantize_row_q8_0_scalar(xb, y + b, FM_QK);
            continue;
        }
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = round_half_away_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
        /* packs work per 128-bit lane: undo their interleave with one dword permute */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)y[b].qs, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        y[b].d = fm_fp32_to_fp16(d);
    }
}

const fm_kernels fm_kernels_avx2 = {
    .quantize_row_q8_0 = fm_quantize_row_q8_0_avx2,
    .dot_q4_0_q8_0 = fm_vec_dot_q4_0_q8_0_avx2,
    .dot_q8_0_q8_0 = fm_vec_dot_q8_0_q8_0_avx2,
    .matvec_q4_0 = fm_matvec_q4_0_avx2,
    .matvec_q8_0 = fm_matvec_q8_0_avx2,
    .matvec_f32 = fm_matvec_f32_avx2,
    .matvec_f16 = fm_matvec_f16_avx2,
    .matmul_q4_0 = fm_matmul_q4_0_avx2,
    .matmul_q8_0 = fm_matmul_q8_0_avx2,
    .matmul_f32 = fm_matmul_f32_avx2,
    .fp16_to_fp32_row = fm_fp16_to_fp32_row_avx2,
    .fp32_to_fp16_row = fm_fp32_to_fp16_row_avx2,
    .attn_scores = fm_attn_scores_avx2,
    .attn_accumulate = fm_attn_accumulate_avx2,
};
