/* Memory read bandwidth through the engine's own pinned thread pool: the ceiling
 * the decode step is held against (bench decode's floor). */
#include <stdint.h>
#include <time.h>

#include "kernels.h"
#include "threadpool.h"

#define CHUNK (4u << 20)    /* bytes a task reads: large enough to stream, small enough to balance */

typedef struct { const uint8_t *buf; size_t nbytes; volatile uint64_t sink; } read_ctx;

static void read_task(void *p, int task, int worker) {
    (void)worker;
    read_ctx *c = p;
    size_t off = (size_t)task * CHUNK, n = c->nbytes - off < CHUNK ? c->nbytes - off : CHUNK;
    c->sink += fm_read_sum(c->buf + off, n & ~(size_t)127);
}

double fm_pool_read_gbps(fm_pool *pool, const void *buf, size_t nbytes, int reps) {
    read_ctx c = {buf, nbytes, 0};
    int tasks = (int)((nbytes + CHUNK - 1) / CHUNK);
    double best = 0.0;
    for (int r = 0; r <= reps; r++) {          /* the first pass warms up */
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        fm_pool_run(pool, read_task, &c, tasks);
        clock_gettime(CLOCK_MONOTONIC, &b);
        double gbps = nbytes / ((b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec)) / 1e9;
        if (r > 0 && gbps > best) best = gbps;
    }
    return best;
}
