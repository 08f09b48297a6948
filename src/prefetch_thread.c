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
 *   core between polls, and then takes the lock by trying, so a post takes no system call (not
 *   even the unlock's wake-up of a blocked worker); outside steps it sleeps on a condition
 *   variable, and a post (or step begin) signals it.
 * - Errors of a prefetch are dropped, as the acquiring call dropped them: a prefetch is a hint.
 * - Release marks: spw_release leaves the record of a buffer's last use (an event on the
 *   caller's stream, the call's main cost) to the worker, which records every pending mark
 *   before anything else, so the event lands right after the use as the release would have put
 *   it, give or take the work the caller enqueued meanwhile (later, never earlier: safe).
 *   Until then the buffer is in the lazy state every path already handles (dev_rec false, last
 *   touch in stream order on dev_s); an eviction or teardown that comes first records it
 *   itself (spw__pf_unmark), so what follows is what it would be without the worker.
 *   Contract: the stream of such a release must stay valid until the next spw_step_end, the
 *   buffer's eviction or destruction, or the context's destruction: each of them records what
 *   is still pending.
 * - Watches: an upload enqueued while the worker runs goes on its watch list. While a step is
 *   open the worker asks the driver, at most every WATCH_NS and under the lock (taken by trying,
 *   as above), whether the oldest watched upload is complete, and sets its dev_done. An acquire
 *   of a watched buffer then asks nothing: complete means no wait; not yet seen complete means
 *   its stream waits on the upload's event (perhaps complete a moment ago: a wait on a complete
 *   event costs the device nothing). So the caller's call makes one driver call at most, where
 *   it made two (the query, then the wait), and none once the upload is done; each is a
 *   large part of a framework hook's host time. Uploads share one stream and complete in
 *   order, so one question a poll is enough; an entry whose buffer was since evicted, waited
 *   on or touched again is dropped.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "engine.h"

enum { PF_MARKS = 64, PF_WATCH = 64 };
#define WATCH_NS 20000 /* between two questions about the oldest watched upload */

struct spw_pf {
    spw_buf *marks[PF_MARKS]; /* released buffers whose last use is not yet recorded (lock) */
    int nmarks;
    atomic_bool marked;    /* marks were added since the worker last took them */
    atomic_ullong nrec;    /* marks recorded by the worker (tests) */
    spw_buf *watch[PF_WATCH]; /* uploads to watch, oldest first, a ring (lock) */
    int whead, nwatch;
    atomic_int watching;   /* nwatch, read by the polling worker without the lock */
    uint64_t last_poll;    /* spw__now_ns of the latest question (worker only) */
    atomic_ullong seen;    /* uploads seen complete (tests) */
    pthread_t thread;
    pthread_cond_t wake;
    atomic_bool pending;   /* posts since the worker's last prefetch */
    atomic_bool step_open; /* between spw_step_begin and spw_step_end: poll, do not sleep */
    atomic_bool stop;
    atomic_ullong runs;    /* prefetches issued (tests) */
    bool sleeping;         /* waiting on `wake` (context lock) */
    bool failed;           /* the thread could not be started: callers prefetch themselves */
};

/* Lock held: record b's last use on dev_s, if it is still unrecorded. A failed record leaves
 * the lazy state, which every path handles (it only costs exactness). */
static void mark_record(spw_ctx *ctx, spw_buf *b) {
    b->marking = false;
    if (b->dev_rec || !b->dev_touched) return;
    if (spw__copy_record_dev(ctx, b, b->dev_s)) spw__error_clear();
    else b->dev_rec = true;
}

/* Lock held: record every pending mark. */
static void marks_record(spw_ctx *ctx, struct spw_pf *w) {
    for (int i = 0; i < w->nmarks; i++) mark_record(ctx, w->marks[i]);
    atomic_fetch_add(&w->nrec, (unsigned long long)w->nmarks);
    w->nmarks = 0;
}

/* Lock held: the oldest watched uploads that are complete get dev_done; stops at the first one
 * still running (the H2D stream completes them in order). */
static void watch_poll(spw_ctx *ctx, struct spw_pf *w) {
    struct spw_engine *e = ctx->engine;
    while (w->nwatch) {
        spw_buf *b = w->watch[w->whead];
        if (b->resident && b->xfer && b->dev_rec && !b->dev_done && b->dev_s == e->h2d) {
            spw_status q = ctx->backend->ops->event_query(ctx->backend, b->ev_dev);
            if (q != SPW_OK) {
                if (q != SPW_ERR_NOT_READY) spw__error_clear(); /* acquires wait as without a watch */
                return;
            }
            b->dev_done = true;
            atomic_fetch_add(&w->seen, 1);
        }
        b->watched = false;
        w->whead = (w->whead + 1) % PF_WATCH;
        atomic_store(&w->watching, --w->nwatch);
    }
}

static bool watch_due(struct spw_pf *w) {
    return atomic_load(&w->watching) && spw__now_ns() - w->last_poll >= WATCH_NS;
}

static void *pf_main(void *arg) {
    spw_ctx *ctx = arg;
    struct spw_pf *w = ctx->engine->pf;
    pthread_mutex_lock(&ctx->lock);
    while (!atomic_load(&w->stop)) {
        if (atomic_exchange(&w->marked, false)) {
            marks_record(ctx, w);
            continue;
        }
        if (atomic_exchange(&w->pending, false)) {
            struct spw_engine *e = ctx->engine;
            e->pops->prefetch(e->pol, ctx, true);
            spw__error_clear();
            atomic_fetch_add(&w->runs, 1);
            continue;
        }
        if (atomic_load(&w->step_open)) {
            if (watch_due(w)) {
                w->last_poll = spw__now_ns();
                watch_poll(ctx, w);
            }
            pthread_mutex_unlock(&ctx->lock);
            while (atomic_load(&w->step_open) && !atomic_load(&w->pending) && !atomic_load(&w->marked) &&
                   !atomic_load(&w->stop) && !watch_due(w))
                sched_yield();
            /* A post is made under the lock, so the poster still holds it: wait by trying, not
             * by blocking, or its unlock would have to wake this thread (a system call in the
             * caller's acquire or release). */
            while (pthread_mutex_trylock(&ctx->lock)) sched_yield();
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
    atomic_init(&w->marked, false);
    atomic_init(&w->nrec, 0);
    atomic_init(&w->watching, 0);
    atomic_init(&w->seen, 0);
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

bool spw__pf_mark(spw_ctx *ctx, spw_buf *b) {
    if (!ctx->cfg.prefetch_thread || b->managed) return false;
    struct spw_pf *w = pf_get(ctx);
    if (!w) return false;
    if (!b->marking) {
        if (w->nmarks == PF_MARKS) return false;
        w->marks[w->nmarks++] = b;
        b->marking = true;
    }
    atomic_store(&w->marked, true);
    if (w->sleeping) pthread_cond_signal(&w->wake);
    return true;
}

void spw__pf_unmark(spw_ctx *ctx, spw_buf *b) {
    if (!b->marking) return;
    struct spw_pf *w = ctx->engine->pf;
    for (int i = 0; i < w->nmarks; i++) {
        if (w->marks[i] == b) {
            w->marks[i] = w->marks[--w->nmarks];
            break;
        }
    }
    mark_record(ctx, b);
}

void spw__pf_watch(spw_ctx *ctx, spw_buf *b) {
    struct spw_pf *w = ctx->engine->pf;
    if (!w || w->failed || b->watched || w->nwatch == PF_WATCH) return;
    w->watch[(w->whead + w->nwatch) % PF_WATCH] = b;
    atomic_store(&w->watching, ++w->nwatch);
    b->watched = true;
}

void spw__pf_unwatch(spw_ctx *ctx, spw_buf *b) {
    struct spw_pf *w = ctx->engine->pf;
    if (!b->watched || !w) return;
    int n = 0; /* the ring without b, in order */
    for (int i = 0; i < w->nwatch; i++) {
        spw_buf *x = w->watch[(w->whead + i) % PF_WATCH];
        if (x != b) w->watch[(w->whead + n++) % PF_WATCH] = x;
    }
    w->nwatch = n;
    atomic_store(&w->watching, n);
    b->watched = false;
}

uint64_t spw__pf_seen(spw_ctx *ctx) {
    struct spw_pf *w = ctx->engine->pf;
    return w ? (uint64_t)atomic_load(&w->seen) : 0;
}

uint64_t spw__pf_marked(spw_ctx *ctx) {
    struct spw_pf *w = ctx->engine->pf;
    return w ? (uint64_t)atomic_load(&w->nrec) : 0;
}

void spw__pf_step(spw_ctx *ctx, bool begin) {
    struct spw_pf *w = ctx->engine->pf;
    if (!w || w->failed) return;
    atomic_store(&w->step_open, begin);
    if (begin) {
        if (w->sleeping) pthread_cond_signal(&w->wake);
    } else {
        atomic_store(&w->pending, false);
        marks_record(ctx, w); /* so that a release's stream need outlive its step only */
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
        marks_record(ctx, w); /* teardown then waits on every buffer's last use as without it */
        for (; w->nwatch; w->nwatch--, w->whead = (w->whead + 1) % PF_WATCH) w->watch[w->whead]->watched = false;
        atomic_store(&w->stop, true);
        pthread_cond_signal(&w->wake);
        pthread_mutex_unlock(&ctx->lock);
        pthread_join(w->thread, NULL);
        pthread_cond_destroy(&w->wake);
    }
    ctx->engine->pf = NULL;
    free(w);
}
