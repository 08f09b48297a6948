/*
 * The optimizer's worker pool: persistent pthreads that sleep on a condition variable between
 * runs; the caller runs part 0 itself.
 *
 * Why pthreads and not OpenMP: the library is loaded into PyTorch processes that bring their
 * own OpenMP runtime (pip wheels ship a renamed libgomp); a second runtime in the same process
 * means two sets of spinning workers competing for the same cores. libgomp is also opaque to
 * ThreadSanitizer, which checks this code in the `concurrency` tests. A run here is one
 * broadcast and one wait; nothing spins, so a pool costs nothing while backward runs.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "optim.h"

#define SPW_POOL_MAX_THREADS 1024u

struct spw_optim_pool {
    unsigned threads;          /* the caller included */
    unsigned started;          /* workers running (threads - 1 once created) */
    unsigned fork_gen;         /* spw_fork_gen when created: a child of fork() has no workers */
    pthread_t *tids;
    pthread_mutex_t run_lock;  /* one run at a time */
    pthread_mutex_t mu;        /* guards everything below */
    pthread_cond_t wake;       /* a run started, or stop */
    pthread_cond_t done;       /* remaining reached 0 */
    uint64_t gen;              /* runs started */
    unsigned parts;            /* the current run's parts */
    unsigned remaining;        /* parts 1.. of the current run not yet finished */
    spw__pool_fn fn;
    void *arg;
    int stop;
};

typedef struct spw_pool_worker {
    spw_optim_pool *pool;
    unsigned index; /* 1 .. threads - 1 */
} spw_pool_worker;

static atomic_uint spw_fork_gen;
static pthread_once_t spw_atfork_once = PTHREAD_ONCE_INIT;

static void spw_pool_after_fork_child(void) { atomic_fetch_add(&spw_fork_gen, 1); }
static void spw_pool_register_atfork(void) {
    pthread_atfork(NULL, NULL, spw_pool_after_fork_child);
}

unsigned spw__cpus_allowed(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return (unsigned)n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (unsigned)n : 1u;
}

static void *spw_pool_worker_main(void *argp) {
    spw_pool_worker *w = argp;
    spw_optim_pool *pool = w->pool;
    const unsigned index = w->index;
    free(w);
    pthread_mutex_lock(&pool->mu);
    uint64_t seen = 0;
    for (;;) {
        while (!pool->stop && pool->gen == seen) pthread_cond_wait(&pool->wake, &pool->mu);
        if (pool->stop) break;
        seen = pool->gen;
        if (index >= pool->parts) continue;
        spw__pool_fn fn = pool->fn;
        void *arg = pool->arg;
        unsigned parts = pool->parts;
        pthread_mutex_unlock(&pool->mu);
        fn(arg, index, parts);
        pthread_mutex_lock(&pool->mu);
        if (--pool->remaining == 0) pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

static void spw_pool_stop_workers(spw_optim_pool *pool) {
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);
    for (unsigned i = 0; i < pool->started; i++) pthread_join(pool->tids[i], NULL);
    pool->started = 0;
}

static void spw_pool_free(spw_optim_pool *pool) {
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mu);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->tids);
    free(pool);
}

SPW_API spw_status spw_optim_pool_create(unsigned threads, spw_optim_pool **out) {
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_optim_pool_create: out is NULL");
    if (threads > SPW_POOL_MAX_THREADS)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "spw_optim_pool_create: %u threads (at most %u)", threads,
                          SPW_POOL_MAX_THREADS);
    if (threads == 0) threads = SPW_MIN(spw__cpus_allowed(), SPW_POOL_MAX_THREADS);
    pthread_once(&spw_atfork_once, spw_pool_register_atfork);

    spw_optim_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw_optim_pool_create: out of memory");
    pool->threads = threads;
    pool->fork_gen = atomic_load(&spw_fork_gen);
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    if (threads > 1) {
        pool->tids = calloc(threads - 1, sizeof *pool->tids);
        if (!pool->tids) {
            spw_pool_free(pool);
            return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw_optim_pool_create: out of memory");
        }
    }
    /* Workers take no signals: they belong to the threads the program made. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = 0;
    for (unsigned i = 1; i < threads; i++) {
        spw_pool_worker *w = malloc(sizeof *w);
        if (!w) {
            err = ENOMEM;
            break;
        }
        w->pool = pool;
        w->index = i;
        err = pthread_create(&pool->tids[i - 1], NULL, spw_pool_worker_main, w);
        if (err) {
            free(w);
            break;
        }
        pool->started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        unsigned started = pool->started;
        spw_pool_stop_workers(pool);
        spw_pool_free(pool);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY,
                          "spw_optim_pool_create: could not start worker %u of %u: %s",
                          started + 1, threads - 1, strerror(err));
    }
    *out = pool;
    return SPW_OK;
}

SPW_API void spw_optim_pool_destroy(spw_optim_pool *pool) {
    if (!pool) return;
    if (pool->fork_gen == atomic_load(&spw_fork_gen))
        spw_pool_stop_workers(pool);
    /* In a child of fork() the workers do not exist: nothing to join; the mutexes may have
     * been copied held, so they are left alone. */
    else {
        free(pool->tids);
        free(pool);
        return;
    }
    spw_pool_free(pool);
}

SPW_API unsigned spw_optim_pool_threads(const spw_optim_pool *pool) {
    return pool ? pool->threads : 0;
}

void spw__pool_run(spw_optim_pool *pool, unsigned parts, spw__pool_fn fn, void *arg) {
    if (parts <= 1 || pool->started == 0 || pool->fork_gen != atomic_load(&spw_fork_gen)) {
        for (unsigned i = 0; i < parts; i++) fn(arg, i, parts);
        return;
    }
    if (parts > pool->threads) parts = pool->threads;
    pthread_mutex_lock(&pool->run_lock);
    pthread_mutex_lock(&pool->mu);
    pool->fn = fn;
    pool->arg = arg;
    pool->parts = parts;
    pool->remaining = parts - 1;
    pool->gen++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);

    fn(arg, 0, parts);

    pthread_mutex_lock(&pool->mu);
    while (pool->remaining > 0) pthread_cond_wait(&pool->done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
    pthread_mutex_unlock(&pool->run_lock);
}

/* ---- the process-wide pool ---- */

static pthread_once_t spw_default_once = PTHREAD_ONCE_INIT;
static spw_optim_pool *spw_default_pool;
static char spw_default_error[512];

static void spw_default_pool_start(void) {
    if (spw_optim_pool_create(0, &spw_default_pool) != SPW_OK) {
        spw_default_pool = NULL;
        snprintf(spw_default_error, sizeof spw_default_error, "%s", spw_last_error());
    }
}

spw_optim_pool *spw__pool_default(void) {
    pthread_once(&spw_default_once, spw_default_pool_start);
    if (!spw_default_pool)
        spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "the default optimizer pool could not start: %s",
                   spw_default_error);
    return spw_default_pool;
}
