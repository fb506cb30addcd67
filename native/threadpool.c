/* Work distribution: tasks are claimed from one atomic counter, so uneven tasks
 * balance themselves. Workers spin briefly on a generation number before sleeping
 * on a condition variable: a decode step runs hundreds of short regions per token,
 * and a futex wake-up per region would cost more than the region. The caller waits
 * for the region's last worker the same way: spinning, then asleep. Each thread is
 * pinned to its own CPU, so a worker that another process preempts holds up the
 * region's end until it runs again: a caller spinning all that time would burn its
 * own CPU's share (the scheduler then takes that time back from it later), where
 * asleep it is woken, ahead of the other process, when the worker is done. */
#define _GNU_SOURCE
#include "threadpool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SPIN_ITERATIONS 200000      /* ~100 us on the 2-core VM: longer than a decode step's serial gaps */
#define JOIN_SPIN_ITERATIONS 100000 /* the caller's, ~50 us: past a region's uneven end, well short of a time slice */

/* The lines the threads meet on each have one of their own: idle workers spin
 * reading `generation`, so a store to anything sharing its line (each finishing
 * worker's decrement of `pending`, each task claimed from `next_task`, the next
 * region's description) would take the line from 15 readers on a 16-core machine. */
struct fm_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_cond_t joined;
    _Alignas(64) atomic_int generation;      /* bumped to start a region */
    _Alignas(64) atomic_int next_task;
    _Alignas(64) atomic_int pending;         /* workers still inside the current region */
    atomic_int caller_asleep;                /* the caller waits on `joined` for pending to reach 0 */
    _Alignas(64) int n_tasks;                /* the region, written before its generation */
    int each;                   /* fm_pool_run_each: every worker runs its own index once */
    fm_task_fn fn;
    void *ctx;
    int stop;
    const int *cpus;
    pthread_t caller;           /* pinned while the pool lives; its old affinity comes back on destroy */
    int stats;                  /* fm_pool_stats_enable */
    int64_t regions;
    double region_seconds;      /* the caller's view: start to the last worker's end */
    struct { _Alignas(64) double seconds; } *busy;   /* per worker: time inside its tasks */
    cpu_set_t caller_affinity;
};

typedef struct { fm_pool *pool; int worker; } worker_arg;

static void pin_to(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

double fm_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void drain_tasks(fm_pool *p, int worker) {
    if (p->each) {
        p->fn(p->ctx, worker, worker);
        return;
    }
    for (int t; (t = atomic_fetch_add(&p->next_task, 1)) < p->n_tasks;)
        p->fn(p->ctx, t, worker);
}

/* The region's tasks of one worker; timed when the pool keeps statistics (the
 * worker's own line: nothing crosses cores until fm_pool_stats reads them). */
static void drain(fm_pool *p, int worker) {
    if (!p->stats) {
        drain_tasks(p, worker);
        return;
    }
    double t0 = fm_now();
    drain_tasks(p, worker);
    p->busy[worker].seconds += fm_now() - t0;
}

static void *worker_main(void *argp) {
    worker_arg arg = *(worker_arg *)argp;
    free(argp);
    fm_pool *p = arg.pool;
    if (p->cpus) pin_to(p->cpus[arg.worker]);
    int seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&p->generation, memory_order_acquire) == seen && spins < SPIN_ITERATIONS)
            spins++;
        if (atomic_load(&p->generation) == seen) {
            pthread_mutex_lock(&p->lock);
            while (atomic_load(&p->generation) == seen && !p->stop) pthread_cond_wait(&p->wake, &p->lock);
            pthread_mutex_unlock(&p->lock);
        }
        if (p->stop) return NULL;
        seen = atomic_load(&p->generation);
        drain(p, arg.worker);
        /* seq_cst with the caller's store to caller_asleep and load of pending: one
         * of the two sees the other, so the caller never sleeps through the last one */
        if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_asleep)) {
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->joined);
            pthread_mutex_unlock(&p->lock);
        }
    }
}

fm_pool *fm_pool_create(int n_threads, const int *cpus) {
    if (n_threads < 1) { errno = EINVAL; return NULL; }
    fm_pool *p = aligned_alloc(64, sizeof *p);   /* a multiple of 64: its lines are aligned */
    if (!p) return NULL;
    memset(p, 0, sizeof *p);
    p->n_threads = n_threads;
    p->threads = calloc(n_threads, sizeof *p->threads);
    p->busy = aligned_alloc(64, (size_t)n_threads * sizeof *p->busy);
    if (!p->threads || !p->busy) {
        free(p->threads);
        free(p->busy);
        free(p);
        errno = ENOMEM;
        return NULL;
    }
    for (int i = 0; i < n_threads; i++) p->busy[i].seconds = 0.0;
    if (cpus) {
        int *copy = malloc(n_threads * sizeof *copy);
        for (int i = 0; i < n_threads; i++) copy[i] = cpus[i];
        p->cpus = copy;
        p->caller = pthread_self();
        pthread_getaffinity_np(p->caller, sizeof p->caller_affinity, &p->caller_affinity);
        pin_to(cpus[0]);
    }
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->joined, NULL);
    for (int i = 1; i < n_threads; i++) {
        worker_arg *arg = malloc(sizeof *arg);
        arg->pool = p;
        arg->worker = i;
        if (pthread_create(&p->threads[i], NULL, worker_main, arg) != 0) {
            p->n_threads = i;
            fm_pool_destroy(p);
            return NULL;
        }
    }
    return p;
}

/* Until every worker is out of the region: spinning for JOIN_SPIN_ITERATIONS, then asleep. */
static void join(fm_pool *p) {
    for (int spins = 0; spins < JOIN_SPIN_ITERATIONS; spins++)
        if (atomic_load_explicit(&p->pending, memory_order_acquire) == 0) return;
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->caller_asleep, 1);
    while (atomic_load(&p->pending) > 0) pthread_cond_wait(&p->joined, &p->lock);
    atomic_store(&p->caller_asleep, 0);
    pthread_mutex_unlock(&p->lock);
}

static void run(fm_pool *p, fm_task_fn fn, void *ctx, int n_tasks, int each) {
    const double t0 = p->stats ? fm_now() : 0.0;
    p->each = each;
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next_task, 0);
    atomic_store(&p->pending, p->n_threads - 1);
    pthread_mutex_lock(&p->lock);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    drain(p, 0);
    join(p);
    if (p->stats) {
        p->regions++;
        p->region_seconds += fm_now() - t0;
    }
}

void fm_pool_run(fm_pool *p, fm_task_fn fn, void *ctx, int n_tasks) {
    if (p->n_threads == 1 || n_tasks <= 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    run(p, fn, ctx, n_tasks, 0);
}

void fm_pool_run_each(fm_pool *p, fm_task_fn fn, void *ctx) {
    if (p->n_threads == 1) fn(ctx, 0, 0);
    else run(p, fn, ctx, p->n_threads, 1);
}

void fm_pool_run_light(fm_pool *p, fm_task_fn fn, void *ctx, int n_tasks) {
    if (n_tasks > FM_POOL_INLINE_TASKS) {
        fm_pool_run(p, fn, ctx, n_tasks);
        return;
    }
    for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
}

int fm_pool_size(const fm_pool *p) { return p->n_threads; }

void fm_pool_stats_enable(fm_pool *p, int on) { p->stats = on; }

double fm_pool_region_seconds(const fm_pool *p) { return p->region_seconds; }

void fm_pool_stats(fm_pool *p, int64_t *regions, double *region_seconds, double *busy_seconds, int reset) {
    double busy = 0.0;
    for (int i = 0; i < p->n_threads; i++) {
        busy += p->busy[i].seconds;
        if (reset) p->busy[i].seconds = 0.0;
    }
    *regions = p->regions, *region_seconds = p->region_seconds, *busy_seconds = busy;
    if (reset) p->regions = 0, p->region_seconds = 0.0;
}

void fm_pool_destroy(fm_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    p->stop = 1;
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->joined);
    /* A library user's thread (a test run, say) must not stay confined to one CPU:
     * threads it starts later would inherit that. */
    if (p->cpus) pthread_setaffinity_np(p->caller, sizeof p->caller_affinity, &p->caller_affinity);
    free((void *)p->cpus);
    free(p->busy);
    free(p->threads);
    free(p);
}
