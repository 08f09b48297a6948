/*
 * The engine's event sink: stall time (always) and, with option trace=FILE, a Chrome trace JSON
 * of copies, evictions and stalls, one track per stream, viewable in Perfetto or chrome://tracing.
 *
 * Records are written from two kinds of threads: API callers (instant events such as evictions,
 * under the context lock) and stream callbacks (spans timed on the stream itself: a host
 * callback before and after a transfer). Stream callbacks may run after the context is gone, so
 * the sink is reference counted: the engine holds one reference and every pending span holds
 * one; the last reference closes the JSON array and the file. Its own mutex guards the file.
 * Nothing here calls spillway or the backend except the span helpers, which run under the
 * context lock and only enqueue.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

#define MAX_TRACKS 64

struct spw_tsink {
    atomic_int refs;
    _Atomic uint64_t stall_ns;
    pthread_mutex_t m; /* guards everything below */
    FILE *f;
    uint64_t t0;
    int nev;
    uintptr_t tracks[MAX_TRACKS];
    int ntracks;
};

spw_status spw__tsink_create(const char *path, spw_tsink **out) {
    spw_tsink *t = calloc(1, sizeof *t);
    if (!t) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "trace: out of host memory");
    atomic_init(&t->refs, 1);
    atomic_init(&t->stall_ns, 0);
    pthread_mutex_init(&t->m, NULL);
    t->t0 = spw__now_ns();
    if (path && *path) {
        t->f = fopen(path, "w");
        if (!t->f) {
            pthread_mutex_destroy(&t->m);
            free(t);
            return spw__error(SPW_ERR_IO, "option 'trace': cannot open '%s' for writing", path);
        }
        fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n", t->f);
    }
    *out = t;
    return SPW_OK;
}

void spw__tsink_get(spw_tsink *t) { atomic_fetch_add(&t->refs, 1); }

void spw__tsink_put(spw_tsink *t) {
    if (!t || atomic_fetch_sub(&t->refs, 1) != 1) return;
    if (t->f) {
        fputs("\n]}\n", t->f);
        fclose(t->f);
    }
    pthread_mutex_destroy(&t->m);
    free(t);
}

bool spw__tsink_tracing(const spw_tsink *t) { return t && t->f; }
uint64_t spw__tsink_stall_ns(spw_tsink *t) { return atomic_load(&t->stall_ns); }
void spw__tsink_add_stall(spw_tsink *t, uint64_t ns) { atomic_fetch_add(&t->stall_ns, ns); }

/* Track id of a stream (a thread in the trace's terms); names it on first sight. m held. */
static int track_of(spw_tsink *t, spw_stream s, const char *name) {
    uintptr_t key = (uintptr_t)s;
    for (int i = 0; i < t->ntracks; i++)
        if (t->tracks[i] == key) return i + 1;
    if (t->ntracks == MAX_TRACKS) return MAX_TRACKS + 1; /* shared overflow track */
    t->tracks[t->ntracks++] = key;
    int id = t->ntracks;
    fprintf(t->f, "%s{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":\"%s %p\"}}",
            t->nev++ ? ",\n" : "", id, name ? name : "stream", (void *)s);
    return id;
}

void spw__tsink_complete(spw_tsink *t, const char *name, const char *cat, spw_stream stream,
                         const char *track, uint64_t t0_ns, uint64_t t1_ns, uint64_t bytes,
                         uint64_t buf_id) {
    if (!spw__tsink_tracing(t)) return;
    pthread_mutex_lock(&t->m);
    int tid = track_of(t, stream, track);
    uint64_t a = t0_ns > t->t0 ? t0_ns - t->t0 : 0, b = t1_ns > t0_ns ? t1_ns - t0_ns : 0;
    fprintf(t->f,
            ",\n{\"ph\":\"X\",\"name\":\"%s\",\"cat\":\"%s\",\"pid\":1,\"tid\":%d,\"ts\":%.3f,"
            "\"dur\":%.3f,\"args\":{\"bytes\":%llu,\"buffer\":%llu}}",
            name, cat, tid, (double)a / 1e3, (double)b / 1e3, (unsigned long long)bytes,
            (unsigned long long)buf_id);
    t->nev++;
    pthread_mutex_unlock(&t->m);
}

void spw__tsink_instant(spw_tsink *t, const char *name, spw_stream stream, const char *track,
                        uint64_t bytes, uint64_t buf_id) {
    if (!spw__tsink_tracing(t)) return;
    uint64_t now = spw__now_ns();
    pthread_mutex_lock(&t->m);
    int tid = track_of(t, stream, track);
    fprintf(t->f,
            ",\n{\"ph\":\"i\",\"s\":\"t\",\"name\":\"%s\",\"cat\":\"engine\",\"pid\":1,\"tid\":%d,"
            "\"ts\":%.3f,\"args\":{\"bytes\":%llu,\"buffer\":%llu}}",
            name, tid, (double)(now - t->t0) / 1e3, (unsigned long long)bytes,
            (unsigned long long)buf_id);
    t->nev++;
    pthread_mutex_unlock(&t->m);
}

/* ---- spans timed on a stream ---- */

typedef struct span {
    spw_tsink *t;
    atomic_int refs;       /* callbacks still to run (+1 while the enqueuer holds it) */
    _Atomic uint64_t t0;   /* written by the begin callback */
    char name[48], track[16];
    spw_stream s;
    uint64_t bytes, buf_id;
    int stall; /* a wait of a caller's stream: the duration counts as stall time */
} span;

static void span_drop(span *sp) {
    if (atomic_fetch_sub(&sp->refs, 1) != 1) return;
    spw__tsink_put(sp->t);
    free(sp);
}

static void span_begin_cb(void *arg) {
    span *sp = arg;
    atomic_store(&sp->t0, spw__now_ns());
    span_drop(sp);
}

static void span_end_cb(void *arg) {
    span *sp = arg;
    uint64_t t1 = spw__now_ns(), t0 = atomic_load(&sp->t0);
    if (t0 && sp->stall) spw__tsink_add_stall(sp->t, t1 > t0 ? t1 - t0 : 0);
    if (t0) spw__tsink_complete(sp->t, sp->name, sp->track, sp->s, sp->track, t0, t1, sp->bytes, sp->buf_id);
    span_drop(sp);
}

void *spw__tsink_span_begin(spw_ctx *ctx, spw_stream s, const char *name, const char *track,
                            uint64_t bytes, uint64_t buf_id, int stall) {
    spw_tsink *t = ctx->engine->sink;
    /* Only with the trace: a host callback holds the stream for a round trip through the host,
     * and a stall is a moment the stream is already waiting for. */
    if (!spw__tsink_tracing(t)) return NULL;
    span *sp = calloc(1, sizeof *sp);
    if (!sp) return NULL;
    sp->t = t;
    spw__tsink_get(t);
    atomic_init(&sp->refs, 2); /* the begin callback + the enqueuer */
    atomic_init(&sp->t0, 0);
    snprintf(sp->name, sizeof sp->name, "%s", name);
    snprintf(sp->track, sizeof sp->track, "%s", track);
    sp->s = s;
    sp->bytes = bytes;
    sp->buf_id = buf_id;
    sp->stall = stall;
    spw_backend *be = ctx->backend;
    spw_status st = be->ops->launch_host(be, s, span_begin_cb, sp);
    if (st) {
        atomic_fetch_sub(&sp->refs, 1); /* the begin callback will never run */
        span_drop(sp);
        return NULL;
    }
    return sp;
}

void spw__tsink_span_end(spw_ctx *ctx, spw_stream s, void *token) {
    span *sp = token;
    if (!sp) return;
    spw_backend *be = ctx->backend;
    /* the enqueuer's reference passes to the end callback; if it cannot be enqueued, drop it */
    if (be->ops->launch_host(be, s, span_end_cb, sp)) span_drop(sp);
}
