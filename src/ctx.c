/*
 * The context: one device, one backend, one budget, two arenas (small and large requests), the
 * pointer map, and the public allocator entry points. One mutex guards all of it; the cached
 * allocate/free path holds it briefly and makes no backend call.
 */
#include <stdlib.h>
#include <string.h>

/* uthash must never exit: a failed table allocation only sets this flag (checked after adds) */
static _Thread_local int hash_oom;
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) ((void)(obj), hash_oom = 1)
#include <uthash.h>

#include "internal.h"

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

void spw__stat_add(spw_counter *c, int64_t delta) {
    c->current += delta;
    if (c->current > c->peak) c->peak = c->current;
    if (delta > 0) c->total += delta;
}

void spw__stat_event(spw_counter *c) {
    c->current++;
    c->total++;
    c->peak = c->current;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A short spin before blocking: the prefetch worker's questions hold the lock for about a
 * microsecond, and blocking would make both sides take system calls (the wait, the wake). */
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

static spw_status pick_backend(const spw_config *cfg, spw_backend **out) {
    spw_backend_params bp = {
        .device = cfg->device,
        .emu_capacity = cfg->emu_capacity,
        .emu_granularity = cfg->vmm_page,
        .emu_vmm = 1,
        .emu_managed = 1,
        .emu_h2d_gbps = cfg->emu_link_gbps,
    };
    switch (cfg->backend) {
    case SPW_BACKEND_CUDA:
        return spw__backend_cuda_create(&bp, out);
    case SPW_BACKEND_EMU:
        return spw__backend_emu_create(&bp, out);
    case SPW_BACKEND_AUTO:
        if (spw__backend_cuda_available()) return spw__backend_cuda_create(&bp, out);
        return spw__backend_emu_create(&bp, out);
    }
    return spw__error(SPW_ERR_CONFIG, "option 'backend': bad value");
}

SPW_API spw_status spw_ctx_create(const spw_config *cfg_in, spw_ctx **out) {
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_ctx_create: out is NULL");
    spw_config *defaults = NULL;
    spw_status st;
    if (!cfg_in) {
        if ((st = spw_config_create(&defaults))) return st;
        if ((st = spw_config_from_env(defaults))) {
            spw_config_destroy(defaults);
            return st;
        }
        cfg_in = defaults;
    }
    spw_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) {
        spw_config_destroy(defaults);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw_ctx_create: out of host memory");
    }
    ctx->cfg = *cfg_in;
    spw_config_destroy(defaults);
    pthread_mutex_init(&ctx->lock, NULL);

    if ((st = pick_backend(&ctx->cfg, &ctx->backend))) goto fail;
    if ((st = ctx->backend->ops->device_info(ctx->backend, &ctx->dev))) goto fail;
    ctx->budget = spw__size_resolve(&ctx->cfg.budget, ctx->dev.total_bytes);
    if (ctx->budget == 0) {
        st = spw__error(SPW_ERR_CONFIG, "option 'budget': resolves to 0 bytes on a device of %zu B",
                        ctx->dev.total_bytes);
        goto fail;
    }
    ctx->stats.budget = ctx->budget;
    ctx->budget_max = ctx->budget;

    bool vmm = ctx->dev.vmm_supported && ctx->backend->ops->map && ctx->cfg.vmm != SPW_TRI_OFF;
    if (ctx->cfg.vmm == SPW_TRI_ON && !vmm) {
        st = spw__error(SPW_ERR_UNSUPPORTED, "option 'vmm=on': the %s device does not support virtual "
                                             "memory management (use vmm=auto or vmm=off)",
                        ctx->backend->ops->name);
        goto fail;
    }
    size_t page = vmm ? SPW_MAX(ctx->dev.vmm_granularity, (size_t)2 * SPW_MiB) : 2 * SPW_MiB;
    ctx->page = page;
    if (ctx->cfg.vmm_large_page > SPW_GiB) {
        st = spw__error(SPW_ERR_CONFIG, "option 'vmm_large_page': %zu B is above the limit of 1 GiB",
                        ctx->cfg.vmm_large_page);
        goto fail;
    }
    /* Large buffers take large pages: a copy is split at every physical allocation under it */
    size_t large_page = page;
    while (vmm && large_page < ctx->cfg.vmm_large_page) large_page *= 2;
    /* Address space is cheap; twice the budget leaves room for holes between live blocks. A
     * budget above the device's memory can never be held: the device bounds the reservation. */
    size_t holdable = ctx->dev.total_bytes ? SPW_MIN(ctx->budget, ctx->dev.total_bytes) : ctx->budget;
    size_t reserve = SPW_ALIGN_UP(SPW_MAX(2 * holdable, (size_t)4 * SPW_GiB), large_page);
    spw_arena_params ap = {.backend = ctx->backend, .ctx = ctx, .page = page, .vmm = vmm};
    ap.name = "small";
    ap.reserve_bytes = SPW_ALIGN_UP(SPW_MIN(ctx->budget, 64 * SPW_GiB) + page, page);
    ap.min_segment = 2 * SPW_MiB;
    if ((st = spw__arena_create(&ap, &ctx->small))) goto fail;
    ap.name = "large";
    ap.whole = !vmm;
    ap.page = large_page;
    ap.reserve_bytes = reserve;
    ap.min_segment = 2 * SPW_MiB;
    if ((st = spw__arena_create(&ap, &ctx->large))) goto fail;
    if ((st = spw__engine_create(ctx))) goto fail;
    *out = ctx;
    return SPW_OK;
fail:
    spw__arena_destroy(ctx->large);
    spw__arena_destroy(ctx->small);
    if (ctx->backend) ctx->backend->ops->destroy(ctx->backend);
    pthread_mutex_destroy(&ctx->lock);
    free(ctx);
    return st;
}

SPW_API spw_status spw_ctx_destroy(spw_ctx *ctx) {
    if (!ctx) return SPW_OK;
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
    spw__engine_destroy(ctx); /* buffers first: their device blocks live in the arenas */
    /* the backend drains every stream before memory goes away */
    spw__arena_destroy(ctx->small);
    spw__arena_destroy(ctx->large);
    ctx->backend->ops->destroy(ctx->backend);
    pthread_mutex_destroy(&ctx->lock);
    free(ctx);
    return SPW_OK;
}

SPW_API const char *spw_ctx_backend(const spw_ctx *ctx) { return ctx ? ctx->backend->ops->name : "none"; }
SPW_API size_t spw_ctx_budget(const spw_ctx *ctx) { return ctx ? ctx->budget : 0; }

spw_status spw__ctx_oom(spw_ctx *ctx, size_t bytes, spw_stream s) {
    char req[48], bud[48], held[48], live[48], cached[48], pinned[48], largest[48];
    const spw_stats *st = &ctx->stats;
    size_t lf = SPW_MAX(spw__arena_largest_free(ctx->small), spw__arena_largest_free(ctx->large));
    spw__stat_event(&ctx->stats.ooms);
    /* a budget that is not a multiple of the page says what whole pages of it can be held */
    char usable[96] = "", u[SPW_SIZE_FMT_MAX], pg[SPW_SIZE_FMT_MAX];
    if (ctx->page && ctx->budget % ctx->page)
        snprintf(usable, sizeof usable, ", usable %s (whole %s pages)",
                 spw__size_format(u, sizeof u, SPW_ALIGN_DOWN(ctx->budget, ctx->page)),
                 spw__size_format(pg, sizeof pg, ctx->page));
    return spw__error(
        SPW_ERR_OUT_OF_MEMORY,
        "out of device memory: requested %s on stream %p; budget %s%s, held %s, live %s, cached %s, "
        "pinned %s, largest free block %s. The budget is a hard limit (option 'budget'); raise it "
        "if the device has room, or free memory or release (spw_release) buffers first",
        spw__fmt_bytes(req, sizeof req, bytes), (void *)s, spw__fmt_bytes(bud, sizeof bud, ctx->budget), usable,
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
        /* evict unpinned buffers (policy order) unless on_exhaust=fail */
        if (st == SPW_ERR_OUT_OF_MEMORY) st = spw__engine_alloc_evicting(ctx, a, bytes, stream, &b);
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

SPW_API spw_status spw_stats_get(spw_ctx *ctx, spw_stats *out) {
    if (!ctx || !out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_stats_get: NULL argument");
    pthread_mutex_lock(&ctx->lock);
    spw__engine_stats_sync(ctx);
    *out = ctx->stats;
    out->largest_free_block = SPW_MAX(spw__arena_largest_free(ctx->small), spw__arena_largest_free(ctx->large));
    out->page = ctx->page;
    out->budget_usable = SPW_ALIGN_DOWN(out->budget, ctx->page);
    pthread_mutex_unlock(&ctx->lock);
    return SPW_OK;
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

void spw__ctx_describe_policy(spw_ctx *ctx, char *buf, size_t len) {
    pthread_mutex_lock(&ctx->lock);
    spw__engine_describe(ctx, buf, len);
    pthread_mutex_unlock(&ctx->lock);
}

SPW_API spw_status spw_summary(spw_ctx *ctx, FILE *f) {
    if (!ctx || !f) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_summary: NULL argument");
    spw_stats st;
    char policy[256];
    spw_stats_get(ctx, &st);
    spw__ctx_describe_policy(ctx, policy, sizeof policy);
    spw__stats_print_table(&st, spw_ctx_backend(ctx), f);
    if (policy[0]) fprintf(f, "  %s\n", policy);
    return SPW_OK;
}

SPW_API spw_status spw_summary_json(spw_ctx *ctx, FILE *f) {
    if (!ctx || !f) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_summary_json: NULL argument");
    spw_stats st;
    spw_stats_get(ctx, &st);
    spw__stats_print_json(&st, spw_ctx_backend(ctx), f);
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
