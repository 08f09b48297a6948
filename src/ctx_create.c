/*
 * A context's creation, teardown and reports: the one place that composes the layers (backend,
 * the two arenas of ctx.c, the offload engine) and asks each for its part of the statistics.
 */
#include <stdlib.h>

#include "ctx.h"
#include "engine.h"
#include "stats.h"

/* The policy the engine is handed, by option value (NULL: none). */
static const spw_policy_ops *policy_ops(spw_policy_kind kind) {
    switch (kind) {
    case SPW_POLICY_LRU: return &spw__policy_lru;
    case SPW_POLICY_PLAN: return &spw__policy_plan;
    }
    return NULL;
}

static spw_status pick_backend(const spw_config *cfg, spw_backend **out) {
    spw_backend_params bp = {
        .device = cfg->device,
        .emu_capacity = cfg->emu_capacity,
        .emu_granularity = cfg->vmm_page,
        .emu_vmm = 1,
        .emu_managed = 1,
        .emu_h2d_gbps = cfg->emu_link_gbps,
        .emu_pin_limit = cfg->emu_pin_limit,
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
    spw_arena_params ap = {.backend = ctx->backend,
                           .acct = {.held = &ctx->stats.held,
                                    .cached = &ctx->stats.cached,
                                    .segments = &ctx->stats.segments,
                                    .backend_allocs = &ctx->stats.backend_allocs,
                                    .backend_frees = &ctx->stats.backend_frees,
                                    .cross_stream_waits = &ctx->stats.cross_stream_waits,
                                    .trim_syncs = &ctx->stats.trim_syncs,
                                    .live = &ctx->stats.live,
                                    .budget = &ctx->budget},
                           .grow_ahead = ctx->cfg.grow_ahead,
                           .frag_slack = ctx->cfg.frag_slack,
                           .page = page,
                           .vmm = vmm};
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
    const spw_policy_ops *pops = policy_ops(ctx->cfg.policy);
    if (!pops) {
        st = spw__error(SPW_ERR_CONFIG, "option 'policy': value %d has no implementation",
                        (int)ctx->cfg.policy);
        goto fail;
    }
    if ((st = spw__engine_create(ctx, pops))) goto fail;
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
    spw__ctx_live_clear(ctx);
    spw__engine_destroy(ctx); /* buffers first: their device blocks live in the arenas */
    /* the backend drains every stream before memory goes away */
    spw__arena_destroy(ctx->small);
    spw__arena_destroy(ctx->large);
    ctx->backend->ops->destroy(ctx->backend);
    pthread_mutex_destroy(&ctx->lock);
    free(ctx);
    return SPW_OK;
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

void spw__ctx_describe_policy(spw_ctx *ctx, char *buf, size_t len) {
    pthread_mutex_lock(&ctx->lock);
    spw__engine_describe(ctx, buf, len);
    pthread_mutex_unlock(&ctx->lock);
}

SPW_API spw_status spw_summary(spw_ctx *ctx, FILE *f) {
    if (!ctx || !f) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_summary: NULL argument");
    spw_stats st;
    char policy[SPW__POLICY_DESCRIBE_MAX];
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
