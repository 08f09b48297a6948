/*
 * emu streams and events: the ordered work of the emulated device (see backend_emu.c for the
 * device model as a whole, backend_emu.h for the shared state and lock rules).
 *
 * - Streams: one worker thread per stream (the default stream NULL included, created with the
 *   backend) runs enqueued items in FIFO order. The default stream is an ordinary ordered
 *   stream: it has no legacy implicit synchronization with other streams.
 * - Events are positions, not flags: record captures (stream, sequence number of the last item
 *   enqueued on it); the event is complete once that stream has finished that item. A wait
 *   captures the position current at the wait, so re-recording (or destroying) the event later
 *   does not affect it. A never-recorded event is complete. Stream structs are never freed
 *   before the backend (destroyed ones are recycled and their sequence numbers keep counting
 *   up), so a captured position stays readable, and complete once its stream was destroyed.
 * - Work items (copies, host launches, prefetches, event waits) are recycled through a free
 *   list: no allocation in the steady state. Host callbacks and copies run on the worker with
 *   q_lock released.
 * - emu_h2d_gbps > 0 makes H2D/D2H copies and prefetches take bytes/rate, each stream's
 *   transfers on a clock of their own (throttle).
 */
#include <errno.h>
#include <pthread.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend_emu.h"

/* ---- streams: workers and queues ---- */

/* Make a transfer of `bytes` that started at t0 end no earlier than bytes / rate after the link
 * was free: a transfer queued behind the previous one (started within LINK_GAP_NS of its end)
 * starts where that one ended, so that the sleeps' overshoot is not added once per transfer and
 * a run of small copies moves at the rate; after an idle link the clock starts at t0. */
#define LINK_GAP_NS 100000u
static void throttle(const emu_backend *e, emu_stream *s, size_t bytes, uint64_t t0) {
    if (e->gbps <= 0) return;
    uint64_t start = t0 <= s->link_ns + LINK_GAP_NS ? s->link_ns : t0;
    uint64_t end = start + (uint64_t)((double)bytes / e->gbps); /* GB/s == bytes/ns */
    s->link_ns = end;
    uint64_t now = spw__now_ns();
    if (end <= now) return;
    struct timespec ts = {(time_t)((end - now) / 1000000000u), (long)((end - now) % 1000000000u)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Block until stream s has finished item `seq`. q_lock held. */
static void wait_done(emu_backend *e, const emu_stream *s, uint64_t seq) {
    while (s->done_seq < seq) {
        e->done_waiters++;
        pthread_cond_wait(&e->cv_done, &e->q_lock);
        e->done_waiters--;
    }
}

/* The worker of one stream: runs its items in order until stopped with an empty queue. */
static void *worker(void *arg) {
    emu_stream *s = arg;
    emu_backend *e = s->b;
#ifdef __linux__
    /* a transfer's sleep ends within microseconds of its time, not the default 50 us slack */
    (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
    pthread_mutex_lock(&e->q_lock);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv_work, &e->q_lock);
        emu_item *it = s->head;
        if (!it) break;
        if (it->kind == W_WAIT) {
            wait_done(e, it->u.wait.s, it->u.wait.seq);
        } else {
            /* Enqueuers may write it->next meanwhile; only the payload is read unlocked. */
            pthread_mutex_unlock(&e->q_lock);
            uint64_t t0 = spw__now_ns();
            if (it->kind == W_HOST) {
                it->u.host.fn(it->u.host.arg);
            } else if (it->kind == W_COPY) {
                memmove(it->u.copy.dst, it->u.copy.src, it->u.copy.bytes);
                if (it->u.copy.timed) throttle(e, s, it->u.copy.bytes, t0);
            } else {
                throttle(e, s, it->u.prefetch_bytes, t0);
            }
            pthread_mutex_lock(&e->q_lock);
        }
        if (!(s->head = it->next)) s->tail = NULL;
        s->done_seq = it->seq;
        it->next = e->free_items;
        e->free_items = it;
        if (e->done_waiters) pthread_cond_broadcast(&e->cv_done);
    }
    pthread_mutex_unlock(&e->q_lock);
    return NULL;
}

/* The stream behind a handle (NULL: the default stream); NULL with the message set if the
 * handle is unknown or destroyed. q_lock held. */
static emu_stream *stream_get(emu_backend *e, spw_stream h, const char *call) {
    void *k = (void *)h;
    emu_stream *s = h ? NULL : e->def;
    if (h) HASH_FIND_PTR(e->live, &k, s);
    if (!s)
        spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: %s: unknown or destroyed stream %p", call, k);
    return s;
}

/* Append an item to s, returned for the caller to fill before unlocking; NULL with the
 * message set when out of memory. Items are recycled: no allocation in the steady state. */
static emu_item *enqueue(emu_backend *e, emu_stream *s, emu_work kind, const char *call) {
    emu_item *it = e->free_items;
    if (it) {
        e->free_items = it->next;
    } else if (!(it = malloc(sizeof *it))) {
        spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: %s: out of memory for a work item", call);
        return NULL;
    }
    it->next = NULL;
    it->kind = kind;
    it->seq = ++s->enq_seq;
    if (s->tail) {
        s->tail->next = it;
    } else {
        s->head = it;
        pthread_cond_signal(&s->cv_work);
    }
    return s->tail = it;
}

/* Drain s, stop its worker, join it and park the struct for reuse. q_lock held (released
 * while joining). */
void spw__emu_stream_stop(emu_backend *e, emu_stream *s) {
    wait_done(e, s, s->enq_seq);
    s->stop = 1;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&e->q_lock);
    pthread_join(s->thread, NULL);
    pthread_mutex_lock(&e->q_lock);
    s->next_dead = e->dead;
    e->dead = s;
}

/* A stream struct with a running worker: a recycled one (its sequence numbers keep counting)
 * or a new one. Called without q_lock. */
spw_status spw__emu_stream_start(emu_backend *e, emu_stream **out) {
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s = e->dead;
    if (s) e->dead = s->next_dead;
    pthread_mutex_unlock(&e->q_lock);
    int fresh = !s, rc = ENOMEM;
    if (fresh && (s = calloc(1, sizeof *s)) != NULL) {
        s->b = e;
        s->key = s;
        if (pthread_cond_init(&s->cv_work, NULL) != 0) {
            free(s);
            s = NULL;
        }
    }
    if (s) {
        s->stop = 0;
        rc = pthread_create(&s->thread, NULL, worker, s);
    }
    pthread_mutex_lock(&e->q_lock);
    if (s && rc != 0) { /* park it; a fresh one is on `all` to be freed with the backend */
        s->next_dead = e->dead;
        e->dead = s;
    }
    if (s && fresh) {
        s->next_all = e->all;
        e->all = s;
    }
    pthread_mutex_unlock(&e->q_lock);
    if (rc != 0)
        return spw__error(SPW_ERR_BACKEND, "emu: stream_create: cannot start a worker: %s",
                          strerror(rc));
    *out = s;
    return SPW_OK;
}

spw_status spw__emu_stream_create(spw_backend *b, spw_stream *out) {
    emu_backend *e = EMU(b);
    int hash_oom_ = 0;
    ENTER(e, STREAM_CREATE);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: stream_create: out is NULL");
    emu_stream *s = NULL;
    spw_status st = spw__emu_stream_start(e, &s);
    if (st != SPW_OK) return st;
    pthread_mutex_lock(&e->q_lock);
    HASH_ADD_PTR(e->live, key, s);
    if (hash_oom_) spw__emu_stream_stop(e, s);
    pthread_mutex_unlock(&e->q_lock);
    if (hash_oom_)
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: stream_create: out of memory");
    *out = (spw_stream)s;
    return SPW_OK;
}

/* Waits for the stream's work, then ends its worker (cudaStreamDestroy returns at once; waiting
 * is equivalent for callers, who may not use the handle afterwards). */
spw_status spw__emu_stream_destroy(spw_backend *b, spw_stream h) {
    emu_backend *e = EMU(b);
    ENTER(e, STREAM_DESTROY);
    if (!h)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: stream_destroy: the default stream cannot be destroyed");
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s = stream_get(e, h, "stream_destroy");
    if (s) {
        HASH_DEL(e->live, s); /* from here on, new work for it is refused */
        spw__emu_stream_stop(e, s);
    }
    pthread_mutex_unlock(&e->q_lock);
    return s ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

spw_status spw__emu_stream_sync(spw_backend *b, spw_stream h) {
    emu_backend *e = EMU(b);
    ENTER(e, STREAM_SYNC);
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s = stream_get(e, h, "stream_sync");
    if (s) wait_done(e, s, s->enq_seq);
    pthread_mutex_unlock(&e->q_lock);
    return s ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

/* Enqueue an item with proto's kind and payload on h. */
static spw_status submit(emu_backend *e, const char *call, spw_stream h, const emu_item *proto) {
    pthread_mutex_lock(&e->q_lock);
    emu_stream *s = stream_get(e, h, call);
    emu_item *it = s ? enqueue(e, s, proto->kind, call) : NULL;
    if (it) it->u = proto->u;
    pthread_mutex_unlock(&e->q_lock);
    return it ? SPW_OK : s ? SPW_ERR_HOST_OUT_OF_MEMORY : SPW_ERR_INVALID_ARGUMENT;
}

/* The emulation does not check that pointers match the kind; kind only decides whether the
 * simulated link bandwidth applies (H2D, D2H). Zero bytes enqueue an ordered no-op. */
spw_status spw__emu_memcpy_async(spw_backend *b, void *dst, const void *src, size_t bytes,
                                 spw_copy_kind kind, spw_stream h) {
    emu_backend *e = EMU(b);
    ENTER(e, MEMCPY);
    if ((unsigned)kind > SPW_COPY_H2H || (bytes && (!dst || !src)))
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: memcpy(dst=%p, src=%p, %zu bytes, kind %d): bad argument", dst,
                          src, bytes, (int)kind);
    emu_item it = {.kind = W_COPY};
    it.u.copy.dst = dst;
    it.u.copy.src = src;
    it.u.copy.bytes = bytes;
    it.u.copy.timed = kind == SPW_COPY_H2D || kind == SPW_COPY_D2H;
    return submit(e, "memcpy", h, &it);
}

spw_status spw__emu_launch_host(spw_backend *b, spw_stream h, void (*fn)(void *), void *arg) {
    emu_backend *e = EMU(b);
    ENTER(e, LAUNCH_HOST);
    if (!fn) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: launch_host: fn is NULL");
    emu_item it = {.kind = W_HOST};
    it.u.host.fn = fn;
    it.u.host.arg = arg;
    return submit(e, "launch_host", h, &it);
}

/* An ordered no-op (timed like a copy when a bandwidth is set) on a managed range. */
spw_status spw__emu_prefetch(spw_backend *b, void *ptr, size_t bytes, int to_device,
                             spw_stream h) {
    emu_backend *e = EMU(b);
    ENTER(e, PREFETCH);
    if (!e->managed)
        return spw__error(SPW_ERR_UNSUPPORTED,
                          "emu: prefetch: this emulated device has no concurrent managed access");
    pthread_mutex_lock(&e->mem_lock);
    emu_alloc *a = ptr && bytes ? spw__emu_find_range(e->manageds, ptr, bytes, 1) : NULL;
    pthread_mutex_unlock(&e->mem_lock);
    if (!a)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "emu: prefetch(%p, %zu, to %s): not inside a managed allocation", ptr,
                          bytes, to_device ? "device" : "host");
    emu_item it = {.kind = W_PREFETCH, .u.prefetch_bytes = bytes};
    return submit(e, "prefetch", h, &it);
}

/* ---- events ---- */

/* The event behind a handle; NULL with the message set if unknown. q_lock held. */
static emu_event *event_get(emu_backend *e, spw_event h, const char *call) {
    void *k = (void *)h;
    emu_event *ev = NULL;
    if (h) HASH_FIND_PTR(e->events, &k, ev);
    if (!ev)
        spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: %s: unknown or destroyed event %p", call, k);
    return ev;
}

spw_status spw__emu_event_create(spw_backend *b, spw_event *out) {
    emu_backend *e = EMU(b);
    int hash_oom_ = 0;
    ENTER(e, EVENT_CREATE);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu: event_create: out is NULL");
    emu_event *ev = calloc(1, sizeof *ev);
    if (ev) {
        ev->key = ev;
        pthread_mutex_lock(&e->q_lock);
        HASH_ADD_PTR(e->events, key, ev);
        pthread_mutex_unlock(&e->q_lock);
    }
    if (!ev || hash_oom_) {
        free(ev);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu: event_create: out of memory");
    }
    *out = (spw_event)ev;
    return SPW_OK;
}

/* Allowed while the event is pending: waits already enqueued captured its position. */
spw_status spw__emu_event_destroy(spw_backend *b, spw_event h) {
    emu_backend *e = EMU(b);
    ENTER(e, EVENT_DESTROY);
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "event_destroy");
    if (ev) HASH_DEL(e->events, ev);
    pthread_mutex_unlock(&e->q_lock);
    free(ev);
    return ev ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

/* Captures the position; allocates nothing and enqueues nothing. */
spw_status spw__emu_event_record(spw_backend *b, spw_event h, spw_stream sh) {
    emu_backend *e = EMU(b);
    ENTER(e, EVENT_RECORD);
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "event_record");
    emu_stream *s = ev ? stream_get(e, sh, "event_record") : NULL;
    if (s) {
        ev->rec = s;
        ev->rec_seq = s->enq_seq;
    }
    pthread_mutex_unlock(&e->q_lock);
    return s ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

spw_status spw__emu_event_query(spw_backend *b, spw_event h) {
    emu_backend *e = EMU(b);
    ENTER(e, EVENT_QUERY);
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "event_query");
    int done = ev && (!ev->rec || ev->rec->done_seq >= ev->rec_seq);
    pthread_mutex_unlock(&e->q_lock);
    if (!ev) return SPW_ERR_INVALID_ARGUMENT;
    if (done) return SPW_OK;
    return spw__error(SPW_ERR_NOT_READY, "emu: event_query: event %p not complete", (void *)h);
}

/* Waits for the record current at the call; a concurrent re-record is not waited for. */
spw_status spw__emu_event_sync(spw_backend *b, spw_event h) {
    emu_backend *e = EMU(b);
    ENTER(e, EVENT_SYNC);
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "event_sync");
    if (ev && ev->rec) wait_done(e, ev->rec, ev->rec_seq);
    pthread_mutex_unlock(&e->q_lock);
    return ev ? SPW_OK : SPW_ERR_INVALID_ARGUMENT;
}

spw_status spw__emu_stream_wait(spw_backend *b, spw_stream sh, spw_event h) {
    emu_backend *e = EMU(b);
    ENTER(e, STREAM_WAIT);
    spw_status st = SPW_ERR_INVALID_ARGUMENT;
    pthread_mutex_lock(&e->q_lock);
    emu_event *ev = event_get(e, h, "stream_wait");
    emu_stream *s = ev ? stream_get(e, sh, "stream_wait") : NULL;
    if (s) {
        st = SPW_OK;
        /* Only a pending point on another stream needs an item; FIFO orders the rest. */
        if (ev->rec && ev->rec != s && ev->rec->done_seq < ev->rec_seq) {
            emu_item *it = enqueue(e, s, W_WAIT, "stream_wait");
            if (it) {
                it->u.wait.s = ev->rec;
                it->u.wait.seq = ev->rec_seq;
            } else {
                st = SPW_ERR_HOST_OUT_OF_MEMORY;
            }
        }
    }
    pthread_mutex_unlock(&e->q_lock);
    return st;
}
