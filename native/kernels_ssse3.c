/* kernels_ssse3.c: the SSSE3 kernels (the paper's pmaddubsw kernel): the integer
 * dot products, the matrix-vector, few-token and tiled batched products, and the
 * F32 products with SSE; the table of the ssse3 ISA.
 */
#include "x86.h"

#define FM_TARGET FM_SSSE3  /* for the templates */
#define FM_GB 4             /* blocks a group: one per 32-bit lane of a 128-bit vector */

/* ================================================================ SSSE3
 * One Q4_0 x Q8_0 block (layouts in fermoe_blocks.h): unpack nibbles, subtract 8;
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

/* (v0+v1)+(v2+v3): the association of store_sums_ssse3's 2x2 path (two rounds of
 * haddps), so a row rounds alike in the matrix-vector and the batched product. */
FM_INLINE FM_SSSE3 float hsum_adjacent_ssse3(__m128 v)
{
    v = _mm_hadd_ps(v, v);
    return _mm_cvtss_f32(_mm_hadd_ps(v, v));
}

/* acc + isum * s: SSSE3 has no FMA, so mul + add (and no F16C: the scales come from
 * the portable fp16 helper). */
FM_INLINE FM_SSSE3 __m128 scale_add_ssse3(__m128 acc, __m128i isum, float s)
{
    return _mm_add_ps(acc, _mm_mul_ps(_mm_cvtepi32_ps(isum), _mm_set1_ps(s)));
}

/* Out of line, as the dot products (tails of every row loop) always were: inlined there
 * they change gcc's schedule of those loops, slower on AVX-512. */
FM_SSSE3 __attribute__((noinline)) static float fm_vec_dot_q4_0_q8_0_ssse3(int n, const block_q4_0 *w,
                                                                           const block_q8_0 *x)
{
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < n / FM_QK; b++) {
        const __m128i x0 = _mm_loadu_si128((const __m128i *)x[b].qs);
        const __m128i x1 = _mm_loadu_si128((const __m128i *)(x[b].qs + 16));
        acc = scale_add_ssse3(acc, q4_block_ssse3(w + b, x0, x1), fm_fp16_to_fp32(w[b].d) * fm_fp16_to_fp32(x[b].d));
    }
    return hsum_adjacent_ssse3(acc);
}

FM_SSSE3 __attribute__((noinline)) static float fm_vec_dot_q8_0_q8_0_ssse3(int n, const block_q8_0 *w,
                                                                           const block_q8_0 *x)
{
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < n / FM_QK; b++) {
        const __m128i x0 = _mm_loadu_si128((const __m128i *)x[b].qs);
        const __m128i x1 = _mm_loadu_si128((const __m128i *)(x[b].qs + 16));
        acc = scale_add_ssse3(acc, q8_block_ssse3(w + b, x0, x1), fm_fp16_to_fp32(w[b].d) * fm_fp16_to_fp32(x[b].d));
    }
    return hsum_adjacent_ssse3(acc);
}

#define SSSE3_Q4_KC 32          /* groups per k-chunk of fm_matmul_q4_0_ssse3 */
#define SSSE3_Q8_KC 16


/* ---------------------------------------------------------------- batched (SSSE3)
 * The tiled GEMM (tiled_matmul_template.h) with 128-bit vectors: a group is 4
 * blocks, lane p = block p. Q4_0: the nibbles (0..15) are pmaddubsw's unsigned
 * operand, the -8 offset a per-block correction -8*sum(x) (int32), and the 8
 * int16 products of a group are summed in int16: <= 8 * 2 * 15 * 127 = 30480,
 * no saturation. Q8_0: the sign trick (|w|, x signed by w), each product widened
 * to int32 at once (a pair sum can reach 32512). SSSE3 has no FMA: mul + add. */
typedef struct {
    __m128i v[8];  /* v[m]: x[4m..4m+3] of blocks 0..3; v[4+m]: x[16+4m..16+4m+3] */
    __m128i corr;  /* -8 * sum(x_b) */
    __m128 dx;
} xt4_ssse3;

typedef struct {
    __m128i v[8];  /* nibbles 0..15, element order as xt4_ssse3 */
    __m128 dw;
} wt4_ssse3;

typedef struct {
    __m128i v[8], a[8];  /* w and |w|, element order as xt4_ssse3 */
    __m128 dw;
} wq8t4_ssse3;

/* 4x4 transpose of 32-bit elements: a[m] element p <- a[p] element m. */
FM_INLINE FM_SSSE3 void transpose4_epi32_ssse3(__m128i a[4])
{
    const __m128i t0 = _mm_unpacklo_epi32(a[0], a[1]), t1 = _mm_unpackhi_epi32(a[0], a[1]);
    const __m128i t2 = _mm_unpacklo_epi32(a[2], a[3]), t3 = _mm_unpackhi_epi32(a[2], a[3]);
    a[0] = _mm_unpacklo_epi64(t0, t2);
    a[1] = _mm_unpackhi_epi64(t0, t2);
    a[2] = _mm_unpacklo_epi64(t1, t3);
    a[3] = _mm_unpackhi_epi64(t1, t3);
}

/* 4 Q8_0 blocks' 32 ints in the group layout: v[0..3] from bytes 0..15, v[4..7] from 16..31. */
FM_INLINE FM_SSSE3 void load_q8_group4_ssse3(const block_q8_0 *x, __m128i v[8])
{
    __m128i a[4], b[4];
    for (int j = 0; j < 4; j++) {
        a[j] = _mm_loadu_si128((const __m128i *)x[j].qs);
        b[j] = _mm_loadu_si128((const __m128i *)(x[j].qs + 16));
    }
    transpose4_epi32_ssse3(a);
    transpose4_epi32_ssse3(b);
    for (int m = 0; m < 4; m++) {
        v[m] = a[m];
        v[4 + m] = b[m];
    }
}

/* Four fp16 scales to fp32 at once, exactly as fm_fp16_to_fp32 (SSSE3 CPUs have no
 * F16C): magnitude bits moved into place and scaled by 2^112 (exact for normals and
 * subnormals alike), exponent forced to all ones for inf/NaN, sign put back. */
FM_INLINE FM_SSSE3 __m128 d4_ssse3(uint16_t d0, uint16_t d1, uint16_t d2, uint16_t d3)
{
    const __m128i h = _mm_set_epi32(d3, d2, d1, d0);
    const __m128i em = _mm_and_si128(h, _mm_set1_epi32(0x7fff));
    const __m128 f = _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(em, 13)), _mm_castsi128_ps(_mm_set1_epi32(0x77800000)));
    const __m128i infnan = _mm_and_si128(_mm_cmpgt_epi32(em, _mm_set1_epi32(0x7bff)), _mm_set1_epi32(0x7f800000));
    const __m128i sign = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16);
    return _mm_castsi128_ps(_mm_or_si128(_mm_or_si128(_mm_castps_si128(f), infnan), sign));
}

FM_SSSE3 static void prepare_xt4_ssse3(const block_q8_0 *x, int ng, xt4_ssse3 *g)
{
    const __m128i one8 = _mm_set1_epi8(1);
    for (int k = 0; k < ng; k++, x += 4) {
        load_q8_group4_ssse3(x, g[k].v);
        __m128i s = _mm_setzero_si128();  /* int16 pair sums of x: <= 8 * 2 * 127 */
        for (int m = 0; m < 8; m++) s = _mm_add_epi16(s, _mm_maddubs_epi16(one8, g[k].v[m]));
        g[k].corr = _mm_madd_epi16(s, _mm_set1_epi16(-8));
        g[k].dx = d4_ssse3(x[0].d, x[1].d, x[2].d, x[3].d);
    }
}

FM_INLINE FM_SSSE3 void unpack_wt4_ssse3(const block_q4_0 *w, wt4_ssse3 *u)
{
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i q[4];
    for (int j = 0; j < 4; j++) q[j] = _mm_loadu_si128((const __m128i *)w[j].qs);
    transpose4_epi32_ssse3(q);
    for (int m = 0; m < 4; m++) {
        u->v[m] = _mm_and_si128(q[m], m4);
        u->v[4 + m] = _mm_and_si128(_mm_srli_epi16(q[m], 4), m4);
    }
    u->dw = d4_ssse3(w[0].d, w[1].d, w[2].d, w[3].d);
}

FM_INLINE FM_SSSE3 void unpack_wq8t4_ssse3(const block_q8_0 *w, wq8t4_ssse3 *u)
{
    load_q8_group4_ssse3(w, u->v);
    for (int m = 0; m < 8; m++) u->a[m] = _mm_sign_epi8(u->v[m], u->v[m]);
    u->dw = d4_ssse3(w[0].d, w[1].d, w[2].d, w[3].d);
}

/* The R x T sums of a kernel into Y (added when acc_out); 2 x 2 in one go. */
FM_INLINE FM_SSSE3 void store_sums_ssse3(__m128 acc[2][2], float *Y, int ldy, int acc_out, const int R, const int T)
{
    if (R == 2 && T == 2) {  /* [r0t0, r1t0, r0t1, r1t1] */
        __m128 s = _mm_hadd_ps(_mm_hadd_ps(acc[0][0], acc[1][0]), _mm_hadd_ps(acc[0][1], acc[1][1]));
        __m64 *y0 = (__m64 *)Y, *y1 = (__m64 *)(Y + ldy);
        if (acc_out) s = _mm_add_ps(s, _mm_loadh_pi(_mm_loadl_pi(_mm_setzero_ps(), y0), y1));
        _mm_storel_pi(y0, s);
        _mm_storeh_pi(y1, s);
        return;
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            float *y = Y + (size_t)t * ldy + r;
            const float v = hsum_adjacent_ssse3(acc[r][t]);
            *y = acc_out ? *y + v : v;
        }
}

/* R rows (wstride groups apart) x T tokens (xstride groups apart) over nk groups. */
FM_INLINE FM_SSSE3 void kernel_q4_ssse3(const wt4_ssse3 *w, int wstride, const xt4_ssse3 *x, int xstride, int nk,
                                        float *Y, int ldy, int acc_out, const int R, const int T)
{
    const __m128i one16 = _mm_set1_epi16(1);
    __m128 acc[2][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm_setzero_ps();
    for (int k = 0; k < nk; k++) {
        __m128i p[2][2];
        for (int m = 0; m < 8; m++) {
            __m128i wv[2], xv[2];
            for (int r = 0; r < R; r++) {
                wv[r] = _mm_load_si128(&w[(size_t)r * wstride + k].v[m]);
                FM_KEEP(wv[r]);
            }
            for (int t = 0; t < T; t++) {
                xv[t] = _mm_load_si128(&x[(size_t)t * xstride + k].v[m]);
                FM_KEEP(xv[t]);
            }
            for (int r = 0; r < R; r++)
                for (int t = 0; t < T; t++) {
                    const __m128i q = _mm_maddubs_epi16(wv[r], xv[t]);
                    p[r][t] = m ? _mm_add_epi16(p[r][t], q) : q;
                    FM_KEEP(p[r][t]);
                }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) {
                const xt4_ssse3 *xg = &x[(size_t)t * xstride + k];
                const __m128i s = _mm_add_epi32(_mm_madd_epi16(p[r][t], one16), xg->corr);
                const __m128 d = _mm_mul_ps(w[(size_t)r * wstride + k].dw, xg->dx);
                acc[r][t] = _mm_add_ps(acc[r][t], _mm_mul_ps(_mm_cvtepi32_ps(s), d));
            }
    }
    store_sums_ssse3(acc, Y, ldy, acc_out, R, T);
}

FM_INLINE FM_SSSE3 void kernel_q8_ssse3(const wq8t4_ssse3 *w, int wstride, const xt4_ssse3 *x, int xstride, int nk,
                                        float *Y, int ldy, int acc_out, const int R, const int T)
{
    const __m128i one16 = _mm_set1_epi16(1);
    __m128 acc[2][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm_setzero_ps();
    for (int k = 0; k < nk; k++) {
        __m128i s[2][2];
        for (int m = 0; m < 8; m++) {
            __m128i av[2], xv[2];
            for (int r = 0; r < R; r++) {
                av[r] = _mm_load_si128(&w[(size_t)r * wstride + k].a[m]);
                FM_KEEP(av[r]);
            }
            for (int t = 0; t < T; t++) {
                xv[t] = _mm_load_si128(&x[(size_t)t * xstride + k].v[m]);
                FM_KEEP(xv[t]);
            }
            for (int r = 0; r < R; r++)
                for (int t = 0; t < T; t++) {
                    const __m128i sx = _mm_sign_epi8(xv[t], w[(size_t)r * wstride + k].v[m]);
                    const __m128i q = _mm_madd_epi16(_mm_maddubs_epi16(av[r], sx), one16);
                    s[r][t] = m ? _mm_add_epi32(s[r][t], q) : q;
                    FM_KEEP(s[r][t]);
                }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < T; t++) {
                const __m128 d = _mm_mul_ps(w[(size_t)r * wstride + k].dw, x[(size_t)t * xstride + k].dx);
                acc[r][t] = _mm_add_ps(acc[r][t], _mm_mul_ps(_mm_cvtepi32_ps(s[r][t]), d));
            }
    }
    store_sums_ssse3(acc, Y, ldy, acc_out, R, T);
}

/* ---------------------------------------------------------------- matrix-vector (SSSE3)
 * Q4_0 straight from the GGUF layout, as on AVX2: a group is 4 blocks, each
 * block's nibbles multiplied by its own activation bytes, then the 8 int16 sums of
 * each block folded as fold8_avx2 folds them (halves added as int16, pmaddwd,
 * packssdw, pmaddwd: <= 30480 before the last, no saturation; a little faster than
 * three phaddw) to one int32 in lane p = block p. That is the batched kernel's
 * integer, scaled and summed in its order, so every row rounds as in the batched
 * product; it skips the batched layout's transposes and tile stores, which counts
 * because SSSE3 is compute-bound even from memory. */
typedef struct {
    __m128i xlo[4], xhi[4]; /* block p's x[0..15] and x[16..31] */
    __m128i corr;           /* -8 * sum(x_p) */
    __m128 dx;
} xgroup_ssse3;

FM_SSSE3 __attribute__((noinline)) static void prepare_x_ssse3(const block_q8_0 *x, int ng, xgroup_ssse3 *g)
{
    const __m128i one8 = _mm_set1_epi8(1);
    for (int k = 0; k < ng; k++, x += 4) {
        __m128i sx[4];  /* int16 pair sums of block p's x: <= 2 * 2 * 127 */
        for (int p = 0; p < 4; p++) {
            g[k].xlo[p] = _mm_loadu_si128((const __m128i *)x[p].qs);
            g[k].xhi[p] = _mm_loadu_si128((const __m128i *)(x[p].qs + 16));
            sx[p] = _mm_add_epi16(_mm_maddubs_epi16(one8, g[k].xlo[p]), _mm_maddubs_epi16(one8, g[k].xhi[p]));
        }
        const __m128i s = _mm_hadd_epi16(_mm_hadd_epi16(sx[0], sx[1]), _mm_hadd_epi16(sx[2], sx[3]));
        g[k].corr = _mm_madd_epi16(s, _mm_set1_epi16(-8));
        g[k].dx = d4_ssse3(x[0].d, x[1].d, x[2].d, x[3].d);
    }
}

/* T tokens' sums over ng groups (one k-chunk) of one row, g: T rows of gs groups;
 * each group's nibbles are unpacked once for all of them. */
FM_INLINE FM_SSSE3 void row_tokens_q4_0_ssse3(const block_q4_0 *w, const xgroup_ssse3 *g, int gs, int ng, const int T,
                                              float *sums)
{
    const __m128i m4 = _mm_set1_epi8(0x0F), one16 = _mm_set1_epi16(1);
    __m128 acc[FM_FEW_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    for (int k = 0; k < ng; k++, w += 4) {
        __builtin_prefetch((const char *)w + FM_PF_DIST, 0, 3);  /* a line a 72-byte group: faster here than fm_prefetch's 3 */
        __m128i lo[4], hi[4];
        for (int b = 0; b < 4; b++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)w[b].qs);
            lo[b] = _mm_and_si128(q, m4);
            hi[b] = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        }
        const __m128 dw = d4_ssse3(w[0].d, w[1].d, w[2].d, w[3].d);
        for (int t = 0; t < T; t++) {
            const xgroup_ssse3 *x = g + (size_t)t * gs + k;
            __m128i p[4];
            for (int b = 0; b < 4; b++)
                p[b] = _mm_add_epi16(_mm_maddubs_epi16(lo[b], x->xlo[b]), _mm_maddubs_epi16(hi[b], x->xhi[b]));
            const __m128i s01 = _mm_add_epi16(_mm_unpacklo_epi64(p[0], p[1]), _mm_unpackhi_epi64(p[0], p[1]));
            const __m128i s23 = _mm_add_epi16(_mm_unpacklo_epi64(p[2], p[3]), _mm_unpackhi_epi64(p[2], p[3]));
            const __m128i s = _mm_add_epi32(
                _mm_madd_epi16(_mm_packs_epi32(_mm_madd_epi16(s01, one16), _mm_madd_epi16(s23, one16)), one16), x->corr);
            acc[t] = _mm_add_ps(acc[t], _mm_mul_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(dw, x->dx)));
        }
    }
    for (int t = 0; t < T; t++) sums[t] = hsum_adjacent_ssse3(acc[t]);
}

FM_INLINE FM_SSSE3 float row_q4_0_ssse3(const block_q4_0 *w, const xgroup_ssse3 *g, int ng)
{
    float s;
    row_tokens_q4_0_ssse3(w, g, 0, ng, 1, &s);
    return s;
}

#define GROUP_MATVEC_NAME fm_matvec_q4_0_ssse3
#define GROUP_FEW_NAME matmul_few_q4_0_ssse3
#define GROUP_XG xgroup_ssse3
#define GROUP_KC SSSE3_Q4_KC
#define GROUP_PREP prepare_x_ssse3
#define GROUP_ROW row_q4_0_ssse3
#define GROUP_ROW_TOKENS row_tokens_q4_0_ssse3
#define GROUP_DOT fm_vec_dot_q4_0_q8_0_ssse3
#include "group_matvec_template.h"

/* Q8_0 by hand too, as on AVX2 (fm_matvec_q8_0_avx2): 4 blocks' exact int32 totals
 * (the sign trick, two rounds of phaddd) in lane p = block p, then the batched
 * kernel's scaling and sums: faster than unpacking each row into the tile layout
 * (as fm_matvec_q8_0_avx512vnni does). */
FM_INLINE FM_SSSE3 __m128i q8_group_totals_ssse3(const block_q8_0 *w, const block_q8_0 *x)
{
    __m128i v[4];
    for (int p = 0; p < 4; p++)
        v[p] = q8_block_ssse3(w + p, _mm_loadu_si128((const __m128i *)x[p].qs),
                              _mm_loadu_si128((const __m128i *)(x[p].qs + 16)));
    return _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]));
}

FM_SSSE3 static void fm_matvec_q8_0_ssse3(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    enum { GS = CHUNK_BLOCKS / 4 };
    _Static_assert(GS % SSSE3_Q8_KC == 0, "an activation chunk holds whole k-chunks");
    const int nb = cols / FM_QK, ng = nb / 4;
    __m128 dx[GS];
    for (int k0 = 0; k0 < ng; k0 += GS) {
        const int nk = ng - k0 < GS ? ng - k0 : GS;
        const block_q8_0 *xc = x + 4 * k0;
        for (int k = 0; k < nk; k++) dx[k] = d4_ssse3(xc[4 * k].d, xc[4 * k + 1].d, xc[4 * k + 2].d, xc[4 * k + 3].d);
        for (int r = r0; r < r1; r++) {
            const block_q8_0 *w = W + (size_t)r * nb + 4 * k0;
            float v = k0 ? y[r] : 0.0f;
            for (int kc = 0; kc < nk; kc += SSSE3_Q8_KC) {
                __m128 acc = _mm_setzero_ps();
                for (int k = kc; k < nk && k < kc + SSSE3_Q8_KC; k++) {
                    const block_q8_0 *wk = w + 4 * k;
                    fm_prefetch(wk);
                    const __m128 d = _mm_mul_ps(d4_ssse3(wk[0].d, wk[1].d, wk[2].d, wk[3].d), dx[k]);
                    acc = _mm_add_ps(acc, _mm_mul_ps(_mm_cvtepi32_ps(q8_group_totals_ssse3(wk, xc + 4 * k)), d));
                }
                const float sum = hsum_adjacent_ssse3(acc);
                v = k0 + kc ? v + sum : sum;
            }
            y[r] = v;
        }
    }
    matvec_tail_q8_0(fm_vec_dot_q8_0_q8_0_ssse3, W, x, y, cols, 4, r0, r1);
}

#define TILED_NAME matmul_tiled_q4_0_ssse3
#define TILED_W block_q4_0
#define TILED_WT wt4_ssse3
#define TILED_XT xt4_ssse3
#define TILED_KC SSSE3_Q4_KC
#define TILED_RB 2
#define TILED_PREP prepare_xt4_ssse3
#define TILED_UNPACK unpack_wt4_ssse3
#define TILED_KERNEL kernel_q4_ssse3
#define TILED_DOT fm_vec_dot_q4_0_q8_0_ssse3
#define TILED_MATVEC fm_matvec_q4_0_ssse3
#include "tiled_matmul_template.h"

#define TILED_NAME fm_matmul_q8_0_ssse3
#define TILED_W block_q8_0
#define TILED_WT wq8t4_ssse3
#define TILED_XT xt4_ssse3
#define TILED_KC SSSE3_Q8_KC
#define TILED_RB 2
#define TILED_PREP prepare_xt4_ssse3
#define TILED_UNPACK unpack_wq8t4_ssse3
#define TILED_KERNEL kernel_q8_ssse3
#define TILED_DOT fm_vec_dot_q8_0_q8_0_ssse3
#define TILED_MATVEC fm_matvec_q8_0_ssse3
#include "tiled_matmul_template.h"

/* A few tokens (group_matvec_template.h): up to 3 here; at 4 the tiled product is
 * no slower on SSSE3. */
FM_SSSE3 static void fm_matmul_q4_0_ssse3(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy,
                                          int r0, int r1)
{
    if (B >= 2 && B <= 3 && cols >= FM_FEW_MIN_COLS) matmul_few_q4_0_ssse3(W, X, Y, cols, B, ldy, r0, r1);
    else matmul_tiled_q4_0_ssse3(W, X, Y, cols, B, ldy, r0, r1);
}

/* ---------------------------------------------------------------- F32 (SSE)
 * The F32 tensors are the small ones (norm-adjacent vectors, the router): these only
 * need to stay memory-bound. Batched row by row with the matrix-vector product's dot
 * product, so each (row, token) rounds alike whatever the batch. */

/* (v0+v2)+(v1+v3) */
FM_INLINE FM_SSSE3 float hsum_halves_ssse3(__m128 v)
{
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

FM_SSSE3 static float dot_f32_ssse3(int n, const float *w, const float *x)
{
    __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        a0 = _mm_add_ps(a0, _mm_mul_ps(_mm_loadu_ps(w + j), _mm_loadu_ps(x + j)));
        a1 = _mm_add_ps(a1, _mm_mul_ps(_mm_loadu_ps(w + j + 4), _mm_loadu_ps(x + j + 4)));
    }
    float sum = hsum_halves_ssse3(_mm_add_ps(a0, a1));
    for (; j < n; j++) sum += w[j] * x[j];
    return sum;
}

FM_SSSE3 static void fm_matvec_f32_ssse3(const float *W, const float *x, float *y, int cols, int r0, int r1)
{
    for (int r = r0; r < r1; r++) y[r] = dot_f32_ssse3(cols, W + (size_t)r * cols, x);
}

FM_SSSE3 static void fm_matmul_f32_ssse3(const float *W, const float *X, float *Y, int cols, int B, int ldy, int r0,
                                         int r1)
{
    for (int r = r0; r < r1; r++)
        for (int b = 0; b < B; b++)
            Y[(size_t)b * ldy + r] = dot_f32_ssse3(cols, W + (size_t)r * cols, X + (size_t)b * cols);
}

const fm_kernels fm_kernels_ssse3 = {
    .quantize_row_q8_0 = fm_quantize_row_q8_0_scalar,  /* rounding needs SSE4.1's roundps */
    .dot_q4_0_q8_0 = fm_vec_dot_q4_0_q8_0_ssse3,
    .dot_q8_0_q8_0 = fm_vec_dot_q8_0_q8_0_ssse3,
    .matvec_q4_0 = fm_matvec_q4_0_ssse3,
    .matvec_q8_0 = fm_matvec_q8_0_ssse3,
    .matvec_f32 = fm_matvec_f32_ssse3,
    .matvec_f16 = fm_matvec_f16_scalar,                /* fp16 loads need F16C */
    .matmul_q4_0 = fm_matmul_q4_0_ssse3,
    .matmul_q8_0 = fm_matmul_q8_0_ssse3,
    .matmul_f32 = fm_matmul_f32_ssse3,
    .fp16_to_fp32_row = fm_fp16_to_fp32_row_scalar,
    .fp32_to_fp16_row = fm_fp32_to_fp16_row_scalar,
    .attn_scores = fm_attn_scores_scalar,
    .attn_accumulate = fm_attn_accumulate_scalar,
};
