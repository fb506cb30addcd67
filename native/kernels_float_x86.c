/* kernels_float_x86.c: F32/F16 products (SSE, AVX2, AVX-512) and the SIMD Q8_0
 * quantiser. The F32/F16 tensors are the small ones (norm-adjacent vectors,
 * the router); these only need to stay memory-bound. */
#include <immintrin.h>
#include <math.h>
#include "kernels.h"

#define FM_SSSE3 __attribute__((target("ssse3")))
#define FM_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FM_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define FM_INLINE static inline __attribute__((always_inline))

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
 * (routers), so the register-blocked version did not pay for that. */
ROWWISE_MATMUL(fm_matmul_f32_avx2, dot_f32_avx2, FM_AVX2)

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
