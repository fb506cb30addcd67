/* membench.h: the plain read loops of membench.c, the yardstick bench/kernels.py
 * holds the kernels' bandwidth against (a benchmark probe, not part of the engine). */
#ifndef FERMOE_MEMBENCH_H
#define FERMOE_MEMBENCH_H

#include <stddef.h>
#include <stdint.h>

/* Sums the 64-bit words of the first nbytes & ~127 bytes. */
uint64_t fm_read_sum(const void *buf, size_t nbytes);
/* The same sum, the loop asking for each line FM_PF_DIST bytes ahead as the
 * matrix-vector kernels do: what their software prefetch costs a plain stream,
 * which without it runs on the hardware prefetchers alone. */
uint64_t fm_read_sum_prefetched(const void *buf, size_t nbytes);

#endif
