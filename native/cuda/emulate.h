/* emulate.h: the CUDA execution model on the host, for the kernels of this folder
 * (prelude.cuh includes it when FM_EMULATE is defined; gpu_worker/emulator.py
 * builds the kernels with g++ into a shared library and launches them through it).
 *
 * A launch runs its blocks one after the other on a few host threads. Within a
 * block every CUDA thread is a fiber with its own stack; fibers switch only at
 * __syncthreads(), so
 *
 *   block (bx, by, bz), n = bx*by*bz threads
 *   round r:  fiber 0 runs to its r-th barrier, then fiber 1, ... fiber n-1
 *             (threadIdx set before each resume)
 *   all have arrived -> round r+1 releases them, in the same order
 *
 * and __shared__ arrays are static thread_local: one copy per host thread, which
 * runs one block at a time. A barrier reached by some threads while others have
 * exited, or threads waiting at different __syncthreads calls, is an error (the
 * GPU's behaviour there is undefined), reported by the launch.
 *
 * Arguments arrive as an array of pointers to their values, as cuLaunchKernel
 * takes them; FM_EMU_KERNEL(name, sig) checks at compile time that the kernel's
 * parameters match the signature the Python launcher packs (P pointer, i int,
 * I unsigned, f float, q / Q 64-bit). */
#ifndef FM_EMULATE_H
#define FM_EMULATE_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __shared__ static thread_local
#define __forceinline__ inline
#define __launch_bounds__(...)

struct fm_uint3 {
    unsigned x, y, z;
};
static thread_local fm_uint3 threadIdx, blockIdx, blockDim, gridDim;

/* ---- atomics: blocks of one launch run on several host threads ---- */
static inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline float atomicAdd(float *p, float v)
{
    uint32_t *u = (uint32_t *)p, old = __atomic_load_n(u, __ATOMIC_RELAXED), next;
    do {
        float f;
        memcpy(&f, &old, 4);
        f += v;
        memcpy(&next, &f, 4);
    } while (!__atomic_compare_exchange_n(u, &old, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    float out;
    memcpy(&out, &old, 4);
    return out;
}
static inline int atomicMax(int *p, int v)
{
    int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}

/* ---- fibers ---- */
struct fm_fiber {
    void *sp;
    int barrier_line;        /* where it waits: every thread must wait at the same call */
    unsigned tid;
    bool done;
};

static thread_local fm_fiber *fm_cur;
static thread_local void *fm_sched_sp;
static thread_local void (*fm_thunk)(void **);
static thread_local void **fm_args;

#if defined(__x86_64__)
/* Saves the callee-saved registers, MXCSR and the x87 control word on the current
 * stack, stores its pointer in *save, and resumes the stack `load` in the same way. */
extern "C" void fm_emu_swap(void **save, void *load);
__asm__(".text\n"
        ".hidden fm_emu_swap\n"
        ".globl fm_emu_swap\n"
        ".type fm_emu_swap,@function\n"
        "fm_emu_swap:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
        "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
        "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size fm_emu_swap, .-fm_emu_swap\n");
#else
#error "the host emulation's fiber switch is written for x86-64"
#endif

/* A fiber starts here (the first swap into it "returns" to this function) and
 * never returns: once done it hands the host thread back for good. */
static void fm_fiber_main(void)
{
    fm_thunk(fm_args);
    fm_cur->done = true;
    fm_emu_swap(&fm_cur->sp, fm_sched_sp);
    abort(); /* never resumed */
}

static void *fm_fiber_stack_init(char *base, size_t size)
{
    uintptr_t top = ((uintptr_t)(base + size)) & ~(uintptr_t)15;
    uint64_t *sp = (uint64_t *)top;
    *--sp = 0;                          /* fm_fiber_main's (unused) return address */
    *--sp = (uint64_t)(uintptr_t)&fm_fiber_main;
    for (int i = 0; i < 6; i++) *--sp = 0;   /* rbp rbx r12 r13 r14 r15 */
    --sp;
    uint32_t mxcsr;
    uint16_t fpucw;
    __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
    __asm__ volatile("fnstcw %0" : "=m"(fpucw));
    memcpy(sp, &mxcsr, 4);
    memcpy((char *)sp + 4, &fpucw, 2);
    return sp;
}

/* The barrier's source line tells barriers apart (the compiler may duplicate one
 * call into several, so return addresses would not). */
__attribute__((noinline)) static void fm_emu_sync(int line)
{
    fm_fiber *f = fm_cur;
    f->barrier_line = line;
    fm_emu_swap(&f->sp, fm_sched_sp);
}
#define __syncthreads() fm_emu_sync(__LINE__)

/* ---- blocks on a host thread ---- */
#define FM_EMU_MAX_THREADS 1024
#define FM_EMU_STACK (64u << 10)
#define FM_EMU_GUARD 4096u

static std::mutex fm_error_lock;
static char fm_error[512];

static void fm_emu_fail(const char *fmt, const char *name, const fm_uint3 &b)
{
    std::lock_guard<std::mutex> g(fm_error_lock);
    if (!fm_error[0]) snprintf(fm_error, sizeof fm_error, fmt, name, b.x, b.y, b.z);
}

struct fm_host_thread {
    char *stacks = nullptr;
    fm_fiber fibers[FM_EMU_MAX_THREADS];

    /* Stacks for 1024 fibers, each above a guard page (a stack overflow faults). */
    bool reserve()
    {
        if (stacks) return true;
        size_t one = FM_EMU_STACK + FM_EMU_GUARD;
        void *p = mmap(nullptr, one * FM_EMU_MAX_THREADS, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return false;
        stacks = (char *)p;
        for (unsigned i = 0; i < FM_EMU_MAX_THREADS; i++) mprotect(stacks + i * one, FM_EMU_GUARD, PROT_NONE);
        return true;
    }

    /* Runs block blockIdx to the end; false (and fm_error set) on a barrier misuse. */
    bool run_block(const char *name)
    {
        unsigned n = blockDim.x * blockDim.y * blockDim.z;
        size_t one = FM_EMU_STACK + FM_EMU_GUARD;
        for (unsigned i = 0; i < n; i++) {
            fibers[i].sp = fm_fiber_stack_init(stacks + i * one + FM_EMU_GUARD, FM_EMU_STACK);
            fibers[i].tid = i;
            fibers[i].done = false;
        }
        unsigned live = n;
        while (live) {
            unsigned exited = 0, waiting = 0;
            int line = -1;
            bool same_line = true;
            for (unsigned i = 0; i < n; i++) {
                fm_fiber *f = &fibers[i];
                if (f->done) continue;
                threadIdx.x = i % blockDim.x;
                threadIdx.y = i / blockDim.x % blockDim.y;
                threadIdx.z = i / (blockDim.x * blockDim.y);
                fm_cur = f;
                fm_emu_swap(&fm_sched_sp, f->sp);
                if (f->done) {
                    exited++;
                } else {
                    waiting++;
                    if (line < 0) line = f->barrier_line;
                    same_line &= line == f->barrier_line;
                }
            }
            live -= exited;
            if (waiting && exited) {
                fm_emu_fail("%s: in block (%u,%u,%u) some threads exited while others wait at __syncthreads",
                            name, blockIdx);
                return false;
            }
            if (!same_line) {
                fm_emu_fail("%s: threads of block (%u,%u,%u) wait at different __syncthreads calls", name,
                            blockIdx);
                return false;
            }
        }
        return true;
    }
};

static thread_local fm_host_thread fm_here;

/* ---- launches, spread over a pool of host threads ---- */
struct fm_launch {
    void (*thunk)(void **);
    void **args;
    fm_uint3 grid, block;
    const char *name;
    std::atomic<long> next{0};
    long nblocks;
};

static void fm_run_blocks(fm_launch *L)
{
    if (!fm_here.reserve()) {
        fm_emu_fail("%s: no memory for the fibers' stacks (block %u,%u,%u)", L->name, L->grid);
        return;
    }
    fm_thunk = L->thunk;
    fm_args = L->args;
    blockDim = L->block;
    gridDim = L->grid;
    for (long b; (b = L->next.fetch_add(1)) < L->nblocks;) {
        blockIdx.x = (unsigned)(b % L->grid.x);
        blockIdx.y = (unsigned)(b / L->grid.x % L->grid.y);
        blockIdx.z = (unsigned)(b / ((long)L->grid.x * L->grid.y));
        if (!fm_here.run_block(L->name)) {
            L->next.store(L->nblocks);
            return;
        }
    }
}

struct fm_pool {
    std::vector<std::thread> workers;
    std::mutex lock;
    std::condition_variable wake, idle;
    fm_launch *job = nullptr;
    unsigned long generation = 0;
    unsigned busy = 0;

    explicit fm_pool(unsigned helpers)
    {
        for (unsigned i = 0; i < helpers; i++) workers.emplace_back([this] { serve(); });
    }

    void serve()
    {
        unsigned long seen = 0;
        for (;;) {
            fm_launch *L;
            {
                std::unique_lock<std::mutex> g(lock);
                wake.wait(g, [&] { return generation != seen; });
                seen = generation;
                L = job;
            }
            fm_run_blocks(L);
            std::lock_guard<std::mutex> g(lock);
            if (--busy == 0) idle.notify_all();
        }
    }

    void run(fm_launch *L)
    {
        {
            std::lock_guard<std::mutex> g(lock);
            job = L;
            busy = (unsigned)workers.size();
            generation++;
        }
        wake.notify_all();
        fm_run_blocks(L);
        std::unique_lock<std::mutex> g(lock);
        idle.wait(g, [&] { return busy == 0; });
    }
};

static fm_pool *fm_the_pool;
static unsigned fm_pool_threads = 1;

/* Host threads the launches use (the caller included); set before the first launch. */
extern "C" void fm_emu_set_threads(unsigned n) { fm_pool_threads = n ? n : 1; }

extern "C" const char *fm_emu_error(void) { return fm_error; }

static int fm_emu_launch(void (*thunk)(void **), void **args, const unsigned *g, const unsigned *b,
                         const char *name)
{
    static std::mutex launching;    /* one launch at a time: the pool and the thread_locals are shared */
    std::lock_guard<std::mutex> one(launching);
    fm_error[0] = 0;
    fm_launch L;
    L.thunk = thunk;
    L.args = args;
    L.grid = {g[0], g[1], g[2]};
    L.block = {b[0], b[1], b[2]};
    L.name = name;
    L.nblocks = (long)g[0] * g[1] * g[2];
    if ((unsigned long)b[0] * b[1] * b[2] > FM_EMU_MAX_THREADS || !b[0] || !b[1] || !b[2] || !L.nblocks) {
        fm_emu_fail("%s: a block of (%u,%u,%u) threads: must be 1 to 1024", name, L.block);
        return -1;
    }
    if (!fm_the_pool) fm_the_pool = new fm_pool(fm_pool_threads - 1);
    unsigned helpers = (unsigned)fm_the_pool->workers.size();
    if (L.nblocks == 1 || helpers == 0) {
        fm_run_blocks(&L);
    } else {
        fm_the_pool->run(&L);
    }
    return fm_error[0] ? -1 : 0;
}

/* ---- the kernel table: each declared kernel gets a checked launch entry ---- */
template <typename T>
constexpr char fm_sig_char()
{
    using U = typename std::remove_cv<T>::type;
    return std::is_pointer<U>::value                     ? 'P'
           : std::is_same<U, int>::value                 ? 'i'
           : std::is_same<U, unsigned>::value            ? 'I'
           : std::is_same<U, float>::value               ? 'f'
           : std::is_same<U, long long>::value           ? 'q'
           : std::is_same<U, unsigned long long>::value  ? 'Q'
                                                         : '?';
}

template <typename... A>
constexpr bool fm_sig_is(void (*)(A...), const char *sig)
{
    const char got[] = {fm_sig_char<A>()..., '\0'};
    for (unsigned i = 0;; i++) {
        if (got[i] != sig[i]) return false;
        if (!got[i]) return true;
    }
}

template <typename... A, size_t... I>
static void fm_emu_call(void (*f)(A...), void **args, std::index_sequence<I...>)
{
    f(*static_cast<typename std::remove_reference<A>::type *>(args[I])...);
}

template <typename... A>
static void fm_emu_call(void (*f)(A...), void **args)
{
    fm_emu_call(f, args, std::index_sequence_for<A...>{});
}

#define FM_EMU_KERNEL(name, sig)                                                                     \
    static_assert(fm_sig_is(name, sig), "kernel " #name ": its parameters do not match the signature " \
                                        sig " declared in gpu_worker/kernels.py");                   \
    static void fm_thunk_##name(void **a) { fm_emu_call(name, a); }                                  \
    extern "C" int fm_emu_launch_##name(const unsigned *g, const unsigned *b, void **a)              \
    {                                                                                                \
        return fm_emu_launch(fm_thunk_##name, a, g, b, #name);                                       \
    }

#endif /* FM_EMULATE_H */
