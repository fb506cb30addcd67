#include "linear.h"

#include <stdatomic.h>

#include "kernels.h"
#include "ops.h"

/* A region's jobs are cut into units of rows (a unit never spans two jobs) and the
 * threads claim runs of units, guided-scheduling style: each claim takes
 * 1/CLAIM_DIVISOR of what is left per thread, so runs start long (long memory
 * streams) and shrink towards the end of the region, where the last claims are a
 * unit each. No claim takes over 1/MAX_CLAIM_SHARE of a thread's share: on a VM a
 * thread can stall for milliseconds holding its claim. A region then ends within
 * about a unit's time of its first idle thread; with fixed tasks it ended a whole
 * task later, ~17 us of 16 idle threads a region on a 16-core Xeon. Units are
 * UNIT_BYTES (at least MIN_ROWS rows, a whole number of 64-byte output lines) for
 * one token; batched products re-prepare their activations per call, so their
 * units are BATCH_UNIT_BYTES. */
#define MIN_ROWS 16
#define UNIT_BYTES (32 << 10)
#define BATCH_UNIT_BYTES (128 << 10)
#define CLAIM_DIVISOR 2
#define MAX_CLAIM_SHARE 4
#define MAX_JOBS 512            /* a region of them; a 256-expert model's down projections and the shared one fit */

typedef struct {
    const fm_job *jobs;
    int n_jobs;
    int unit_rows[MAX_JOBS];
    int first_unit[MAX_JOBS + 1];
    int divisor;                /* CLAIM_DIVISOR x threads */
    int max_claim;              /* a thread's share / MAX_CLAIM_SHARE: a thread that stalls holds no more */
    atomic_int next;            /* the first unit nobody has claimed */
} jobs_ctx;

static size_t row_bytes(const fm_tensor *w) {
    switch (w->type) {
    case FM_Q4_0: return (size_t)w->cols / FM_QK * sizeof(block_q4_0);
    case FM_Q8_0: return (size_t)w->cols / FM_QK * sizeof(block_q8_0);
    default: return (size_t)w->cols * sizeof(float);
    }
}

/* Bytes of weights a row of the job reads (both matrices of a gated pair). */
static size_t job_row_bytes(const fm_job *j) {
    return row_bytes(j->w) * (j->w_up ? 2 : 1);
}

static int unit_rows(const fm_job *j) {
    size_t bytes = j->B == 1 ? UNIT_BYTES : BATCH_UNIT_BYTES, align = j->hq ? FM_QK : MIN_ROWS;
    size_t per = (bytes + job_row_bytes(j) - 1) / job_row_bytes(j);
    per = (per + align - 1) / align * align;
    return per > (size_t)j->w->rows ? j->w->rows : (int)per;
}

static const uint8_t *matrix(const fm_tensor *w, int mat) {
    return (const uint8_t *)w->data + (int64_t)mat * w->mat_stride;
}

/* y[b * ldy + r] = w[r] . x[b] for rows [rb, re). */
static void product(const fm_job *j, const fm_tensor *w, float *y, int rb, int re) {
    const uint8_t *base = matrix(w, j->mat);
    int cols = w->cols;
    switch (w->type) {
    case FM_Q4_0:
        if (j->B == 1) fm_matvec_q4_0((const block_q4_0 *)base, j->xq, y, cols, rb, re);
        else fm_matmul_q4_0((const block_q4_0 *)base, j->xq, y, cols, j->B, j->ldy, rb, re);
        break;
    case FM_Q8_0:
        if (j->B == 1) fm_matvec_q8_0((const block_q8_0 *)base, j->xq, y, cols, rb, re);
        else fm_matmul_q8_0((const block_q8_0 *)base, j->xq, y, cols, j->B, j->ldy, rb, re);
        break;
    default:
        if (j->B == 1) fm_matvec_f32((const float *)base, j->x, y, cols, rb, re);
        else fm_matmul_f32((const float *)base, j->x, y, cols, j->B, j->ldy, rb, re);
    }
}

/* A gated pair's rows [rb, re): y = silu(y) * y_up, then quantised into hq. */
__attribute__((target_clones("avx2", "default")))
static void swiglu_rows(const fm_job *j, int rb, int re) {
    for (int b = 0; b < j->B; b++) {
        float *g = j->y + (size_t)b * j->ldy;
        const float *u = j->y_up + (size_t)b * j->ldy;
        for (int r = rb; r < re; r++) g[r] = fm_silu(g[r]) * u[r];
        if (j->hq) fm_quantize_row_q8_0(g + rb, j->hq + (size_t)b * (j->w->rows / FM_QK) + rb / FM_QK, re - rb);
    }
}

static void run_rows(const fm_job *j, int rb, int re) {
    product(j, j->w, j->y, rb, re);
    if (!j->w_up) return;
    product(j, j->w_up, j->y_up, rb, re);
    swiglu_rows(j, rb, re);
}

/* The first FM_PF_DIST bytes of a task: the kernels prefetch that far ahead of
 * where they read, so without this a task's start would wait on memory. */
static void prefetch_head(const uint8_t *p, size_t n) {
    if (n > FM_PF_DIST) n = FM_PF_DIST;
    for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Claims the next run of units: 0 when none is left, else how many, from *first. */
static int claim(jobs_ctx *c, int *first) {
    const int n_units = c->first_unit[c->n_jobs];
    int cur = atomic_load_explicit(&c->next, memory_order_relaxed);
    for (;;) {
        int left = n_units - cur;
        if (left <= 0) return 0;
        int n = left / c->divisor;
        n = n > c->max_claim ? c->max_claim : n < 1 ? 1 : n;
        if (atomic_compare_exchange_weak_explicit(&c->next, &cur, cur + n, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *first = cur;
            return n;
        }
    }
}

/* Units [u, end) of the region: one call a job they cover. */
static void run_units(const jobs_ctx *c, int u, int end) {
    int j = 0;
    while (u >= c->first_unit[j + 1]) j++;
    for (; u < end; j++) {
        const fm_job *job = &c->jobs[j];
        int stop = end < c->first_unit[j + 1] ? end : c->first_unit[j + 1];
        int rb = (u - c->first_unit[j]) * c->unit_rows[j];
        int re = (stop - c->first_unit[j]) * c->unit_rows[j];
        if (re > job->w->rows) re = job->w->rows;
        size_t rbytes = row_bytes(job->w);
        prefetch_head(matrix(job->w, job->mat) + rb * rbytes, (size_t)(re - rb) * rbytes);
        if (job->w_up) prefetch_head(matrix(job->w_up, job->mat) + rb * rbytes, (size_t)(re - rb) * rbytes);
        run_rows(job, rb, re);
        u = stop;
    }
}

/* One task a thread: each claims runs until the region has none left. */
static void job_task(void *ctxp, int task, int worker) {
    (void)task, (void)worker;
    jobs_ctx *c = ctxp;
    for (int u, n; (n = claim(c, &u));) run_units(c, u, u + n);
}

void fm_run_jobs(fm_pool *pool, const fm_job *jobs, int n_jobs) {
    for (int start = 0; start < n_jobs; start += MAX_JOBS) {
        jobs_ctx c = {.jobs = jobs + start, .n_jobs = n_jobs - start < MAX_JOBS ? n_jobs - start : MAX_JOBS,
                      .divisor = CLAIM_DIVISOR * fm_pool_size(pool)};
        c.first_unit[0] = 0;
        for (int j = 0; j < c.n_jobs; j++) {
            int rows = c.jobs[j].w->rows, per = unit_rows(&c.jobs[j]);
            c.unit_rows[j] = per;
            c.first_unit[j + 1] = c.first_unit[j] + (rows + per - 1) / per;
        }
        int n_units = c.first_unit[c.n_jobs], threads = fm_pool_size(pool);
        c.max_claim = n_units / (MAX_CLAIM_SHARE * threads) > 1 ? n_units / (MAX_CLAIM_SHARE * threads) : 1;
        atomic_init(&c.next, 0);
        fm_pool_run(pool, job_task, &c, n_units < threads ? n_units : threads);
    }
}

typedef struct { const float *x; block_q8_0 *y; int n; } quant_ctx;

static void quant_task(void *ctxp, int b, int worker) {
    (void)worker;
    quant_ctx *c = ctxp;
    fm_quantize_row_q8_0(c->x + (int64_t)b * c->n, c->y + (int64_t)b * (c->n / 32), c->n);
}

void fm_quantize_rows(fm_pool *pool, const float *x, block_q8_0 *y, int B, int n) {
    if (n % 32) return;         /* only F32 weights can take such rows: they read x itself */
    quant_ctx c = {x, y, n};
    fm_pool_run_light(pool, quant_task, &c, B);     /* ~1 us a row */
}
