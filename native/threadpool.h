/* A small fixed thread pool for the forward: threads created once, pinned to given
 * CPUs, woken per parallel region. The calling thread takes part as worker 0, so a
 * pool of N threads starts N-1 of its own.
 *
 * How a region shares its work:
 *   fm_pool_run        n tasks claimed one at a time from a shared counter by whichever
 *                      thread is free: uneven tasks balance themselves (linear.c's row
 *                      blocks, a GDN layer's heads, attention's segments);
 *   fm_pool_run_each   one call per worker, which divides the work itself (no counter to
 *                      contend on);
 *   fm_pool_run_light  tasks of about a microsecond: a few run in the caller alone.
 * Each returns when every task is done. Idle workers spin briefly, then sleep; the
 * caller waits for the last one the same way (threadpool.c says why). */
#ifndef FM_THREADPOOL_H
#define FM_THREADPOOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct fm_pool fm_pool;

/* Seconds on the monotonic clock: the one clock of the forward's timings. */
double fm_now(void);

/* fn(ctx, task, worker) is called once for every task in [0, n_tasks). */
typedef void (*fm_task_fn)(void *ctx, int task, int worker);

/* cpus: n_threads CPU ids to pin to (cpus[0] for the caller, until the pool is
 * destroyed), or NULL for no pinning. Returns NULL on failure (errno set). */
fm_pool *fm_pool_create(int n_threads, const int *cpus);
void fm_pool_destroy(fm_pool *pool);
int fm_pool_size(const fm_pool *pool);
/* Runs every task, blocking until all are done (one task runs in the caller). Not reentrant. */
void fm_pool_run(fm_pool *pool, fm_task_fn fn, void *ctx, int n_tasks);
/* fn(ctx, w, w) once on every worker w < fm_pool_size: for work the region divides
 * itself (no shared task counter for the threads to contend on). */
void fm_pool_run_each(fm_pool *pool, fm_task_fn fn, void *ctx);
/* The same as fm_pool_run for tasks of about a microsecond: up to FM_POOL_INLINE_TASKS of them run in
 * the caller, since starting and joining a region costs more than that. */
enum { FM_POOL_INLINE_TASKS = 8 };
void fm_pool_run_light(fm_pool *pool, fm_task_fn fn, void *ctx, int n_tasks);
/* Where parallel time goes (off until enabled; call between regions): the parallel
 * regions run, their seconds from start to the last worker's end, and the seconds
 * the workers spent inside tasks, summed over workers; busy / (threads x region
 * seconds) is the share of the threads' time a region keeps busy. Regions that
 * run inline (one task, or a pool of one) are not counted. */
void fm_pool_stats_enable(fm_pool *pool, int on);
void fm_pool_stats(fm_pool *pool, int64_t *regions, double *region_seconds, double *busy_seconds, int reset);
/* The running total of region seconds behind fm_pool_stats (0 while never enabled). */
double fm_pool_region_seconds(const fm_pool *pool);

#endif
