/*
 * The process's heap for a framework's own host optimizer step (spw_optim_keep_freed in
 * spillway_optim.h): glibc's mmap and trim thresholds raised so that the step's large
 * temporaries are reused from step to step instead of mapped, faulted in and unmapped each time.
 * glibc only: the thresholds are its own, and other C libraries have no such control.
 */
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "internal.h"
#include "spillway_optim.h"

/* Above a tensor's bytes: posix_memalign's alignment and the chunk's header. */
#define SLACK ((size_t)1 << 20)
/* glibc's own rule raises the mmap threshold up to this (4 Mi longs); never set it lower, which
 * would stop that rule and map what glibc would have kept. */
#define GLIBC_DYN_MAX ((size_t)32 << 20)
/* Freed bytes kept at the heap's top, in kept allocations: a step holds a few at a time. */
#define TRIM_FACTOR 4
#define KEEP_MAX ((size_t)INT_MAX - SLACK)

static pthread_mutex_t heap_lock = PTHREAD_MUTEX_INITIALIZER;
static size_t heap_kept; /* the allocation size kept so far (heap_lock) */

/* Whether the environment sets glibc's malloc thresholds: the process's own choice stands. */
static bool user_tuned(void) {
    static const char *const vars[] = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                       "MALLOC_MMAP_MAX_"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return true;
    const char *t = getenv("GLIBC_TUNABLES");
    return t && (strstr(t, "glibc.malloc.mmap_threshold") || strstr(t, "glibc.malloc.trim_threshold") ||
                 strstr(t, "glibc.malloc.mmap_max"));
}

SPW_API spw_status spw_optim_keep_freed(size_t bytes, size_t *kept) {
    if (bytes == 0 || bytes > KEEP_MAX)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_optim_keep_freed: %zu bytes (want 1 to %zu)",
                          bytes, KEEP_MAX);
#if !defined(__GLIBC__)
    (void)kept;
    (void)user_tuned;
    return spw__error(SPW_ERR_UNSUPPORTED,
                      "spw_optim_keep_freed: the C library is not glibc (no thresholds to raise)");
#else
    spw_status st = SPW_OK;
    size_t now;
    pthread_mutex_lock(&heap_lock);
    if (user_tuned()) {
        now = 0;
    } else if (bytes <= heap_kept) {
        now = heap_kept;
    } else {
        size_t mmap_at = SPW_MAX(bytes + SLACK, GLIBC_DYN_MAX);
        size_t trim_at = SPW_MIN(mmap_at * TRIM_FACTOR, (size_t)INT_MAX);
        if (!mallopt(M_MMAP_THRESHOLD, (int)mmap_at))
            st = spw__error(SPW_ERR_UNSUPPORTED,
                            "spw_optim_keep_freed: mallopt refused an mmap threshold of %zu bytes "
                            "(a glibc that caps it lower, or another allocator in place of glibc's)",
                            mmap_at);
        else if (!mallopt(M_TRIM_THRESHOLD, (int)trim_at))
            st = spw__error(SPW_ERR_UNSUPPORTED,
                            "spw_optim_keep_freed: mallopt refused a trim threshold of %zu bytes", trim_at);
        else
            heap_kept = bytes;
        now = heap_kept;
    }
    pthread_mutex_unlock(&heap_lock);
    if (!st && kept) *kept = now;
    return st;
#endif
}
