/* kernels_float_x86.c: F32/F16 products (SSE, AVX2, AVX-512), the SIMD Q8_0
 * quantiser, fp16 rows (F16C) and the attention kernels over the KV cache (AVX2).
 * The F32/F16 tensors are the small ones (norm-adjacent vectors, the router);
 * these only need to stay memory-bound. */
#include <math.h>
#include "kernels.h"
#include "x86.h"

/* Row loops shared by every version: matvec, and the batched product with the
 * row outer so each row comes from memory once and from L1 for the rest. */
#define ROWWISE_MATVEC(NAME, WTYPE, DOT, ATTR)                                               \
ATTR void NAME(const WTYPE *W, const float *x, float *y, int cols, int r0, int r1)           \
{                                                                                            \
    for (int r = r0; r < r1; r++) y[r] = DOT(cols, W + (size_t)r * cols, x);                 \
}
#define ROWWISE_MATMUL(NAME, DOT, ATTR)                                                      \
ATTR void NAME(const float *W, const float *X, float *Y, int cols, int B, int ldy, int r0, int r1) \
{                                                                                            \
    for (int r = r0; r < r1; r++)                                                            \
        for (int b = 0; b < B; b++)                                                          \
            Y[(size_t)b * ldy + r] = DOT(cols, W + (size_t)r * cols, X + (size_t)b * cols); \
}

/* ---------------------------------------------------------------- SSE (the ssse3 level) */

FM_INLINE FM_SSSE3 float hsum128(__m128 v)
{
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

FM_SSSE3 static float dot_f32_sse(int n, const float *w, const float *x)
{
    __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        a0 = _mm_add_ps(a0, _mm_mul_ps(_mm_loadu_ps(w + j), _mm_loadu_ps(x + j)));
        a1 = _mm_add_ps(a1, _mm_mul_ps(_mm_loadu_ps(w + j + 4), _mm_loadu_ps(x + j + 4)));
    }
    float sum = hsum128(_mm_add_ps(a0, a1));
    for (; j < n; j++) sum += w[j] * x[j];
    return sum;
}
ROWWISE_MATVEC(fm_matvec_f32_ssse3, float, dot_f32_sse, FM_SSSE3)
ROWWISE_MATMUL(fm_matmul_f32_ssse3, dot_f32_sse, FM_SSSE3)

/* ---------------------------------------------------------------- AVX2 + FMA + F16C */

FM_INLINE FM_AVX2 float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Four accumulators hide the FMA latency; prefetch as the quantised loops do
 * (one call covers 192 B: 32 F32 = 128 B, 32 F16 = 64 B per step). */
#define DOT_BODY_256(LOADW, TAILW)                                                           \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                             \
    int j = 0;                                                                               \
    for (; j + 32 <= n; j += 32) {                                                           \
        fm_prefetch(w + j);                                                                  \
        a0 = _mm256_fmadd_ps(LOADW(j), _mm256_loadu_ps(x + j), a0);                          \
        a1 = _mm256_fmadd_ps(LOADW(j + 8), _mm256_loadu_ps(x + j + 8), a1);                  \
        a2 = _mm256_fmadd_ps(LOADW(j + 16), _mm256_loadu_ps(x + j + 16), a2);                \
        a3 = _mm256_fmadd_ps(LOADW(j + 24), _mm256_loadu_ps(x + j + 24), a3);                \
    }                                                                                        \
    float sum = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));       \
    for (; j < n; j++) sum += TAILW(j) * x[j];                                               \
    return sum;

#define LOAD_F32_256(j) _mm256_loadu_ps(w + (j))
#define LOAD_F16_256(j) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + (j))))
#define TAIL_F32(j) w[j]
#define TAIL_F16(j) _cvtsh_ss(w[j])

FM_AVX2 static float dot_f32_avx2(int n, const float *w, const float *x) { DOT_BODY_256(LOAD_F32_256, TAIL_F32) }
FM_AVX2 static float dot_f16_avx2(int n, const uint16_t *w, const float *x) { DOT_BODY_256(LOAD_F16_256, TAIL_F16) }
ROWWISE_MATVEC(fm_matvec_f32_avx2, float, dot_f32_avx2, FM_AVX2)
ROWWISE_MATVEC(fm_matvec_f16_avx2, uint16_t, dot_f16_avx2, FM_AVX2)
/* Batched F32 is row by row with the same dot product as the matrix-vector one:
 * each (row, token) then rounds identically whatever the batch, which keeps the
 * forward bitwise independent of prompt chunking. F32 matrices are small here
 * (routers), so a register-blocked version would not pay for that. */
ROWWISE_MATMUL(fm_matmul_f32_avx2, dot_f32_avx2, FM_AVX2)

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
 * Register-blocked over up to 8 query heads (a grouped-query KV head's): each K or V
 * load, fp16 widened on the way, feeds one FMA per head. Scores: 8 accumulators along
 * the head dimension, reduced together by one hadd tree. Weighted sum: 8 heads' acc
 * stay in registers over all n positions, 8 floats of the head dimension at a time, so
 * nothing is stored per position. Needs hd % 8 == 0, else the generic kernels run.
 * The scores prefetch the K row SCORE_PF_ROWS positions ahead: rows are a page stride
 * apart, beyond the hardware prefetcher, so at long contexts the scores would wait
 * on memory. */
#define SCORE_PF_ROWS 4

FM_INLINE FM_AVX2 __m256 kv8(const void *row, int f16, int i)
{
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)))
               : _mm256_loadu_ps((const float *)row + i);
}

/* The 8 sums of a[0..7], in that order, with one hadd tree. */
FM_INLINE FM_AVX2 __m256 hsum8x8(const __m256 a[8])
{
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

FM_INLINE FM_AVX2 void scores_heads(const float *q, int qstride, const void *row, int f16, int hd,
                                    float *s, int lds, const int NH)
{
    __m256 a[8];
    for (int h = 0; h < 8; h++) a[h] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        const __m256 k = kv8(row, f16, i);
        for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * qstride + i), k, a[h]);
    }
    float out[8];
    _mm256_storeu_ps(out, hsum8x8(a));
    for (int h = 0; h < NH; h++) s[(size_t)h * lds] = out[h];
}

FM_INLINE FM_AVX2 void accumulate_heads(const float *p, int ldp, const void *const *rows, int f16, int n, int hd,
                                        float *acc, const int NH)
{
    for (int i = 0; i < hd; i += 8) {
        __m256 a[8];
        for (int h = 0; h < NH; h++) a[h] = _mm256_loadu_ps(acc + (size_t)h * hd + i);
        for (int j = 0; j < n; j++) {
            const __m256 v = kv8(rows[j], f16, i);
            for (int h = 0; h < NH; h++) a[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + (size_t)h * ldp + j), v, a[h]);
        }
        for (int h = 0; h < NH; h++) _mm256_storeu_ps(acc + (size_t)h * hd + i, a[h]);
    }
}

/* A switch on the block's head count, so each case runs with NH a constant. */
#define FM_HEADS_SWITCH(NH, CALL)                                                                \
    switch (NH) {                                                                                \
    case 8: CALL(8); break; case 7: CALL(7); break; case 6: CALL(6); break; case 5: CALL(5); break; \
    case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1);     \
    }

FM_AVX2 void fm_attn_scores_avx2(const float *q, int qstride, int G, const void *const *rows, int f16, int n, int hd,
                                 float *s, int lds)
{
    if (hd % 8) {
        fm_attn_scores_generic(q, qstride, G, rows, f16, n, hd, s, lds);
        return;
    }
    for (int h0 = 0; h0 < G; h0 += 8) {
        const int nh = G - h0 < 8 ? G - h0 : 8;
        const float *qh = q + (size_t)h0 * qstride;
        float *sh = s + (size_t)h0 * lds;
        const size_t row_bytes = (size_t)hd * (f16 ? 2 : 4);
        for (int j = 0; j < n; j++) {
            if (j + SCORE_PF_ROWS < n)
                for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((const char *)rows[j + SCORE_PF_ROWS] + o, 0, 3);
#define FM_SCORES(NH) scores_heads(qh, qstride, rows[j], f16, hd, sh + j, lds, NH)
            FM_HEADS_SWITCH(nh, FM_SCORES)
#undef FM_SCORES
        }
    }
}

FM_AVX2 void fm_attn_accumulate_avx2(const float *p, int ldp, int G, const void *const *rows, int f16, int n, int hd,
                                     float *acc)
{
    if (hd % 8) {
        fm_attn_accumulate_generic(p, ldp, G, rows, f16, n, hd, acc);
        return;
    }
    for (int h0 = 0; h0 < G; h0 += 8) {
        const int nh = G - h0 < 8 ? G - h0 : 8;
#define FM_ACCUMULATE(NH) accumulate_heads(p + (size_t)h0 * ldp, ldp, rows, f16, n, hd, acc + (size_t)h0 * hd, NH)
        FM_HEADS_SWITCH(nh, FM_ACCUMULATE)
#undef FM_ACCUMULATE
    }
}

/* ---------------------------------------------------------------- AVX-512F */

#define DOT_BODY_512(LOADW, TAILW)                                                           \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                             \
    int j = 0;                                                                               \
    for (; j + 64 <= n; j += 64) {                                                           \
        fm_prefetch(w + j);                                                                  \
        fm_prefetch(w + j + 48);                                                             \
        a0 = _mm512_fmadd_ps(LOADW(j), _mm512_loadu_ps(x + j), a0);                          \
        a1 = _mm512_fmadd_ps(LOADW(j + 16), _mm512_loadu_ps(x + j + 16), a1);                \
        a2 = _mm512_fmadd_ps(LOADW(j + 32), _mm512_loadu_ps(x + j + 32), a2);                \
        a3 = _mm512_fmadd_ps(LOADW(j + 48), _mm512_loadu_ps(x + j + 48), a3);                \
    }                                                                                        \
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))); \
    for (; j < n; j++) sum += TAILW(j) * x[j];                                               \
    return sum;

#define LOAD_F32_512(j) _mm512_loadu_ps(w + (j))
#define LOAD_F16_512(j) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + (j))))

FM_AVX512 static float dot_f32_avx512(int n, const float *w, const float *x) { DOT_BODY_512(LOAD_F32_512, TAIL_F32) }
FM_AVX512 static float dot_f16_avx512(int n, const uint16_t *w, const float *x) { DOT_BODY_512(LOAD_F16_512, TAIL_F16) }
ROWWISE_MATVEC(fm_matvec_f32_avx512vnni, float, dot_f32_avx512, FM_AVX512)
ROWWISE_MATVEC(fm_matvec_f16_avx512vnni, uint16_t, dot_f16_avx512, FM_AVX512)
ROWWISE_MATMUL(fm_matmul_f32_avx512vnni, dot_f32_avx512, FM_AVX512)

/* ---------------------------------------------------------------- Q8_0 quantiser (AVX2)
 * Bit-exact with the generic one: the same fp32 d and 1/d, and roundf's
 * half-away-from-zero rebuilt from round-to-nearest-even plus a tie fix (as
 * shared.quants does). Blocks holding inf/NaN or a tiny max take the generic path. */

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
            fm_quantize_row_q8_0_generic(xb, y + b, FM_QK);
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
