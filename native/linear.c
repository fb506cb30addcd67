#include "linear.h"

#include "kernels.h"

/* Rows per task: at least MIN_ROWS so the claim and the kernel's prefetch
 * warm-up are amortised, and about TASKS_PER_THREAD tasks a thread on big
 * matrices so a long stream of rows is not cut into thousands of pieces. */
#define MIN_ROWS 64
#define TASKS_PER_THREAD 4
#define MAX_JOBS 64

typedef struct {
    const fm_job *jobs;
    int n_jobs;
    int rows_per_task[MAX_JOBS];
    int first_task[MAX_JOBS + 1];
} jobs_ctx;

static int rows_per_task(int rows, int threads) {
    int per = (rows + threads * TASKS_PER_THREAD - 1) / (threads * TASKS_PER_THREAD);
    per = (per + 15) & ~15;
    return per < MIN_ROWS ? MIN_ROWS : per;
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

static void job_task(void *ctxp, int task, int worker) {
    (void)worker;
    jobs_ctx *c = ctxp;
    int j = 0;
    while (task >= c->first_task[j + 1]) j++;
    int rb = (task - c->first_task[j]) * c->rows_per_task[j];
    int re = rb + c->rows_per_task[j];
    if (re > c->jobs[j].w->rows) re = c->jobs[j].w->rows;
    run_rows(&c->jobs[j], rb, re);
}

void fm_run_jobs(fm_pool *pool, const fm_job *jobs, int n_jobs) {
    for (int start = 0; start < n_jobs; start += MAX_JOBS) {
        jobs_ctx c = {.jobs = jobs + start, .n_jobs = n_jobs - start < MAX_JOBS ? n_jobs - start : MAX_JOBS};
        c.first_task[0] = 0;
        for (int j = 0; j < c.n_jobs; j++) {
            int rows = c.jobs[j].w->rows, per = rows_per_task(rows, fm_pool_size(pool));
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
    fm_pool_run(pool, quant_task, &c, B);
}
