/* kernel_scratch.c: the per-thread scratch of the tiled products (every x86 ISA):
 * their prepared activations, grown on demand, freed when the thread exits. */
#include <pthread.h>
#include <stdlib.h>
#include "x86.h"

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static __thread void *scratch_ptr;
static __thread size_t scratch_size;

static void scratch_key_init(void) { pthread_key_create(&scratch_key, free); }

void *fm_kernel_scratch(size_t n)
{
    if (n <= scratch_size) return scratch_ptr;
    pthread_once(&scratch_once, scratch_key_init);
    free(scratch_ptr);
    n = (n + 65535) & ~(size_t)65535;
    scratch_ptr = aligned_alloc(64, n);
    scratch_size = scratch_ptr ? n : 0;
    pthread_setspecific(scratch_key, scratch_ptr);
    return scratch_ptr;
}
