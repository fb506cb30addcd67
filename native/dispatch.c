/* dispatch.c: which ISA runs the kernels, chosen once at run time.
 *
 * Default: the best level the CPU *and the OS* support (AVX state must be
 * enabled in XCR0, read with xgetbv, or AVX instructions fault even when CPUID
 * lists them). FERMOE_ISA=scalar|ssse3|avx2|avx512vnni or fm_set_isa() pick
 * another one; asking for a level the CPU lacks is refused, never emulated.
 * FERMOE_MAX_ISA=name makes the library behave as on a CPU without the levels
 * above `name`: so an AVX-512 machine runs what an AVX2-only one runs (its tests'
 * skips, its refusals of the levels it lacks), which nothing else can show there.
 * AMX is never used: it is advertised on some of our machines and faults.
 */
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define FM_X86 1
#endif

static const fm_kernels *table_for(int isa)
{
    switch (isa) {
    case FM_ISA_SCALAR: return &fm_kernels_scalar;
#ifdef FM_X86
    case FM_ISA_SSSE3: return &fm_kernels_ssse3;
    case FM_ISA_AVX2: return &fm_kernels_avx2;
    case FM_ISA_AVX512VNNI: return &fm_kernels_avx512vnni;
#endif
    default: return NULL;
    }
}

static const char *const isa_names[FM_ISA_COUNT] = {"scalar", "ssse3", "avx2", "avx512vnni"};

const char *fm_isa_name(int isa) { return isa >= 0 && isa < FM_ISA_COUNT ? isa_names[isa] : NULL; }

int fm_isa_from_name(const char *name)
{
    for (int i = 0; name && i < FM_ISA_COUNT; i++)
        if (strcmp(name, isa_names[i]) == 0) return i;
    return -1;
}

/* ---------------------------------------------------------------- CPU detection */

#ifdef FM_X86
static unsigned long long xgetbv0(void)
{
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static int detect_best(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return FM_ISA_SCALAR;
    const int ssse3 = (c >> 9) & 1, fma = (c >> 12) & 1, osxsave = (c >> 27) & 1;
    const int avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!ssse3) return FM_ISA_SCALAR;
    if (!(osxsave && avx)) return FM_ISA_SSSE3;
    const unsigned long long xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return FM_ISA_SSSE3;  /* OS saves XMM and YMM state? */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return FM_ISA_SSSE3;
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1;
    const int avx512vl = (b >> 31) & 1, vnni = (c >> 11) & 1;
    if (!(avx2 && fma && f16c)) return FM_ISA_SSSE3;
    /* opmask, upper ZMM0-15 and ZMM16-31 state must be OS-enabled too */
    if (avx512f && avx512bw && avx512vl && vnni && (xcr0 & 0xE6) == 0xE6) return FM_ISA_AVX512VNNI;
    return FM_ISA_AVX2;
}
#else
static int detect_best(void) { return FM_ISA_SCALAR; }
#endif

/* Each level includes the ones below it. */
static int best_isa = -1;
static const fm_kernels *active = NULL;
static int active_isa = FM_ISA_SCALAR;

int fm_best_isa(void)
{
    if (best_isa < 0) {                          /* idempotent: a race just repeats the work */
        int best = detect_best();
        const int cap = fm_isa_from_name(getenv("FERMOE_MAX_ISA"));
        best_isa = cap >= 0 && cap < best ? cap : best;
    }
    return best_isa;
}

int fm_isa_supported(int isa) { return isa >= 0 && isa < FM_ISA_COUNT && isa <= fm_best_isa(); }

int fm_set_isa(int isa)
{
    if (!fm_isa_supported(isa) || !table_for(isa)) return -1;
    active_isa = isa;
    __atomic_store_n(&active, table_for(isa), __ATOMIC_RELEASE);
    return isa;
}

int fm_init_dispatch(void)
{
    const char *env = getenv("FERMOE_ISA"), *cap = getenv("FERMOE_MAX_ISA");
    int status = 0, isa = fm_best_isa();
    if (cap && *cap && fm_isa_from_name(cap) < 0) status = -3;
    else if (env && *env) {
        const int want = fm_isa_from_name(env);
        if (want < 0) status = -1;
        else if (!fm_isa_supported(want)) status = -2;
        else isa = want;
    }
    fm_set_isa(isa);
    return status;
}

int fm_get_isa(void)
{
    if (!__atomic_load_n(&active, __ATOMIC_ACQUIRE)) fm_init_dispatch();
    return active_isa;
}

static const fm_kernels *K(void)
{
    const fm_kernels *k = __atomic_load_n(&active, __ATOMIC_ACQUIRE);
    if (!k) {
        fm_init_dispatch();
        k = __atomic_load_n(&active, __ATOMIC_ACQUIRE);
    }
    return k;
}

/* ---------------------------------------------------------------- public entry points */

void fm_quantize_row_q8_0(const float *x, block_q8_0 *y, int n) { K()->quantize_row_q8_0(x, y, n); }
float fm_vec_dot_q4_0_q8_0(int n, const block_q4_0 *w, const block_q8_0 *x) { return K()->dot_q4_0_q8_0(n, w, x); }
float fm_vec_dot_q8_0_q8_0(int n, const block_q8_0 *w, const block_q8_0 *x) { return K()->dot_q8_0_q8_0(n, w, x); }

void fm_matvec_q4_0(const block_q4_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    K()->matvec_q4_0(W, x, y, cols, r0, r1);
}
void fm_matvec_q8_0(const block_q8_0 *W, const block_q8_0 *x, float *y, int cols, int r0, int r1)
{
    K()->matvec_q8_0(W, x, y, cols, r0, r1);
}
void fm_matvec_f32(const float *W, const float *x, float *y, int cols, int r0, int r1)
{
    K()->matvec_f32(W, x, y, cols, r0, r1);
}
void fm_matvec_f16(const uint16_t *W, const float *x, float *y, int cols, int r0, int r1)
{
    K()->matvec_f16(W, x, y, cols, r0, r1);
}
void fm_matmul_q4_0(const block_q4_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1)
{
    K()->matmul_q4_0(W, X, Y, cols, B, ldy, r0, r1);
}
void fm_matmul_q8_0(const block_q8_0 *W, const block_q8_0 *X, float *Y, int cols, int B, int ldy, int r0, int r1)
{
    K()->matmul_q8_0(W, X, Y, cols, B, ldy, r0, r1);
}
void fm_matmul_f32(const float *W, const float *X, float *Y, int cols, int B, int ldy, int r0, int r1)
{
    K()->matmul_f32(W, X, Y, cols, B, ldy, r0, r1);
}
void fm_fp16_to_fp32_row(const uint16_t *x, float *y, int n)
{
    K()->fp16_to_fp32_row(x, y, n);
}
void fm_fp32_to_fp16_row(const float *x, uint16_t *y, int n)
{
    K()->fp32_to_fp16_row(x, y, n);
}
void fm_attn_scores(const float *q, int qstride, int G, const void *const *rows, int f16, int n, int hd,
                    float *s, int lds)
{
    K()->attn_scores(q, qstride, G, rows, f16, n, hd, s, lds);
}
void fm_attn_accumulate(const float *p, int ldp, int G, const void *const *rows, int f16, int n, int hd,
                        float *acc)
{
    K()->attn_accumulate(p, ldp, G, rows, f16, n, hd, acc);
}
