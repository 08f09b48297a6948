/*
 * Page-locked memory for caller memory registered as host copies (spw_buf_register_host), and
 * its share among the buffers when there is not enough of it for all.
 *
 * Why: a copy from pageable memory is staged by the driver through its own page-locked buffers,
 * slower than the link and holding the calling thread. Some systems limit page-locked memory
 * (WSL2: a few GB, less under Docker), and pin_limit lets a user cap what a context takes from
 * the whole system. Registration happens in creation order, so what gets page-locked is the
 * model's first tensors; under policy=plan those are often the ones kept on the device and
 * uploaded once, while the ones streamed every step stay pageable.
 *
 * Rebalancing: a look at the end of steps 2, 4, 8, 16, 32, 64 and every 64th after (a plan
 * settles within its first steps and is rechecked rarely), while some registered host copy is
 * pageable. Each pageable host copy uploaded in the step is page-locked; when that is refused,
 * host copies not uploaded since the previous look are unlocked (in creation order) until the
 * refused one fits, and it is tried once more. "Since the previous look", not "in the last
 * step": a byte-optimal eviction over a repeating step keeps a set that rotates from step to
 * step, every buffer moving now and then, and there page-locked memory is as useful anywhere;
 * a window as long as the rotation leaves it in place instead of moving it back and forth. A
 * host copy with a transfer in flight, or open to host code, is left as it is. Page-locking is
 * a system call that walks the pages, so this runs where the caller already pays for a step
 * boundary, a bounded number of times.
 *
 * Everything here runs under the context lock.
 */
#include "engine.h"

#define OPS(ctx) ((ctx)->backend->ops)
#define BE(ctx) ((ctx)->backend)

spw_status spw__pin_register(spw_ctx *ctx, spw_buf *b) {
    struct spw_engine *e = ctx->engine;
    spw_status st;
    if (!ctx->cfg.host_register)
        st = spw__error(SPW_ERR_UNSUPPORTED, "host copies are left pageable (host_register=off)");
    else if (b->bytes > ctx->cfg.pin_limit || e->pinned_user > ctx->cfg.pin_limit - b->bytes)
        st = spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "page-locking %zu B more would pass pin_limit: %zu of %zu B in use",
                        b->bytes, e->pinned_user, ctx->cfg.pin_limit);
    else
        st = OPS(ctx)->host_register(BE(ctx), b->host, b->bytes);
    bool was = b->pageable;
    b->registered = st == SPW_OK;
    b->pageable = st != SPW_OK && st != SPW_ERR_STATE;
    if (b->registered) e->pinned_user += b->bytes;
    if (b->pageable != was) spw__stat_add(&ctx->stats.host_pageable, b->pageable ? (int64_t)b->bytes : -(int64_t)b->bytes);
    return st;
}

void spw__pin_forget(spw_ctx *ctx, spw_buf *b) {
    if (b->registered) {
        OPS(ctx)->host_unregister(BE(ctx), b->host); /* failure: nothing to undo */
        ctx->engine->pinned_user -= b->bytes;
        b->registered = false;
    } else if (b->pageable) {
        spw__stat_add(&ctx->stats.host_pageable, -(int64_t)b->bytes);
        b->pageable = false;
    }
}

/* Whether no transfer reads or writes b's host copy and no host code has it open: every event
 * of its last transfers complete, no copy stream to synchronize. Asks the driver, never waits. */
static bool host_idle(spw_ctx *ctx, spw_buf *b) {
    if (b->host_busy || b->host_open) return false;
    spw_host_wait w;
    spw__copy_host_wait_collect(ctx, b, false, &w);
    if (w.nsync) return false;
    for (int i = 0; i < w.nev; i++)
        if (OPS(ctx)->event_query(BE(ctx), w.ev[i]) != SPW_OK) return false;
    return true;
}

static bool due(uint64_t step) {
    return step >= 2 && (step <= 64 ? (step & (step - 1)) == 0 : step % 64 == 0);
}

/* Unlock host copies not uploaded since the previous look, in creation order, until `want`
 * bytes are given back; returns the bytes given back. */
static size_t unlock_idle(spw_ctx *ctx, size_t want) {
    struct spw_engine *e = ctx->engine;
    size_t freed = 0;
    for (spw_buf *x = e->first; x && freed < want; x = x->next) {
        if (!x->user_host || !x->registered || x->up_step > e->pin_look || !host_idle(ctx, x)) continue;
        if (OPS(ctx)->host_unregister(BE(ctx), x->host)) continue;
        e->pinned_user -= x->bytes;
        x->registered = false;
        x->pageable = true;
        spw__stat_add(&ctx->stats.host_pageable, (int64_t)x->bytes);
        spw__stat_add(&ctx->stats.repins, 1);
        freed += x->bytes;
    }
    return freed;
}

void spw__pin_rebalance(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (!ctx->cfg.pin_rebalance || !ctx->cfg.host_register || ctx->stats.host_pageable.current <= 0 || !due(e->step))
        return;
    for (spw_buf *b = e->first; b; b = b->next) {
        if (!b->user_host || !b->pageable || b->up_step != e->step || !host_idle(ctx, b)) continue;
        spw_status st = spw__pin_register(ctx, b);
        if (st != SPW_OK && st != SPW_ERR_STATE && unlock_idle(ctx, b->bytes)) st = spw__pin_register(ctx, b);
        if (st == SPW_OK) spw__stat_add(&ctx->stats.repins, 1);
        else if (st != SPW_ERR_STATE) break; /* no more to be had than what was given back */
    }
    e->pin_look = e->step;
    spw__error_clear();
}
