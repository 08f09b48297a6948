/*
 * The offload engine: movable buffers, their state machine and the public buffer API.
 * Residency (device copies under pressure, eviction, read-mostly replicas) is residency.c; the
 * host side of the API (spw_buf_write, spw_buf_read, spw_buf_host_begin/end) is buffer_io.c.
 *
 * States of a live buffer (fields in engine.h):
 *   host       !resident, hv              contents only in host memory
 *   clean      resident, dv, hv           device and host copies equal: eviction drops the block
 *   dirty      resident, dv, !hv          device copy newer: eviction writes it back first
 *   dead       dead (resident or not)     nobody needs the contents: never written back
 *   + in flight (xfer / pending events) and acquired (acq > 0: pinned, never evicted).
 *   Read-only managed buffers are resident as read-mostly replicas; evicted, they are host
 *   plus `collapsing` until their last use completes (engine.h: read-mostly replicas).
 * Invariants: dead || hv || dv (invariant 2: a failed step leaves the previous copy valid);
 * resident && !dead => dv; read-only buffers are never dirty; acquired => resident.
 *
 * Locking: the context lock guards every field of every buffer and the engine. No call blocks
 * on a stream or event with it held except inside the arena (trimming, its own contract) and
 * the rare recovery in copy.c; spw_buf_read/write/destroy drop it to wait. A buffer being
 * destroyed is marked DYING first, so nothing else touches it while the lock is dropped.
 *
 * Use after destroy: destroyed structs keep magic FREED in a quarantine of the last
 * QUARANTINE buffers (freed with the context), so a stale handle is reported, not followed.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine.h"

#define OPS(ctx) ((ctx)->backend->ops)
#define BE(ctx) ((ctx)->backend)
#define QUARANTINE 1024
#define MAX_BUF_BYTES ((size_t)1 << 48)

/* ---- entering a call: validate the handle, take the lock ---- */

static spw_status bad_handle(const spw_buf *b, const char *fn, uint32_t m) {
    if (m == SPW_BUF_FREED)
        return spw__error(SPW_ERR_STATE, "%s: buffer %p was destroyed (use after spw_buf_destroy)", fn,
                          (const void *)b);
    if (m == SPW_BUF_DYING)
        return spw__error(SPW_ERR_STATE, "%s: buffer %p is being destroyed by another call", fn,
                          (const void *)b);
    return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: %p is not a spillway buffer (bad magic 0x%08x)", fn,
                      (const void *)b, (unsigned)m);
}

/* On SPW_OK the context lock is held (and due replica collapses are done). */
spw_status spw__buf_enter(spw_buf *b, const char *fn) {
    if (!b) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: buffer is NULL", fn);
    uint32_t m = atomic_load(&b->magic);
    if (m != SPW_BUF_ALIVE) return bad_handle(b, fn, m);
    spw__ctx_lock(b->ctx);
    m = atomic_load(&b->magic);
    if (m != SPW_BUF_ALIVE) {
        pthread_mutex_unlock(&b->ctx->lock);
        return bad_handle(b, fn, m);
    }
    spw__res_collapse_poll(b->ctx);
    return SPW_OK;
}

void spw__buf_leave(spw_buf *b) { pthread_mutex_unlock(&b->ctx->lock); }

/* The caller wrote the host copy: it holds the contents, live and neither dropped by the policy
 * nor mirrored by a read-mostly replica (the write invalidated the replica's pages). */
void spw__buf_host_written(spw_buf *b) {
    b->hv = true;
    b->dead = false;
    b->policy_dead = false;
    b->replica = false;
}

/* Why a buffer with host_busy cannot be used now, for the error message. */
const char *spw__buf_busy_why(const spw_buf *b) {
    return b->host_open ? "open for host writes (spw_buf_host_begin)" : "being written by spw_buf_write";
}

/* The error of fn on a buffer that is acquired or host_busy. */
spw_status spw__buf_in_use(const char *fn, const spw_buf *b) {
    return spw__error(SPW_ERR_STATE, "%s: buffer #%llu is %s", fn, (unsigned long long)b->id,
                      b->acq ? "acquired; release it first" : spw__buf_busy_why(b));
}

/* ---- policy queries (policy.h) ---- */

spw_policy_node *spw__pol_node(spw_buf *b) { return &b->node; }
size_t spw__pol_bytes(const spw_buf *b) { return b->bytes; }
uint64_t spw__pol_id(const spw_buf *b) { return b->id; }
bool spw__pol_resident(const spw_buf *b) { return b->resident; }
unsigned spw__pol_acquired(const spw_buf *b) { return b->acq; }
bool spw__pol_read_only(const spw_buf *b) { return b->flags & SPW_BUF_READ_ONLY; }
bool spw__pol_dirty(const spw_buf *b) { return b->resident && !b->managed && b->dv && !b->hv && !b->dead; }
bool spw__pol_evictable(const spw_buf *b) {
    return atomic_load(&b->magic) == SPW_BUF_ALIVE && b->resident && !b->acq && !b->host_busy;
}
size_t spw__pol_device_bytes(const spw_buf *b) {
    if (!b->resident) return 0;
    return b->managed ? b->bytes : spw__block_size(b->dblock);
}
bool spw__pol_ring(const spw_ctx *ctx) {
    return ctx->cfg.ring && ctx->engine && ctx->engine->streams_ok && spw__arena_pages(ctx->large);
}
uint64_t spw__pol_step(const spw_ctx *ctx) { return ctx->engine ? ctx->engine->step : 0; }
spw_buf *spw__pol_first(spw_ctx *ctx) { return ctx->engine ? ctx->engine->first : NULL; }
spw_buf *spw__pol_next(spw_buf *b) { return b->next; }

/* ---- out of device memory ---- */

static spw_status oom_for(spw_ctx *ctx, spw_buf *b, spw_stream s, const char *fn) {
    spw__ctx_oom(ctx, b->bytes, s);
    return spw__error_prefix(SPW_ERR_OUT_OF_MEMORY, "%s of buffer #%llu (%zu B)%s", fn,
                             (unsigned long long)b->id, b->bytes,
                             ctx->cfg.on_exhaust == SPW_EXHAUST_FAIL ? " with on_exhaust=fail (no eviction)"
                                                                   : ", after evicting every unpinned buffer");
}

/* ---- engine lifetime ---- */

static size_t physical_ram(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : 16 * SPW_GiB;
}

spw_status spw__engine_create(spw_ctx *ctx, const spw_policy_ops *pops) {
    struct spw_engine *e = calloc(1, sizeof *e);
    if (!e) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "offload engine: out of host memory");
    spw_status st;
    e->pops = pops;
    size_t hb = spw__size_resolve(&ctx->cfg.host_budget, physical_ram());
    if ((st = spw__hostpool_create(ctx->backend, &ctx->stats.host_held, hb, &e->hp))) goto fail;
    if ((st = spw__tsink_create(ctx->cfg.trace, &e->sink))) goto fail;
    if ((st = e->pops->create(ctx, &e->pol))) goto fail;
    ctx->engine = e;
    ctx->pressure = spw__engine_alloc_evicting;
    return SPW_OK;
fail:
    spw__tsink_put(e->sink);
    spw__hostpool_destroy(e->hp);
    free(e);
    return st;
}

static void quarantine(struct spw_engine *e, spw_buf *b) {
    b->next = NULL;
    b->prev = e->q_last;
    if (e->q_last) e->q_last->next = b;
    else e->q_first = b;
    e->q_last = b;
    if (++e->q_count > QUARANTINE) {
        spw_buf *old = e->q_first;
        e->q_first = old->next;
        e->q_first->prev = NULL;
        e->q_count--;
        free(old);
    }
}

/* Free everything of b; its transfers are complete (the caller waited). Lock held. */
static void buf_teardown(spw_ctx *ctx, spw_buf *b) {
    struct spw_engine *e = ctx->engine;
    spw__pf_unmark(ctx, b); /* the worker's lists must not keep it */
    spw__pf_unwatch(ctx, b);
    if (b->acq) spw__stat_add(&ctx->stats.pinned, -(int64_t)spw__pol_device_bytes(b));
    b->acq = 0;
    if (b->resident) spw__res_drop_device(ctx, b);
    /* a pending collapse needs no advice: the free below drops the replica with the memory */
    spw__res_collapse_unlink(e, b);
    if (e->pops->on_destroy) e->pops->on_destroy(e->pol, b);
    spw__stat_add(&ctx->stats.buffers_host, -1);
    if (b->prev) b->prev->next = b->next;
    else e->first = b->next;
    if (b->next) b->next->prev = b->prev;
    else e->last = b->prev;
    if (b->hblock) spw__hostpool_free(e->hp, b->hblock);
    spw__pin_forget(ctx, b);
    if (b->managed && b->host) OPS(ctx)->managed_free(BE(ctx), b->host);
    /* waits still owed on these events (a settle that failed) are enqueued now, or forgotten:
     * the destroy waited for the buffer's work */
    spw_arena *arenas[2] = {ctx->small, ctx->large};
    for (int i = 0; i < 2; i++) {
        if (spw__arena_settle(arenas[i])) spw__error_clear();
        spw__arena_forget_event(arenas[i], b->ev_dev);
        spw__arena_forget_event(arenas[i], b->ev_host);
    }
    if (b->ev_dev && !OPS(ctx)->event_destroy(BE(ctx), b->ev_dev)) e->events_live--;
    if (b->ev_host && !OPS(ctx)->event_destroy(BE(ctx), b->ev_host)) e->events_live--;
    atomic_store(&b->magic, SPW_BUF_FREED);
    quarantine(e, b);
}

void spw__engine_destroy(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (!e) return;
    spw__pf_stop(ctx); /* before the lock: the worker takes it */
    pthread_mutex_lock(&ctx->lock);
    /* the context is going away: no other caller may use it, so waiting under the lock is fine */
    if (e->streams_ok) {
        OPS(ctx)->stream_sync(BE(ctx), e->h2d);
        OPS(ctx)->stream_sync(BE(ctx), e->d2h);
    }
    while (e->first) {
        spw_buf *b = e->first;
        if (b->dev_rec) OPS(ctx)->event_sync(BE(ctx), b->ev_dev);
        else if (b->managed && b->dev_touched) OPS(ctx)->stream_sync(BE(ctx), b->dev_s);
        buf_teardown(ctx, b);
    }
    spw__step_wait_destroy(ctx);
    spw__copy_streams_destroy(ctx);
    spw__hostpool_destroy(e->hp);
    e->pops->destroy(e->pol);
    while (e->q_first) {
        spw_buf *n = e->q_first->next;
        free(e->q_first);
        e->q_first = n;
    }
    spw__tsink_put(e->sink);
    ctx->engine = NULL;
    ctx->pressure = NULL;
    pthread_mutex_unlock(&ctx->lock);
    free(e);
}

void spw__engine_stats_sync(spw_ctx *ctx) {
    if (!ctx->engine) return;
    spw__res_collapse_poll(ctx);
    int64_t ns = (int64_t)spw__tsink_stall_ns(ctx->engine->sink);
    ctx->stats.stall_ns.current = ctx->stats.stall_ns.total = ctx->stats.stall_ns.peak = ns;
}

void spw__engine_describe(spw_ctx *ctx, char *buf, size_t len) {
    if (len) buf[0] = '\0';
    struct spw_engine *e = ctx->engine;
    if (e && e->pops->describe && len) e->pops->describe(e->pol, buf, len);
}

/* ---- creation ---- */

static spw_status check_flags(const char *fn, unsigned flags) {
    const unsigned known = SPW_BUF_READ_ONLY | SPW_BUF_MANAGED | SPW_BUF_EXPLICIT;
    if (flags & ~known)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x (known: 0x%x)", fn, flags & ~known, known);
    if ((flags & SPW_BUF_MANAGED) && (flags & SPW_BUF_EXPLICIT))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: SPW_BUF_MANAGED and SPW_BUF_EXPLICIT are exclusive", fn);
    return SPW_OK;
}

static spw_status check_size(const char *fn, size_t bytes) {
    if (!bytes) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: size 0", fn);
    if (bytes > MAX_BUF_BYTES)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: size %zu B exceeds the largest buffer (%zu B)", fn, bytes,
                          MAX_BUF_BYTES);
    return SPW_OK;
}

/* A new buffer struct with its events, linked into the engine (state: host). Lock held. */
static spw_status buf_new(spw_ctx *ctx, size_t bytes, unsigned flags, spw_buf **out) {
    struct spw_engine *e = ctx->engine;
    spw_status st = spw__copy_streams(ctx);
    if (st) return st;
    spw_buf *b = calloc(1, sizeof *b);
    if (!b) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw_buf_create: out of host memory");
    if ((st = OPS(ctx)->event_create(BE(ctx), &b->ev_dev))) goto fail;
    e->events_live++;
    if ((st = OPS(ctx)->event_create(BE(ctx), &b->ev_host))) goto fail;
    e->events_live++;
    atomic_init(&b->magic, SPW_BUF_ALIVE);
    b->ctx = ctx;
    b->bytes = bytes;
    b->flags = flags;
    b->hv = true;
    b->node.buf = b;
    *out = b;
    return SPW_OK;
fail:
    if (b->ev_dev && !OPS(ctx)->event_destroy(BE(ctx), b->ev_dev)) e->events_live--;
    free(b);
    return spw__error_prefix(st, "creating a buffer's events");
}

static void buf_link(spw_ctx *ctx, spw_buf *b) {
    struct spw_engine *e = ctx->engine;
    b->id = ++e->next_id;
    b->prev = e->last;
    if (e->last) e->last->next = b;
    else e->first = b;
    e->last = b;
    spw__stat_add(&ctx->stats.buffers_host, 1);
    if (e->pops->on_create) e->pops->on_create(e->pol, b);
}

/* Undo buf_new for a buffer that was never linked. Lock held. */
static void buf_unnew(spw_ctx *ctx, spw_buf *b) {
    struct spw_engine *e = ctx->engine;
    if (!OPS(ctx)->event_destroy(BE(ctx), b->ev_dev)) e->events_live--;
    if (!OPS(ctx)->event_destroy(BE(ctx), b->ev_host)) e->events_live--;
    free(b);
}

SPW_API spw_status spw_buf_create(spw_ctx *ctx, size_t bytes, unsigned flags, spw_buf **out) {
    const char *fn = "spw_buf_create";
    if (!ctx) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
    spw_status st;
    if ((st = check_size(fn, bytes)) || (st = check_flags(fn, flags))) return st;
    bool managed = (flags & SPW_BUF_MANAGED) ||
                   (!(flags & SPW_BUF_EXPLICIT) && ctx->cfg.residency == SPW_RES_MANAGED);
    if (managed && !ctx->dev.concurrent_managed_access)
        return spw__error(SPW_ERR_UNSUPPORTED,
                          "%s: managed residency needs concurrent managed access, which device '%s' lacks "
                          "(e.g. WSL2 or Windows); use residency=explicit (or SPW_BUF_EXPLICIT)", fn, ctx->dev.name);
    pthread_mutex_lock(&ctx->lock);
    spw__res_collapse_poll(ctx);
    spw_buf *b = NULL;
    if ((st = buf_new(ctx, bytes, flags, &b))) goto out;
    b->managed = managed;
    if (managed) {
        if ((st = OPS(ctx)->managed_alloc(BE(ctx), bytes, &b->host))) {
            st = spw__error_prefix(st, "%s: managed allocation of %zu B", fn, bytes);
            buf_unnew(ctx, b);
            goto out;
        }
        /* A hint; a device that refuses it still works, only slower. Read-only buffers get
         * read-mostly only while resident (replica_advise): a prefetch to the host does not
         * remove a read-mostly replica, and advice is not stream-ordered, so eviction drops
         * the replica by advice once its last use is complete (spw__res_collapse_poll,
         * residency.c). Read-mostly set for a buffer's whole life would keep "evicted"
         * buffers on the device, and the budget would hold on paper only. */
        /* Read-only: preferred location the host, for good (replicas then collapse onto the
         * host copy without a transfer, and prefetches to the device run faster this way than
         * with the preference flipped to the device: bench/RESULTS.md). */
        b->adv_dev = OPS(ctx)->managed_advise(BE(ctx), b->host, bytes, (flags & SPW_BUF_READ_ONLY) ?
                                              SPW_ADVISE_PREFERRED_HOST : SPW_ADVISE_PREFERRED_DEVICE) == SPW_OK;
    } else if ((st = spw__hostpool_alloc(ctx->engine->hp, bytes, &b->host, &b->hblock))) {
        buf_unnew(ctx, b);
        goto out;
    }
    buf_link(ctx, b);
    b->host_busy = true; /* zeroed below without the lock: not evictable, not uploadable */
out:
    pthread_mutex_unlock(&ctx->lock);
    if (st) return st;
    memset(b->host, 0, bytes);
    pthread_mutex_lock(&ctx->lock);
    b->host_busy = false;
    pthread_mutex_unlock(&ctx->lock);
    *out = b;
    return SPW_OK;
}

SPW_API spw_status spw_buf_register_host(spw_ctx *ctx, void *host, size_t bytes, unsigned flags, spw_buf **out) {
    const char *fn = "spw_buf_register_host";
    if (!ctx) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    if (!out || !host) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, !out ? "out" : "host");
    spw_status st;
    if ((st = check_size(fn, bytes)) || (st = check_flags(fn, flags))) return st;
    if ((uintptr_t)host + bytes < (uintptr_t)host)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: range %p + %zu B wraps around", fn, host, bytes);
    if (flags & SPW_BUF_MANAGED)
        return spw__error(SPW_ERR_UNSUPPORTED, "%s: caller memory cannot be managed memory; registered buffers "
                          "use explicit residency (drop SPW_BUF_MANAGED)", fn);
    pthread_mutex_lock(&ctx->lock);
    spw__res_collapse_poll(ctx);
    spw_buf *b = NULL;
    if ((st = buf_new(ctx, bytes, flags, &b))) {
        pthread_mutex_unlock(&ctx->lock);
        return st;
    }
    b->host = host;
    b->user_host = true;
    /* Pinned where possible: memory already pinned (SPW_ERR_STATE), or a backend or limit that
     * refuses, still works; what is not page-locked is counted (copies from pageable memory are
     * slower but correct). */
    spw__pin_register(ctx, b);
    buf_link(ctx, b);
    pthread_mutex_unlock(&ctx->lock);
    spw__error_clear();
    *out = b;
    return SPW_OK;
}

SPW_API size_t spw_buf_size(const spw_buf *buf) {
    if (!buf || atomic_load(&((spw_buf *)buf)->magic) != SPW_BUF_ALIVE) return 0;
    return buf->bytes;
}

SPW_API spw_status spw_buf_destroy(spw_buf *b) {
    spw_status st = spw__buf_enter(b, "spw_buf_destroy");
    if (st) return st;
    spw_ctx *ctx = b->ctx;
    if (b->acq || b->host_open) {
        st = b->host_open ? spw__error(SPW_ERR_STATE, "spw_buf_destroy: buffer #%llu is %s", (unsigned long long)b->id,
                                       spw__buf_busy_why(b))
                          : spw__error(SPW_ERR_STATE, "spw_buf_destroy: buffer #%llu is acquired (%u times); "
                                       "release it first", (unsigned long long)b->id, b->acq);
        spw__buf_leave(b);
        return st;
    }
    atomic_store(&b->magic, SPW_BUF_DYING); /* from here nothing else touches b */
    spw_host_wait w;
    spw__copy_host_wait_collect(ctx, b, true, &w);
    pthread_mutex_unlock(&ctx->lock);
    st = spw__copy_host_wait(ctx, &w);
    pthread_mutex_lock(&ctx->lock);
    if (st) {
        atomic_store(&b->magic, SPW_BUF_ALIVE);
        pthread_mutex_unlock(&ctx->lock);
        return spw__error_prefix(st, "spw_buf_destroy: waiting for the transfers of buffer #%llu (nothing freed)",
                                 (unsigned long long)b->id);
    }
    buf_teardown(ctx, b);
    pthread_mutex_unlock(&ctx->lock);
    return SPW_OK;
}

/* ---- residency API ---- */

static spw_status check_mode(const char *fn, spw_access mode) {
    if (mode != SPW_ACCESS_READ && mode != SPW_ACCESS_WRITE && mode != SPW_ACCESS_READ_WRITE)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: bad access mode %d (READ=1, WRITE=2, READ_WRITE=3)", fn,
                          (int)mode);
    return SPW_OK;
}

/* A stream as messages name it: the default stream (NULL) by that name, not as a null pointer. */
static const char *stream_name(spw_stream s, char *buf, size_t len) {
    if (!s) return "the default stream";
    snprintf(buf, len, "stream %p", (void *)s);
    return buf;
}

/* spw_acquire with the lock held (b checked alive); the lock stays held. */
static spw_status acquire_locked(spw_buf *b, spw_stream s, spw_access mode, void **devptr) {
    const char *fn = "spw_acquire";
    spw_status st;
    spw_ctx *ctx = b->ctx;
    struct spw_engine *e = ctx->engine;
    if ((mode & SPW_ACCESS_WRITE) && (b->flags & SPW_BUF_READ_ONLY))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: buffer #%llu is read-only (SPW_BUF_READ_ONLY); "
                          "mode %s would write it", fn, (unsigned long long)b->id,
                          mode == SPW_ACCESS_WRITE ? "WRITE" : "READ_WRITE");
    if (b->host_busy) return spw__buf_in_use(fn, b); /* host_busy is never set on an acquired buffer */
    if (b->policy_dead && (mode & SPW_ACCESS_READ)) {
        /* loud, never stale data: the program left the pattern the drop was based on */
        return spw__error(SPW_ERR_STATE, "%s: the contents of buffer #%llu were dropped by policy=plan, "
                          "which learned that each step overwrites it (SPW_ACCESS_WRITE) before reading it; "
                          "this step reads it first. Write it first, or use policy=lru", fn,
                          (unsigned long long)b->id);
    }
    bool fresh = false;
    if (!b->resident) {
        bool upload = (mode & SPW_ACCESS_READ) && !b->dead;
        st = spw__res_make_resident(ctx, b, upload, s, 0, true);
        if (st == SPW_ERR_OUT_OF_MEMORY) st = oom_for(ctx, b, s, fn);
        if (st) return st;
        fresh = true;
    } else if (b->prefetched) {
        spw__stat_event(&ctx->stats.prefetch_hits);
    }
    /* Order s after the device copy's last touch. A wait on a transfer still running is a
     * stall: counted, and timed on s itself (no host blocking). */
    void *stall = NULL;
    if (b->xfer && b->dev_touched && b->dev_s != s) {
        /* Complete? Known without asking when the worker saw it complete; a transfer the worker
         * watches and has not seen complete, or enqueued by this very call, is taken as running
         * (asking costs a driver call, a large part of a framework hook's host time). */
        spw_status q = b->dev_rec && b->dev_done          ? SPW_OK
                       : !b->dev_rec || fresh || b->watched ? SPW_ERR_NOT_READY
                                                            : OPS(ctx)->event_query(BE(ctx), b->ev_dev);
        if (q == SPW_OK) {
            /* the transfer is complete: no stream need wait for it (one driver call less) */
            b->xfer = false;
            b->dev_done = true;
        } else {
            spw__stat_event(&ctx->stats.stalls);
            stall = spw__tsink_span_begin(ctx, s, "stall", "stream", b->bytes, b->id, 1);
        }
    }
    st = spw__copy_order_dev(ctx, b, s);
    spw__tsink_span_end(ctx, s, stall);
    if (st) {
        if (fresh) spw__res_drop_device(ctx, b); /* stream-ordered free on dev_s; contents stay on the host */
        char sn[40];
        return spw__error_prefix(st, "%s: ordering %s after buffer #%llu", fn, stream_name(s, sn, sizeof sn),
                                 (unsigned long long)b->id);
    }
    if (b->acq++ == 0) spw__stat_add(&ctx->stats.pinned, (int64_t)spw__pol_device_bytes(b));
    if (mode & SPW_ACCESS_WRITE) {
        b->acq_writers++;
        b->dead = false;
        b->policy_dead = false;
        b->dv = true;
        if (!b->managed) b->hv = false;
    }
    b->prefetched = false;
    *devptr = b->managed ? b->host : b->dev;
    if (e->pops->on_acquire) e->pops->on_acquire(e->pol, b, mode, s, b->acq);
    if (e->pops->prefetch && !spw__pf_post(ctx)) e->pops->prefetch(e->pol, ctx, true);
    return SPW_OK;
}

SPW_API spw_status spw_acquire(spw_buf *b, spw_stream s, spw_access mode, void **devptr) {
    const char *fn = "spw_acquire";
    spw_status st;
    if ((st = check_mode(fn, mode))) return st;
    if (!devptr) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: devptr is NULL", fn);
    if ((st = spw__buf_enter(b, fn))) return st;
    st = acquire_locked(b, s, mode, devptr);
    spw__buf_leave(b);
    return st;
}

/* spw_release with the lock held (b checked alive); the lock stays held. */
static spw_status release_locked(spw_buf *b, spw_stream s) {
    const char *fn = "spw_release";
    spw_status st;
    spw_ctx *ctx = b->ctx;
    struct spw_engine *e = ctx->engine;
    if (!b->acq)
        return spw__error(SPW_ERR_STATE, "%s: buffer #%llu is not acquired (released twice?)", fn,
                          (unsigned long long)b->id);
    /* the use on s becomes the device copy's last touch, chained after any other stream's; its
     * record is left to the prefetch worker when there is one (prefetch_thread.c) */
    st = spw__copy_order_dev(ctx, b, s);
    bool marked = !st && e->streams_ok && spw__pf_mark(ctx, b);
    if (!st && !marked) st = spw__copy_record_dev(ctx, b, s);
    if (st) {
        char sn[40];
        return spw__error_prefix(st, "%s: recording the last use of buffer #%llu on %s (still acquired)",
                                 fn, (unsigned long long)b->id, stream_name(s, sn, sizeof sn));
    }
    b->dev_s = s;
    b->dev_rec = !marked;
    b->dev_touched = true;
    b->xfer = false;
    b->rel_step = e->step;
    if (--b->acq == 0) {
        b->acq_writers = 0;
        spw__stat_add(&ctx->stats.pinned, -(int64_t)spw__pol_device_bytes(b));
    }
    if (e->pops->on_release) e->pops->on_release(e->pol, b, s, b->acq);
    return SPW_OK;
}

SPW_API spw_status spw_release(spw_buf *b, spw_stream s) {
    spw_status st;
    if ((st = spw__buf_enter(b, "spw_release"))) return st;
    st = release_locked(b, s);
    spw__buf_leave(b);
    return st;
}

SPW_API spw_status spw_release_acquire(spw_buf *done, spw_stream done_stream, spw_buf *b, spw_stream s,
                                       spw_access mode, void **devptr) {
    const char *fn = "spw_release_acquire";
    spw_status st;
    if (!done) return spw_acquire(b, s, mode, devptr);
    if ((st = check_mode(fn, mode))) return st;
    if (!devptr) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: devptr is NULL", fn);
    if (!b) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: buffer is NULL", fn);
    if ((st = spw__buf_enter(done, fn))) return st;
    if ((st = release_locked(done, done_stream))) {
        spw__buf_leave(done);
        return st;
    }
    if (atomic_load(&b->magic) != SPW_BUF_ALIVE || b->ctx != done->ctx) {
        spw__buf_leave(done); /* another context, or a handle to check: the plain call, on its own lock */
        return spw_acquire(b, s, mode, devptr);
    }
    st = acquire_locked(b, s, mode, devptr);
    spw__buf_leave(done);
    return st;
}

static spw_status prefetch_locked(spw_ctx *ctx, spw_buf *b, int for_prefetch, bool may_evict) {
    if (atomic_load(&b->magic) != SPW_BUF_ALIVE || b->resident || b->acq || b->host_busy) return SPW_OK;
    spw_status st = spw__res_make_resident(ctx, b, !b->dead, ctx->engine->h2d, for_prefetch, may_evict);
    if (st) return st;
    b->prefetched = true;
    return SPW_OK;
}

spw_status spw__engine_prefetch(spw_ctx *ctx, spw_buf *b, int may_evict) {
    return prefetch_locked(ctx, b, 1, may_evict);
}

spw_status spw__engine_evict(spw_ctx *ctx, spw_buf *b) {
    if (!spw__pol_evictable(b))
        return spw__error(SPW_ERR_STATE, "evict: buffer #%llu is not evictable", (unsigned long long)b->id);
    return spw__res_evict_buf(ctx, b, false);
}

spw_status spw__engine_stream_room(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (!e->streams_ok) return SPW_OK;
    e->ring_at = 0;
    spw_status st = spw__arena_trim(ctx->large, SIZE_MAX, NULL);
    int64_t room = (int64_t)ctx->budget - ctx->stats.held.current;
    if (st || room <= 0) return st;
    return spw__arena_map_free(ctx->large, (size_t)room, e->h2d);
}

/* spw_prefetch and spw_prefetch_free: a hint, so a prefetch declined for want of room the policy
 * is willing to make (or, without may_evict, of room free now) is no error. Ordered before later
 * acquires on every stream: they wait on the upload. */
static spw_status prefetch_hint(spw_buf *b, bool may_evict, const char *fn) {
    spw_status st;
    if ((st = spw__buf_enter(b, fn))) return st;
    st = prefetch_locked(b->ctx, b, 1, may_evict);
    if (st == SPW_ERR_OUT_OF_MEMORY) {
        spw__error_clear();
        st = SPW_OK;
    }
    spw__buf_leave(b);
    return st;
}

SPW_API spw_status spw_prefetch(spw_buf *b, spw_stream s) {
    (void)s;
    return prefetch_hint(b, true, "spw_prefetch"); /* the policy decides what it may displace */
}

SPW_API spw_status spw_prefetch_free(spw_buf *b, spw_stream s) {
    (void)s;
    return prefetch_hint(b, false, "spw_prefetch_free"); /* nothing evicted, nothing trimmed */
}

SPW_API spw_status spw_evict(spw_buf *b) {
    spw_status st;
    if ((st = spw__buf_enter(b, "spw_evict"))) return st;
    st = b->host_busy ? spw__buf_in_use("spw_evict", b) : spw__res_evict_buf(b->ctx, b, true);
    spw__buf_leave(b);
    return st;
}

SPW_API spw_status spw_discard(spw_buf *b) {
    spw_status st;
    if ((st = spw__buf_enter(b, "spw_discard"))) return st;
    if (b->acq || b->host_busy) {
        st = spw__buf_in_use("spw_discard", b);
        spw__buf_leave(b);
        return st;
    }
    /* the device block (if any) stays for a later WRITE acquire; eviction just drops it */
    b->dead = true;
    b->policy_dead = false; /* the caller's own word: a READ then sees unspecified contents */
    b->hv = false;
    b->dv = false;
    spw__buf_leave(b);
    return SPW_OK;
}

static spw_status step(spw_ctx *ctx, bool begin) {
    if (!ctx) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: context is NULL", begin ? "spw_step_begin" : "spw_step_end");
    pthread_mutex_lock(&ctx->lock);
    struct spw_engine *e = ctx->engine;
    spw__res_collapse_poll(ctx);
    spw__pf_step(ctx, begin); /* a prefetch still pending belongs to the step that ends */
    if (!begin && e->pops->time_steps && e->pops->time_steps(e->pol)) spw__step_wait(ctx);
    if (begin) {
        e->step++;
        if (e->pops->step_begin) e->pops->step_begin(e->pol);
        if (e->pops->prefetch && e->streams_ok) e->pops->prefetch(e->pol, ctx, false);
    } else {
        spw__pin_rebalance(ctx); /* before the next step's prefetch reads the host copies */
        if (e->pops->step_end) {
            e->pops->step_end(e->pol);
            if (e->pops->prefetch && e->streams_ok) e->pops->prefetch(e->pol, ctx, false);
        }
    }
    spw__tsink_instant(e->sink, begin ? "step begin" : "step end", NULL, "engine", 0, e->step);
    pthread_mutex_unlock(&ctx->lock);
    return SPW_OK;
}

SPW_API spw_status spw_step_begin(spw_ctx *ctx) { return step(ctx, true); }
SPW_API spw_status spw_step_end(spw_ctx *ctx) { return step(ctx, false); }
