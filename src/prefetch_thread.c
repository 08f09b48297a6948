/*
 * The prefetch worker (option prefetch_thread=on): the policy's prefetches that follow an
 * acquire, issued from a thread of the library instead of from the acquiring call.
 *
 * Why: under policy=plan an acquire usually makes the next buffer resident, and enqueuing that
 * copy is most of the call's host time (the driver splits a copy at every physical allocation of
 * the destination). A caller that acquires from a framework's hook wants that time off its own
 * thread, where the framework is enqueuing the kernels that use the buffer it just acquired.
 *
 * Contract:
 * - spw_acquire sets `pending` under the context lock and returns; the worker, under the same
 *   lock, calls pops->prefetch(after_acquire true) once for every run of posts. So the prefetch
 *   sees the policy's state after the latest acquire, as the acquire itself would have, only
 *   later; every effect is ordered by the lock as for any other caller. A buffer acquired before
 *   the worker got to it is simply made resident by its acquire (a demand load). A post that
 *   finds the previous one still pending is not handed over: its caller prefetches at once, so
 *   no acquire waits on a worker that cannot get the lock.
 * - A step boundary drops a pending prefetch (the boundary issues its own).
 * - Wake-ups: while a step is open the worker polls `pending` without the lock, yielding its
 *   core between polls, so a post takes no system call; outside steps it sleeps on a condition
 *   variable, and a post (or step begin) signals it.
 * - Errors of a prefetch are dropped, as the acquiring call dropped them: a prefetch is a hint.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "engine.h"

struct spw_pf {
    pthread_t thread;
    pthread_cond_t wake;
    atomic_bool pending;   /* posts since the worker's last prefetch */
    atomic_bool step_open; /* between spw_step_begin and spw_step_end: poll, do not sleep */
    atomic_bool stop;
    atomic_ullong runs;    /* prefetches issued (tests) */
    bool sleeping;         /* waiting on `wake` (context lock) */
    bool failed;           /* the thread could not be started: callers prefetch themselves */
};

static void *pf_main(void *arg) {
    spw_ctx *ctx = arg;
    struct spw_pf *w = ctx->engine->pf;
    pthread_mutex_lock(&ctx->lock);
    while (!atomic_load(&w->stop)) {
        if (atomic_exchange(&w->pending, false)) {
            struct spw_engine *e = ctx->engine;
            e->pops->prefetch(e->pol, ctx, true);
            spw__error_clear();
            atomic_fetch_add(&w->runs, 1);
            continue;
        }
        if (atomic_load(&w->step_open)) {
            pthread_mutex_unlock(&ctx->lock);
            while (atomic_load(&w->step_open) && !atomic_load(&w->pending) && !atomic_load(&w->stop))
                sched_yield();
            pthread_mutex_lock(&ctx->lock);
            continue;
        }
        w->sleeping = true;
        pthread_cond_wait(&w->wake, &ctx->lock);
        w->sleeping = false;
    }
    pthread_mutex_unlock(&ctx->lock);
    return NULL;
}

/* Lock held. The worker starts blocked on the lock the caller holds. */
static struct spw_pf *pf_get(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (e->pf) return e->pf->failed ? NULL : e->pf;
    struct spw_pf *w = calloc(1, sizeof *w);
    if (!w) return NULL; /* callers prefetch themselves; the next post tries again */
    atomic_init(&w->pending, false);
    atomic_init(&w->step_open, false);
    atomic_init(&w->stop, false);
    atomic_init(&w->runs, 0);
    e->pf = w;
    if (pthread_cond_init(&w->wake, NULL)) {
        w->failed = true;
        return NULL;
    }
    if (pthread_create(&w->thread, NULL, pf_main, ctx)) {
        pthread_cond_destroy(&w->wake);
        w->failed = true;
        return NULL;
    }
    return w;
}

bool spw__pf_post(spw_ctx *ctx) {
    if (!ctx->cfg.prefetch_thread) return false;
    struct spw_pf *w = pf_get(ctx);
    if (!w) return false;
    if (atomic_exchange(&w->pending, true)) {
        /* the worker has not taken the previous post (a caller acquiring in a tight loop keeps
         * the lock busy): the caller prefetches now, for both */
        atomic_store(&w->pending, false);
        return false;
    }
    if (w->sleeping) pthread_cond_signal(&w->wake);
    return true;
}

void spw__pf_step(spw_ctx *ctx, bool begin) {
    struct spw_pf *w = ctx->engine->pf;
    if (!w || w->failed) return;
    atomic_store(&w->step_open, begin);
    if (begin) {
        if (w->sleeping) pthread_cond_signal(&w->wake);
    } else {
        atomic_store(&w->pending, false);
    }
}

uint64_t spw__pf_runs(spw_ctx *ctx) {
    struct spw_pf *w = ctx->engine->pf;
    return w ? (uint64_t)atomic_load(&w->runs) : 0;
}

void spw__pf_stop(spw_ctx *ctx) {
    struct spw_pf *w = ctx->engine->pf;
    if (!w) return;
    if (!w->failed) {
        pthread_mutex_lock(&ctx->lock);
        atomic_store(&w->stop, true);
        pthread_cond_signal(&w->wake);
        pthread_mutex_unlock(&ctx->lock);
        pthread_join(w->thread, NULL);
        pthread_cond_destroy(&w->wake);
    }
    ctx->engine->pf = NULL;
    free(w);
}
