/* membench.h: the benchmark probes (not part of the engine): the plain read loops of
 * membench.c, the yardstick bench/kernels.py holds the kernels' bandwidth against, and
 * bandwidth.c's parallel passes through the engine's own thread pool. */
#ifndef FERMOE_MEMBENCH_H
#define FERMOE_MEMBENCH_H

#include <stddef.h>
#include <stdint.h>

#include "threadpool.h"

/* Sums the 64-bit words of the first nbytes & ~127 bytes. */
uint64_t fm_read_sum(const void *buf, size_t nbytes);
/* The same sum, the loop asking for each line FM_PF_DIST bytes ahead as the
 * matrix-vector kernels do: what their software prefetch costs a plain stream,
 * which without it runs on the hardware prefetchers alone. */
uint64_t fm_read_sum_prefetched(const void *buf, size_t nbytes);


/* Probes of bandwidth.c. Seconds of one parallel read pass over buf, in ~4 MB tasks: */
double fm_pool_read_seconds(fm_pool *pool, const void *buf, size_t nbytes);
/* the same with the kernels' software prefetch (fm_read_sum_prefetched): */
double fm_pool_read_prefetched_seconds(fm_pool *pool, const void *buf, size_t nbytes);
/* the best read bandwidth (GB/s) of `reps` such passes, after one untimed: */
double fm_pool_read_gbps(fm_pool *pool, const void *buf, size_t nbytes, int reps);
/* seconds a parallel region of empty tasks takes (start to join), the mean of
 * `reps` after as many untimed: the least a region costs, whatever it does. */
double fm_pool_region_overhead_seconds(fm_pool *pool, int reps);
/* seconds of one Q4_0 x Q8_0 matrix-vector product W[rows, cols] . x -> y[rows],
 * rows split into ~4 MB tasks. */
double fm_pool_matvec_q4_0_seconds(fm_pool *pool, const void *W, const void *x, float *y, int rows, int cols);
/* seconds of a sequence of parallel regions shaped like a decode step's: Q4_0
 * matrices k = 0..n_mats-1 (rows[k] x cols[k], at byte offsets[k] into W) run through
 * the forward's own fm_run_jobs, region i holding matrices [region_end[i-1],
 * region_end[i]); x: Q8_0 activations of the widest, y: room for the rows of the
 * largest region. */
double fm_pool_regions_q4_0_seconds(fm_pool *pool, const void *W, const int64_t *offsets, const int *rows,
                                    const int *cols, int n_mats, const int *region_end, int n_regions,
                                    const void *x, float *y);

#endif
