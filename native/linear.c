#include "linear.h"

#include "kernels.h"

/* Tasks are cut by bytes over all the jobs of a region, not per job: a decode
 * step's 16 expert matrices of 590 KB would otherwise become 128 tasks of 73 KB,
 * each a fresh memory stream that starts cold. A region gets about
 * TASKS_PER_THREAD tasks a thread (enough for the atomic claim to even out), none
 * smaller than MIN_TASK_BYTES nor MIN_ROWS rows, and a task never spans two jobs. */
#define MIN_ROWS 16
#define MIN_TASK_BYTES (128 << 10)
#define TASKS_PER_THREAD 8
#define MAX_JOBS 64

typedef struct {
    const fm_job *jobs;
    int n_jobs;
    int rows_per_task[MAX_JOBS];
    int first_task[MAX_JOBS + 1];
} jobs_ctx;

static size_t row_bytes(const fm_tensor *w) {
    switch (w->type) {
    case FM_Q4_0: return (size_t)w->cols / FM_QK * sizeof(block_q4_0);
    case FM_Q8_0: return (size_t)w->cols / FM_QK * sizeof(block_q8_0);
    default: return (size_t)w->cols * sizeof(float);
    }
}

static int rows_per_task(const fm_job *j, size_t task_bytes) {
    size_t per = (task_bytes + row_bytes(j->w) - 1) / row_bytes(j->w);
    per = (per + 15) & ~(size_t)15;
    if (per < MIN_ROWS) per = MIN_ROWS;
    return per > (size_t)j->w->rows ? j->w->rows : (int)per;
}

static const uint8_t *matrix(const fm_tensor *w, int mat) {
    return (const uint8_t *)w->data + (int64_t)mat * w->mat_stride;
}

static void run_rows(const fm_job *j, int rb, int re) {
    const fm_tensor *w = j->w;
    const uint8_t *base = matrix(w, j->mat);
    int cols = w->cols;
    switch (w->type) {
    case FM_Q4_0:
        if (j->B == 1) fm_matvec_q4_0((const block_q4_0 *)base, j->xq, j->y, cols, rb, re);
        else fm_matmul_q4_0((const block_q4_0 *)base, j->xq, j->y, cols, j->B, j->ldy, rb, re);
        break;
    case FM_Q8_0:
        if (j->B == 1) fm_matvec_q8_0((const block_q8_0 *)base, j->xq, j->y, cols, rb, re);
        else fm_matmul_q8_0((const block_q8_0 *)base, j->xq, j->y, cols, j->B, j->ldy, rb, re);
        break;
    default:
        if (j->B == 1) fm_matvec_f32((const float *)base, j->x, j->y, cols, rb, re);
        else fm_matmul_f32((const float *)base, j->x, j->y, cols, j->B, j->ldy, rb, re);
    }
}

/* The first FM_PF_DIST bytes of a task: the kernels prefetch that far ahead of
 * where they read, so without this a task's start would wait on memory. */
static void prefetch_head(const uint8_t *p, size_t n) {
    if (n > FM_PF_DIST) n = FM_PF_DIST;
    for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

static void job_task(void *ctxp, int task, int worker) {
    (void)worker;
    jobs_ctx *c = ctxp;
    int j = 0;
    while (task >= c->first_task[j + 1]) j++;
    const fm_job *job = &c->jobs[j];
    int rb = (task - c->first_task[j]) * c->rows_per_task[j];
    int re = rb + c->rows_per_task[j];
    if (re > job->w->rows) re = job->w->rows;
    size_t rbytes = row_bytes(job->w);
    prefetch_head(matrix(job->w, job->mat) + rb * rbytes, (size_t)(re - rb) * rbytes);
    run_rows(job, rb, re);
}

void fm_run_jobs(fm_pool *pool, const fm_job *jobs, int n_jobs) {
    for (int start = 0; start < n_jobs; start += MAX_JOBS) {
        jobs_ctx c = {.jobs = jobs + start, .n_jobs = n_jobs - start < MAX_JOBS ? n_jobs - start : MAX_JOBS};
        size_t total = 0;
        for (int j = 0; j < c.n_jobs; j++) total += row_bytes(c.jobs[j].w) * c.jobs[j].w->rows;
        size_t task_bytes = total / ((size_t)fm_pool_size(pool) * TASKS_PER_THREAD);
        if (task_bytes < MIN_TASK_BYTES) task_bytes = MIN_TASK_BYTES;
        c.first_task[0] = 0;
        for (int j = 0; j < c.n_jobs; j++) {
            int rows = c.jobs[j].w->rows, per = rows_per_task(&c.jobs[j], task_bytes);
            c.rows_per_task[j] = per;
            c.first_task[j + 1] = c.first_task[j] + (rows + per - 1) / per;
        }
        fm_pool_run(pool, job_task, &c, c.first_task[c.n_jobs]);
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
