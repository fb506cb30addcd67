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

/* Where a thread's weight reads go next: the byte after the rows its last kernel
 * calls read, for each of a job's (at most two) matrices. The kernels prefetch
 * FM_PF_DIST past where they read, so a segment that starts there is already on
 * its way; any other start is cold. */
typedef struct { const uint8_t *at[2]; } stream_t;

/* The first FM_PF_DIST bytes from p (at most n): what the kernels' own prefetch
 * would have asked for had the stream come from just before p. */
static void prefetch_head(const uint8_t *p, size_t n) {
    if (n > FM_PF_DIST) n = FM_PF_DIST;
    for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Units [u, end) of job j: the rows and where each of its matrices' rows start. */
typedef struct { int rb, re; const uint8_t *at[2]; size_t bytes; } segment_t;

static segment_t segment(const jobs_ctx *c, int j, int u, int end) {
    const fm_job *job = &c->jobs[j];
    int stop = end < c->first_unit[j + 1] ? end : c->first_unit[j + 1];
    segment_t s = {(u - c->first_unit[j]) * c->unit_rows[j], (stop - c->first_unit[j]) * c->unit_rows[j]};
    if (s.re > job->w->rows) s.re = job->w->rows;
    size_t rbytes = row_bytes(job->w);
    s.bytes = (size_t)(s.re - s.rb) * rbytes;
    s.at[0] = matrix(job->w, job->mat) + s.rb * rbytes;
    s.at[1] = job->w_up ? matrix(job->w_up, job->mat) + s.rb * rbytes : NULL;
    return s;
}

/* Where the thread's stream is after a segment: the ends of its matrices' rows. */
static stream_t end_of(const fm_job *j, const segment_t *s) {
    size_t rbytes = row_bytes(j->w);
    const uint8_t *up = j->w_up ? matrix(j->w_up, j->mat) + s->re * rbytes : NULL;
    return (stream_t){{matrix(j->w, j->mat) + s->re * rbytes, up}};
}

static int warm(const stream_t *st, const uint8_t *p) { return p == st->at[0] || p == st->at[1]; }

/* Asks for the heads of a segment's matrices that the stream is not already at;
 * returns how many it asked for. */
static int prefetch_cold(const stream_t *st, const segment_t *s) {
    int cold = 0;
    for (int m = 0; m < 2; m++)
        if (s->at[m] && !warm(st, s->at[m])) prefetch_head(s->at[m], s->bytes), cold++;
    return cold;
}

/* A segment's rows; the stream ends where they do. `next` (or NULL): the segment
 * the thread reads after it. When that starts elsewhere (the next selected expert,
 * the next projection), its heads are asked for before this segment's last
 * FM_PF_DIST bytes are computed, so that they arrive meanwhile: the kernels' own
 * prefetch runs on past the end of this matrix and cannot know them. One token
 * only (a batched product prepares its activations again at each call). Returns
 * 1 when it asked for next's heads. */
static int run_segment(const fm_job *j, const segment_t *s, const segment_t *next, stream_t *st) {
    const fm_tensor *last = j->w_up ? j->w_up : j->w;
    float *y_last = j->w_up ? j->y_up : j->y;
    *st = end_of(j, s);
    int split = s->re;
    if (next && j->B == 1 && ((next->at[0] && !warm(st, next->at[0])) || (next->at[1] && !warm(st, next->at[1])))) {
        int tail = (int)((FM_PF_DIST + row_bytes(last) - 1) / row_bytes(last));
        split = s->re - tail > s->rb ? s->re - tail : s->rb;
    }
    if (j->w_up) product(j, j->w, j->y, s->rb, s->re);
    if (split > s->rb) product(j, last, y_last, s->rb, split);
    int asked = 0;
    if (split < s->re) {
        asked = prefetch_cold(st, next);
        product(j, last, y_last, split, s->re);
    }
    if (j->w_up) swiglu_rows(j, s->rb, s->re);
    if (j->done) j->done(j->done_ctx, s->rb, s->re);
    return asked;
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

/* The job unit u belongs to. */
static int job_of(const jobs_ctx *c, int u) {
    int j = 0;
    while (u >= c->first_unit[j + 1]) j++;
    return j;
}

/* Units [u, end) of the region, one segment a job they cover; `then` is the unit
 * the thread takes after them (the front of what is left of its share), or -1. */
static void run_units(const jobs_ctx *c, int u, int end, int then, stream_t *st) {
    int j = job_of(c, u), asked = 0;
    segment_t s = segment(c, j, u, end);
    for (;;) {
        int stop = end < c->first_unit[j + 1] ? end : c->first_unit[j + 1], nj = -1;
        segment_t next;
        if (stop < end) nj = j + 1, next = segment(c, nj, stop, end);
        else if (then >= 0) nj = job_of(c, then), next = segment(c, nj, then, then + 1);
        if (!asked) prefetch_cold(st, &s);
        asked = run_segment(&c->jobs[j], &s, nj >= 0 ? &next : NULL, st);
        if (stop >= end) return;
        j = nj, s = next;
    }
}

/* Worker w: its own share, then stolen halves, until every share is empty. */
static void job_task(void *ctxp, int w, int worker) {
    (void)worker;
    jobs_ctx *c = ctxp;
    stream_t st = {{NULL, NULL}};
    do {
        for (int u, n; (n = take_front(&c->share[w], &u));) {
            uint64_t r = atomic_load_explicit(&c->share[w].range, memory_order_relaxed);
            int then = (uint32_t)r < (uint32_t)(r >> 32) ? (int)(uint32_t)r : -1;
            run_units(c, u, u + n, then, &st);
        }
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
