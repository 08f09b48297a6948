/*
 * The context's device memory: one budget, two arenas (small and large requests) charging one
 * account, the pointer map, and the public allocator entry points. One mutex guards all of it;
 * the cached allocate/free path holds it briefly and makes no backend call. Creation, teardown
 * and reports are in ctx_create.c. Nothing here calls the offload engine: at the budget,
 * spw_malloc calls the pressure callback the engine registered.
 */
#include <stdlib.h>
#include <string.h>

/* uthash must never exit: a failed table allocation only sets this flag (checked after adds) */
static _Thread_local int hash_oom;
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) ((void)(obj), hash_oom = 1)
#include <uthash.h>

#include "ctx.h"
#include "stats.h"

struct spw_live {
    void *ptr;
    spw_block *block;
    spw_arena *arena;
    size_t requested;
    UT_hash_handle hh;
};

/* Map entries are recycled through a free list so the hot path does not call malloc. */
static spw_live *live_new(spw_ctx *ctx) {
    spw_live *e = ctx->live_spare;
    if (e) {
        ctx->live_spare = (spw_live *)e->ptr;
        return e;
    }
    return malloc(sizeof *e);
}

static void live_put(spw_ctx *ctx, spw_live *e) {
    e->ptr = ctx->live_spare;
    ctx->live_spare = e;
}

void spw__ctx_live_clear(spw_ctx *ctx) {
    spw_live *e, *tmp;
    HASH_ITER(hh, ctx->live_map, e, tmp) {
        HASH_DEL(ctx->live_map, e);
        free(e);
    }
    while (ctx->live_spare) {
        spw_live *n = (spw_live *)ctx->live_spare->ptr;
        free(ctx->live_spare);
        ctx->live_spare = n;
    }
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A short spin before blocking: the prefetch worker's questions hold the lock briefly (a few
 * list and flag checks), and blocking would make both sides take system calls (the wait, the
 * wake). */
void spw__ctx_lock(spw_ctx *ctx) {
    if (pthread_mutex_trylock(&ctx->lock) == 0) return;
    uint64_t t0 = spw__now_ns();
    for (int i = 0; i < 512; i++) {
        cpu_relax();
        if (pthread_mutex_trylock(&ctx->lock) == 0) goto held;
    }
    pthread_mutex_lock(&ctx->lock);
held:
    spw__stat_event(&ctx->stats.lock_waits);
    spw__stat_add(&ctx->stats.lock_wait_ns, (int64_t)(spw__now_ns() - t0));
}

bool spw__ctx_can_hold(const spw_ctx *ctx, size_t more) {
    return (uint64_t)ctx->stats.held.current + more <= ctx->budget;
}

SPW_API const char *spw_ctx_backend(const spw_ctx *ctx) { return ctx ? ctx->backend->ops->name : "none"; }
SPW_API size_t spw_ctx_budget(const spw_ctx *ctx) { return ctx ? ctx->budget : 0; }

spw_status spw__ctx_oom(spw_ctx *ctx, size_t bytes, spw_stream s) {
    char req[48], bud[48], held[48], live[48], cached[48], pinned[48], largest[48], strm[40];
    const spw_stats *st = &ctx->stats;
    size_t lf = SPW_MAX(spw__arena_largest_free(ctx->small), spw__arena_largest_free(ctx->large));
    spw__stat_event(&ctx->stats.ooms);
    if (s) snprintf(strm, sizeof strm, "stream %p", (void *)s);
    else snprintf(strm, sizeof strm, "the default stream");
    /* a budget that is not a multiple of the page says what whole pages of it can be held */
    char usable[96] = "", u[SPW_SIZE_FMT_MAX], pg[SPW_SIZE_FMT_MAX];
    if (ctx->page && ctx->budget % ctx->page)
        snprintf(usable, sizeof usable, ", usable %s (whole %s pages)",
                 spw__size_format(u, sizeof u, SPW_ALIGN_DOWN(ctx->budget, ctx->page)),
                 spw__size_format(pg, sizeof pg, ctx->page));
    /* read by users of every surface (C, Python, the CLI): no function names */
    return spw__error(
        SPW_ERR_OUT_OF_MEMORY,
        "out of device memory: requested %s on %s; budget %s%s, held %s, live %s, cached %s, "
        "pinned %s, largest free block %s. The budget is a hard limit (option 'budget'); raise it "
        "if the device has room, or free memory or release offloaded buffers first",
        spw__fmt_bytes(req, sizeof req, bytes), strm, spw__fmt_bytes(bud, sizeof bud, ctx->budget), usable,
        spw__fmt_bytes(held, sizeof held, (uint64_t)st->held.current),
        spw__fmt_bytes(live, sizeof live, (uint64_t)st->live.current),
        spw__fmt_bytes(cached, sizeof cached, (uint64_t)st->cached.current),
        spw__fmt_bytes(pinned, sizeof pinned, (uint64_t)st->pinned.current),
        spw__fmt_bytes(largest, sizeof largest, lf));
}

spw_status spw__ctx_alloc_block(spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s, spw_block **out) {
    return spw__ctx_alloc_block_ordered(ctx, a, bytes, s, out, NULL, NULL);
}

static spw_status arena_alloc(spw_arena *a, size_t bytes, spw_stream s, spw_block **out, spw_arena_wait *w,
                              int *nw) {
    return w ? spw__arena_alloc_ordered(a, bytes, s, out, w, nw) : spw__arena_alloc(a, bytes, s, out);
}

spw_status spw__ctx_alloc_block_ordered(spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s, spw_block **out,
                                        spw_arena_wait *w, int *nw) {
    spw_status st = arena_alloc(a, bytes, s, out, w, nw);
    if (SPW_LIKELY(st != SPW_ERR_OUT_OF_MEMORY)) return st;
    size_t got = 0;
    spw_arena *other = a == ctx->small ? ctx->large : ctx->small;
    if ((st = spw__arena_trim(other, SIZE_MAX, &got))) return st;
    return got ? arena_alloc(a, bytes, s, out, w, nw) : SPW_ERR_OUT_OF_MEMORY;
}

/* Largest request accepted before any arithmetic: beyond this, rounding could overflow. */
#define SPW_MAX_REQUEST ((size_t)1 << 48)

SPW_API spw_status spw_malloc(spw_ctx *ctx, size_t bytes, spw_stream stream, void **out) {
    if (SPW_UNLIKELY(!ctx || !out || !bytes || bytes > SPW_MAX_REQUEST)) {
        if (!ctx) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_malloc: context is NULL");
        if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_malloc: out is NULL");
        if (!bytes) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_malloc: size 0");
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_malloc: size %zu B exceeds the largest "
                          "supported request (%zu B)", bytes, SPW_MAX_REQUEST);
    }
    pthread_mutex_lock(&ctx->lock);
    spw_live *e = live_new(ctx);
    if (SPW_UNLIKELY(!e)) {
        pthread_mutex_unlock(&ctx->lock);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw_malloc: out of host memory");
    }
    spw_arena *a = bytes <= ctx->cfg.small_limit ? ctx->small : ctx->large;
    spw_block *b = NULL;
    spw_status st = spw__ctx_alloc_block(ctx, a, bytes, stream, &b);
    if (SPW_UNLIKELY(st == SPW_ERR_OUT_OF_MEMORY)) {
        /* the engine, if registered, evicts unpinned buffers (policy order) unless on_exhaust=fail */
        if (st == SPW_ERR_OUT_OF_MEMORY && ctx->pressure) st = ctx->pressure(ctx, a, bytes, stream, &b);
        if (st == SPW_ERR_OUT_OF_MEMORY) st = spw__ctx_oom(ctx, bytes, stream);
    }
    if (SPW_UNLIKELY(st)) {
        live_put(ctx, e);
        pthread_mutex_unlock(&ctx->lock);
        return st;
    }
    size_t size = spw__block_size(b);
    e->ptr = spw__block_ptr(b);
    e->block = b;
    e->arena = a;
    e->requested = bytes;
    hash_oom = 0;
    HASH_ADD_PTR(ctx->live_map, ptr, e);
    if (SPW_UNLIKELY(hash_oom)) {
        /* not in the map (first table) or in it without the table grown: either way, undo */
        spw_live *in = NULL;
        HASH_FIND_PTR(ctx->live_map, &e->ptr, in);
        if (in) HASH_DEL(ctx->live_map, e);
        spw__arena_free(a, b, stream);
        live_put(ctx, e);
        pthread_mutex_unlock(&ctx->lock);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw_malloc: out of host memory for the pointer map");
    }
    spw__stat_add(&ctx->stats.live, (int64_t)size);
    spw__stat_add(&ctx->stats.cached, -(int64_t)size);
    spw__stat_add(&ctx->stats.requested, (int64_t)bytes);
    spw__stat_event(&ctx->stats.allocs);
    *out = e->ptr;
    pthread_mutex_unlock(&ctx->lock);
    return SPW_OK;
}

SPW_API spw_status spw_free(spw_ctx *ctx, void *ptr, spw_stream stream) {
    if (SPW_UNLIKELY(!ctx)) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_free: context is NULL");
    if (SPW_UNLIKELY(!ptr)) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_free: pointer is NULL");
    pthread_mutex_lock(&ctx->lock);
    spw_live *e = NULL;
    HASH_FIND_PTR(ctx->live_map, &ptr, e);
    if (SPW_UNLIKELY(!e)) {
        bool ours = spw__arena_owns(ctx->small, ptr) || spw__arena_owns(ctx->large, ptr);
        pthread_mutex_unlock(&ctx->lock);
        if (ours)
            return spw__error(SPW_ERR_STATE, "spw_free: %p is not a live allocation of this context "
                              "(double free, or a pointer into the middle of a block)", ptr);
        return spw__error(SPW_ERR_NOT_FOUND, "spw_free: %p was not allocated by this context", ptr);
    }
    HASH_DEL(ctx->live_map, e);
    size_t size = spw__block_size(e->block);
    spw__arena_free(e->arena, e->block, stream);
    spw__stat_add(&ctx->stats.live, -(int64_t)size);
    spw__stat_add(&ctx->stats.cached, (int64_t)size);
    spw__stat_add(&ctx->stats.requested, -(int64_t)e->requested);
    spw__stat_event(&ctx->stats.frees);
    live_put(ctx, e);
    pthread_mutex_unlock(&ctx->lock);
    return SPW_OK;
}

/* Return every cached block of both arenas to the backend. Context lock held. */
static spw_status trim_cache(spw_ctx *ctx) {
    size_t got;
    spw_status st = spw__arena_trim(ctx->small, SIZE_MAX, &got);
    return st ? st : spw__arena_trim(ctx->large, SIZE_MAX, &got);
}

bool spw__ctx_live_requested(spw_ctx *ctx, const void *ptr, size_t *requested) {
    pthread_mutex_lock(&ctx->lock);
    spw_live *e = NULL;
    HASH_FIND_PTR(ctx->live_map, &ptr, e);
    if (e && requested) *requested = e->requested;
    pthread_mutex_unlock(&ctx->lock);
    return e != NULL;
}

spw_status spw__ctx_set_budget(spw_ctx *ctx, size_t bytes) {
    if (bytes == 0 || bytes > ctx->budget_max)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "budget %zu B: must be between 1 B and the budget the "
                          "context was created with (%zu B)", bytes, ctx->budget_max);
    pthread_mutex_lock(&ctx->lock);
    ctx->budget = bytes;
    ctx->stats.budget = bytes;
    /* give back cached memory now; live bytes above the new budget stay until freed */
    spw_status st = (size_t)ctx->stats.held.current > bytes ? trim_cache(ctx) : SPW_OK;
    pthread_mutex_unlock(&ctx->lock);
    return st;
}

SPW_API spw_status spw_empty_cache(spw_ctx *ctx) {
    if (!ctx) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_empty_cache: context is NULL");
    pthread_mutex_lock(&ctx->lock);
    spw_status st = trim_cache(ctx);
    pthread_mutex_unlock(&ctx->lock);
    return st;
}

SPW_API spw_status spw_stats_reset_peaks(spw_ctx *ctx) {
    if (!ctx) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_stats_reset_peaks: context is NULL");
    pthread_mutex_lock(&ctx->lock);
#define SPW_RESET_PEAK_(name, is_bytes, desc) ctx->stats.name.peak = ctx->stats.name.current;
    SPW_STAT_LIST(SPW_RESET_PEAK_)
#undef SPW_RESET_PEAK_
    pthread_mutex_unlock(&ctx->lock);
    return SPW_OK;
}

/* ---- streams: thin, checked pass-throughs to the backend ---- */

SPW_API spw_status spw_stream_create(spw_ctx *ctx, spw_stream *out) {
    if (!ctx || !out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_stream_create: NULL argument");
    return ctx->backend->ops->stream_create(ctx->backend, out);
}

SPW_API spw_status spw_stream_destroy(spw_ctx *ctx, spw_stream stream) {
    if (!ctx) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_stream_destroy: context is NULL");
    if (!stream) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_stream_destroy: the default stream cannot be destroyed");
    spw_status st = ctx->backend->ops->stream_sync(ctx->backend, stream);
    if (st) return st;
    pthread_mutex_lock(&ctx->lock);
    st = spw__arena_retire_stream(ctx->small, stream);
    if (!st) st = spw__arena_retire_stream(ctx->large, stream);
    pthread_mutex_unlock(&ctx->lock);
    if (st) return st;
    return ctx->backend->ops->stream_destroy(ctx->backend, stream);
}

SPW_API spw_status spw_stream_synchronize(spw_ctx *ctx, spw_stream stream) {
    if (!ctx) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_stream_synchronize: context is NULL");
    return ctx->backend->ops->stream_sync(ctx->backend, stream);
}

SPW_API spw_status spw_launch_host(spw_ctx *ctx, spw_stream stream, void (*fn)(void *), void *arg) {
    if (!ctx || !fn) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_launch_host: NULL argument");
    return ctx->backend->ops->launch_host(ctx->backend, stream, fn, arg);
}
