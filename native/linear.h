/* Matrix products of the forward pass, spread over the thread pool. A job is
 * y[b][r] = W[r] . x[b] for every row r of one weight matrix and every one of B
 * activation rows; several jobs run in one parallel region so small matrices
 * (the experts' gates and ups, the GDN's four projections) share the threads. */
#ifndef FM_LINEAR_H
#define FM_LINEAR_H

#include "fermoe_blocks.h"
#include "model.h"
#include "threadpool.h"

typedef struct {
    const fm_tensor *w;
    int mat;                    /* which expert of a 3-D tensor (0 for 2-D) */
    const float *x;             /* [B][cols] fp32 activations (used by F32 weights) */
    const block_q8_0 *xq;       /* [B][cols/32] the same, quantised (used by Q4_0/Q8_0 weights) */
    int B;
    float *y;                   /* y[b * ldy + r] */
    int ldy;
    /* Optional, a gated pair (an FFN's gate and up projections): w_up has w's shape
     * and takes the same x into y_up, then y = silu(y) * y_up; with hq set, those
     * rows of y are quantised to Q8_0 too (hq[b * rows/32 ...], the next
     * projection's input), so nothing is left for a serial step between regions. */
    const fm_tensor *w_up;
    float *y_up;
    block_q8_0 *hq;
    /* Optional: done(done_ctx, rb, re) runs on the thread that computed rows [rb, re)
     * of y (after the pair's SiLU), while they are in its cache: per-row work that
     * would otherwise need a parallel region of its own (the GDN's conv). */
    void (*done)(void *done_ctx, int rb, int re);
    void *done_ctx;
} fm_job;

void fm_run_jobs(fm_pool *pool, const fm_job *jobs, int n_jobs);

/* Quantise B rows of n floats (row stride n) to Q8_0, in parallel. */
void fm_quantize_rows(fm_pool *pool, const float *x, block_q8_0 *y, int B, int n);

#endif
