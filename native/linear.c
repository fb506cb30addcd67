#include "linear.h"

#include <stdatomic.h>

#include "kernels.h"
#include "ops.h"

/* A region's jobs are cut into units of rows (a unit never spans two jobs) and each
 * thread owns an even, contiguous share of the units: it streams through it from
 * the front, a quarter of what is left at a time, and a thread whose share is done
 * steals the back half of the largest share still left (which it then owns, so
 * that can be split again). Owners read long runs of consecutive rows, and the
 * region ends within about a unit's time of its first idle thread, where fixed
 * tasks from one counter end a whole task later (with every idle thread waiting)
 * and every thread's claims contend on one line.
 * Units are UNIT_BYTES (a multiple of MIN_ROWS rows, whole 64-byte output lines,
 * unless fewer rows make a unit) for one token; batched products re-prepare
 * their activations per call, so their units are BATCH_UNIT_BYTES. */
#define MIN_ROWS 16
#define UNIT_BYTES (32 << 10)
#define BATCH_UNIT_BYTES (128 << 10)
#define OWN_CLAIM_DIVISOR 4
#define MAX_JOBS 512            /* a region of them; a 256-expert model's down projections and the shared one fit */

/* A thread's units [front, back): front in the low 32 bits, so one CAS moves either end. */
typedef struct { _Alignas(64) _Atomic uint64_t range; } share_t;

typedef struct {
    const fm_job *jobs;
    int n_jobs;
    int unit_rows[MAX_JOBS];
    int first_unit[MAX_JOBS + 1];
    int n_shares;
    share_t *share;             /* [n_shares], one a thread */
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
    size_t bytes = j->B == 1 ? UNIT_BYTES : BATCH_UNIT_BYTES;
    size_t per = (bytes + job_row_bytes(j) - 1) / job_row_bytes(j);
    size_t align = j->hq ? FM_QK : per > MIN_ROWS ? MIN_ROWS : 1;   /* F32 rows can be 8 KB */
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
    if (j->w_up) {
        product(j, j->w_up, j->y_up, rb, re);
        swiglu_rows(j, rb, re);
    }
    if (j->done) j->done(j->done_ctx, rb, re);
}

/* The first FM_PF_DIST bytes of a task: the kernels prefetch that far ahead of
 * where they read, so without this a task's start would wait on memory. */
static void prefetch_head(const uint8_t *p, size_t n) {
    if (n > FM_PF_DIST) n = FM_PF_DIST;
    for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

static uint64_t range_of(uint32_t front, uint32_t back) { return (uint64_t)back << 32 | front; }

/* The owner's next run from the front of its share: 0 when it is empty, else how
 * many units, from *first. */
static int take_front(share_t *s, int *first) {
    uint64_t r = atomic_load_explicit(&s->range, memory_order_relaxed);
    for (;;) {
        uint32_t front = (uint32_t)r, back = (uint32_t)(r >> 32);
        if (front >= back) return 0;
        uint32_t n = (back - front) / OWN_CLAIM_DIVISOR ? (back - front) / OWN_CLAIM_DIVISOR : 1;
        if (atomic_compare_exchange_weak_explicit(&s->range, &r, range_of(front + n, back), memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *first = (int)front;
            return (int)n;
        }
    }
}

/* Moves the back half of the largest share left into the thief's own (empty) one;
 * 0 when every share is empty. */
static int steal(jobs_ctx *c, int thief) {
    for (;;) {
        int victim = -1;
        uint32_t most = 0;
        uint64_t seen = 0;
        for (int i = 0; i < c->n_shares; i++) {
            uint64_t r = atomic_load_explicit(&c->share[i].range, memory_order_relaxed);
            uint32_t left = (uint32_t)(r >> 32) - (uint32_t)r;
            if (left > most) most = left, victim = i, seen = r;
        }
        if (victim < 0) return 0;
        uint32_t front = (uint32_t)seen, back = (uint32_t)(seen >> 32), n = (back - front + 1) / 2;
        if (atomic_compare_exchange_weak_explicit(&c->share[victim].range, &seen, range_of(front, back - n),
                                                  memory_order_relaxed, memory_order_relaxed)) {
            atomic_store_explicit(&c->share[thief].range, range_of(back - n, back), memory_order_relaxed);
            return 1;
        }
    }
}

/* Units [u, end) of the region: one call a job they cover. *next is where the
 * thread's previous call stopped: a run that goes on from there needs no head
 * prefetch, since the kernels prefetch past the rows they read. */
static void run_units(const jobs_ctx *c, int u, int end, int *next) {
    int j = 0;
    while (u >= c->first_unit[j + 1]) j++;
    for (; u < end; j++) {
        const fm_job *job = &c->jobs[j];
        int stop = end < c->first_unit[j + 1] ? end : c->first_unit[j + 1];
        int rb = (u - c->first_unit[j]) * c->unit_rows[j];
        int re = (stop - c->first_unit[j]) * c->unit_rows[j];
        if (re > job->w->rows) re = job->w->rows;
        size_t rbytes = row_bytes(job->w), n = (size_t)(re - rb) * rbytes;
        if (u != *next) {
            prefetch_head(matrix(job->w, job->mat) + rb * rbytes, n);
            if (job->w_up) prefetch_head(matrix(job->w_up, job->mat) + rb * rbytes, n);
        }
        run_rows(job, rb, re);
        u = *next = stop;
    }
}

/* Worker w: its own share, then stolen halves, until every share is empty. */
static void job_task(void *ctxp, int w, int worker) {
    (void)worker;
    jobs_ctx *c = ctxp;
    int next = -1;
    do {
        for (int u, n; (n = take_front(&c->share[w], &u));) run_units(c, u, u + n, &next);
    } while (steal(c, w));
}

void fm_run_jobs(fm_pool *pool, const fm_job *jobs, int n_jobs) {
    const int threads = fm_pool_size(pool);
    share_t share[threads];
    for (int start = 0; start < n_jobs; start += MAX_JOBS) {
        jobs_ctx c = {.jobs = jobs + start, .n_jobs = n_jobs - start < MAX_JOBS ? n_jobs - start : MAX_JOBS,
                      .n_shares = threads, .share = share};
        c.first_unit[0] = 0;
        for (int j = 0; j < c.n_jobs; j++) {
            int rows = c.jobs[j].w->rows, per = unit_rows(&c.jobs[j]);
            c.unit_rows[j] = per;
            c.first_unit[j + 1] = c.first_unit[j] + (rows + per - 1) / per;
        }
        const uint64_t n_units = (uint64_t)c.first_unit[c.n_jobs];
        for (int i = 0; i < threads; i++)
            atomic_init(&share[i].range, range_of((uint32_t)(n_units * i / threads),
                                                  (uint32_t)(n_units * (i + 1) / threads)));
        fm_pool_run_each(pool, job_task, &c);
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
