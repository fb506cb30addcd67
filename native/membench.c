/* membench.c: a plain read loop, the yardstick for the kernels' bandwidth.
 * bench/kernels.py times it over a buffer far larger than the caches, with one
 * thread and with several (each summing its own slice), in the same run as the
 * matrix-vector products, and reports kernel GB/s as a fraction of it. */
#include <immintrin.h>
#include "kernels.h"
#include "membench.h"

/* Four independent 256-bit accumulators keep the adds off the critical path,
 * so only memory limits the loop. pf (a constant where it is inlined): also
 * prefetch the 2 lines FM_PF_DIST ahead, as the kernels do. */
__attribute__((target("avx2"), always_inline)) static inline uint64_t read_sum_avx2(const uint8_t *p, size_t n,
                                                                                 const int pf)
{
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i < n; i += 128) {
        if (pf) {
            __builtin_prefetch(p + i + FM_PF_DIST, 0, 3);
            __builtin_prefetch(p + i + FM_PF_DIST + 64, 0, 3);
        }
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        c = _mm256_add_epi64(c, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        d = _mm256_add_epi64(d, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    uint64_t o[4];
    _mm256_storeu_si256((__m256i *)o, _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d)));
    return o[0] + o[1] + o[2] + o[3];
}

/* SSE2 is part of x86-64 itself. */
__attribute__((always_inline)) static inline uint64_t read_sum_sse2(const uint8_t *p, size_t n, const int pf)
{
    __m128i a = _mm_setzero_si128(), b = a, c = a, d = a;
    for (size_t i = 0; i < n; i += 64) {
        if (pf) __builtin_prefetch(p + i + FM_PF_DIST, 0, 3);
        a = _mm_add_epi64(a, _mm_loadu_si128((const __m128i *)(p + i)));
        b = _mm_add_epi64(b, _mm_loadu_si128((const __m128i *)(p + i + 16)));
        c = _mm_add_epi64(c, _mm_loadu_si128((const __m128i *)(p + i + 32)));
        d = _mm_add_epi64(d, _mm_loadu_si128((const __m128i *)(p + i + 48)));
    }
    uint64_t o[2];
    _mm_storeu_si128((__m128i *)o, _mm_add_epi64(_mm_add_epi64(a, b), _mm_add_epi64(c, d)));
    return o[0] + o[1];
}

/* Each loop compiled twice, with and without the prefetch, so the plain one (the
 * yardstick) carries no test for it. */
__attribute__((target("avx2"))) static uint64_t plain_avx2(const uint8_t *p, size_t n) { return read_sum_avx2(p, n, 0); }
__attribute__((target("avx2"))) static uint64_t prefetched_avx2(const uint8_t *p, size_t n) { return read_sum_avx2(p, n, 1); }
static uint64_t plain_sse2(const uint8_t *p, size_t n) { return read_sum_sse2(p, n, 0); }
static uint64_t prefetched_sse2(const uint8_t *p, size_t n) { return read_sum_sse2(p, n, 1); }

static uint64_t read_sum(const void *buf, size_t nbytes, int prefetched)
{
    const uint8_t *p = (const uint8_t *)buf;
    nbytes &= ~(size_t)127;
    if (fm_best_isa() >= FM_ISA_AVX2) return prefetched ? prefetched_avx2(p, nbytes) : plain_avx2(p, nbytes);
    return prefetched ? prefetched_sse2(p, nbytes) : plain_sse2(p, nbytes);
}

uint64_t fm_read_sum(const void *buf, size_t nbytes) { return read_sum(buf, nbytes, 0); }

uint64_t fm_read_sum_prefetched(const void *buf, size_t nbytes) { return read_sum(buf, nbytes, 1); }
