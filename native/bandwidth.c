/* Memory read bandwidth through the engine's own pinned thread pool: the ceiling
 * the decode step is held against (bench decode's floor); the Q4_0 matrix-vector
 * product through the same pool, so that the two are measured the way the forward
 * runs; and what an empty parallel region costs the pool. bench kernels times
 * single passes of each, alternated, and compares them pair by pair: on a noisy
 * machine only neighbouring passes share the conditions a ratio needs. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "linear.h"
#include "membench.h"
#include "threadpool.h"

#define CHUNK (4u << 20)    /* bytes a task reads: large enough to stream, small enough to balance */

typedef struct { const uint8_t *buf; size_t nbytes; uint64_t (*sum)(const void *, size_t); volatile uint64_t sink; } read_ctx;

static void read_task(void *p, int task, int worker) {
    (void)worker;
    read_ctx *c = p;
    size_t off = (size_t)task * CHUNK, n = c->nbytes - off < CHUNK ? c->nbytes - off : CHUNK;
    c->sink += c->sum(c->buf + off, n & ~(size_t)127);
}

static double pass_seconds(fm_pool *pool, fm_task_fn fn, void *ctx, int n_tasks) {
    const double t0 = fm_now();
    fm_pool_run(pool, fn, ctx, n_tasks);
    return fm_now() - t0;
}

static double read_pass(fm_pool *pool, const void *buf, size_t nbytes, uint64_t (*sum)(const void *, size_t)) {
    read_ctx c = {buf, nbytes, sum, 0};
    return pass_seconds(pool, read_task, &c, (int)((nbytes + CHUNK - 1) / CHUNK));
}

double fm_pool_read_seconds(fm_pool *pool, const void *buf, size_t nbytes) {
    return read_pass(pool, buf, nbytes, fm_read_sum);
}

double fm_pool_read_prefetched_seconds(fm_pool *pool, const void *buf, size_t nbytes) {
    return read_pass(pool, buf, nbytes, fm_read_sum_prefetched);
}

double fm_pool_read_gbps(fm_pool *pool, const void *buf, size_t nbytes, int reps) {
    double best = 0.0;
    for (int r = 0; r <= reps; r++) {  /* pass 0 is the warm-up */
        double gbps = nbytes / fm_pool_read_seconds(pool, buf, nbytes) / 1e9;
        if (r > 0 && gbps > best) best = gbps;
    }
    return best;
}

static void no_task(void *p, int task, int worker) { (void)p, (void)task, (void)worker; }

double fm_pool_region_overhead_seconds(fm_pool *pool, int reps) {
    for (int r = 0; r < reps; r++) fm_pool_run_each(pool, no_task, NULL);
    const double t0 = fm_now();
    for (int r = 0; r < reps; r++) fm_pool_run_each(pool, no_task, NULL);
    return (fm_now() - t0) / reps;
}

typedef struct { const void *W, *x; float *y; int rows, cols, rows_per_task; } matvec_ctx;

static void matvec_task(void *p, int task, int worker) {
    (void)worker;
    matvec_ctx *c = p;
    int r0 = task * c->rows_per_task, r1 = r0 + c->rows_per_task < c->rows ? r0 + c->rows_per_task : c->rows;
    fm_matvec_q4_0(c->W, c->x, c->y, c->cols, r0, r1);
}

double fm_pool_matvec_q4_0_seconds(fm_pool *pool, const void *W, const void *x, float *y, int rows, int cols) {
    const size_t row_bytes = (size_t)cols / FM_QK * sizeof(block_q4_0);
    int per = (int)(CHUNK / row_bytes);
    per = per < 16 ? 16 : per;
    matvec_ctx c = {W, x, y, rows, cols, per};
    return pass_seconds(pool, matvec_task, &c, (rows + per - 1) / per);
}

double fm_pool_regions_q4_0_seconds(fm_pool *pool, const void *W, const int64_t *offsets, const int *rows,
                                    const int *cols, int n_mats, const int *region_end, int n_regions,
                                    const void *x, float *y) {
    fm_tensor *mats = calloc((size_t)n_mats, sizeof *mats);
    fm_job *jobs = calloc((size_t)n_mats, sizeof *jobs);
    if (!mats || !jobs) {
        free(mats), free(jobs);
        return -1.0;
    }
    for (int i = 0, k = 0; i < n_regions; i++)
        for (size_t row = 0; k < region_end[i]; row += rows[k++]) {     /* a region's outputs side by side */
            mats[k] = (fm_tensor){(const uint8_t *)W + offsets[k], FM_Q4_0, rows[k], cols[k], 0};
            jobs[k] = (fm_job){.w = &mats[k], .xq = x, .B = 1, .y = y + row, .ldy = rows[k]};
        }
    const double t0 = fm_now();
    for (int i = 0, k = 0; i < n_regions; k = region_end[i++])
        fm_run_jobs(pool, jobs + k, region_end[i] - k);
    const double seconds = fm_now() - t0;
    free(mats), free(jobs);
    return seconds;
}
