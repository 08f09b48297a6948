/*
 * The copy engine: one H2D and one D2H copy stream per context, so uploads, write-backs and the
 * caller's compute overlap; every dependency is an event (see the ordering model in engine.h);
 * no host-blocking synchronization here except the rare recovery from an event that could not
 * be recorded. All functions run under the context lock.
 */
#include "engine.h"

#define OPS(ctx) ((ctx)->backend->ops)
#define BE(ctx) ((ctx)->backend)

spw_status spw__copy_streams(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (e->streams_ok) return SPW_OK;
    spw_stream h = NULL, d = NULL;
    spw_status st = OPS(ctx)->stream_create(BE(ctx), &h);
    if (st) return spw__error_prefix(st, "offload engine: creating the host-to-device copy stream");
    st = OPS(ctx)->stream_create(BE(ctx), &d);
    if (st) {
        OPS(ctx)->stream_destroy(BE(ctx), h);
        return spw__error_prefix(st, "offload engine: creating the device-to-host copy stream");
    }
    e->h2d = h;
    e->d2h = d;
    e->streams_ok = true;
    return SPW_OK;
}

void spw__copy_streams_destroy(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (!e->streams_ok) return;
    /* the destroy waits for the streams' work (emu) or lets it finish (cuda) */
    OPS(ctx)->stream_destroy(BE(ctx), e->h2d);
    OPS(ctx)->stream_destroy(BE(ctx), e->d2h);
    e->streams_ok = false;
}

spw_status spw__copy_record_dev(spw_ctx *ctx, spw_buf *b, spw_stream s) {
    if (b->host_in_dev) { /* ev_dev's record is also the host copy's: ev_host takes it over */
        spw_event t = b->ev_host;
        b->ev_host = b->ev_dev;
        b->ev_dev = t;
        b->host_rec = true;
        b->host_in_dev = false;
    }
    b->dev_waited = false;
    b->dev_done = false;
    return OPS(ctx)->event_record(BE(ctx), b->ev_dev, s);
}

spw_status spw__copy_order_dev(spw_ctx *ctx, spw_buf *b, spw_stream s) {
    if (!b->dev_touched || b->dev_s == s) return SPW_OK; /* nothing to wait for, or stream order */
    if (b->dev_rec && b->dev_waited && b->dev_waiter == s) return SPW_OK; /* waits already */
    if (b->dev_rec && b->dev_done) return SPW_OK; /* the last touch is complete */
    spw_status st;
    if (!b->dev_rec) {
        /* the last touches are plain work on dev_s: mark their end */
        if ((st = spw__copy_record_dev(ctx, b, b->dev_s))) return st;
        b->dev_rec = true;
    }
    if ((st = OPS(ctx)->stream_wait(BE(ctx), s, b->ev_dev))) return st;
    b->dev_waited = true;
    b->dev_waiter = s;
    return SPW_OK;
}

/* Order copy stream `s` after pending host-copy work on the other copy stream. */
static spw_status order_host(spw_ctx *ctx, spw_buf *b, spw_stream s) {
    struct spw_engine *e = ctx->engine;
    spw_status st;
    if (b->host_in_dev && b->host_s != s && (st = spw__copy_order_dev(ctx, b, s))) return st;
    if (b->host_rec && b->host_s != s && (st = OPS(ctx)->stream_wait(BE(ctx), s, b->ev_host))) return st;
    unsigned other = s == e->h2d ? SPW_UNTRACKED_D2H : SPW_UNTRACKED_H2D;
    if (b->untracked & other) {
        /* rare: an earlier event_record failed after its copy was enqueued */
        if ((st = OPS(ctx)->stream_sync(BE(ctx), s == e->h2d ? e->d2h : e->h2d))) return st;
        b->untracked &= ~other;
    }
    return SPW_OK;
}

spw_status spw__copy_upload(spw_ctx *ctx, spw_buf *b) {
    struct spw_engine *e = ctx->engine;
    spw_status st;
    if (b->managed) {
        if ((st = spw__copy_order_dev(ctx, b, e->h2d))) return st;
        void *sp = spw__tsink_span_begin(ctx, e->h2d, "prefetch to device", "copy H2D", b->bytes, b->id, 0);
        st = OPS(ctx)->prefetch(BE(ctx), b->host, b->bytes, 1, e->h2d);
        spw__tsink_span_end(ctx, e->h2d, sp);
        if (st) return st;
        /* even unrecorded, the state is exact: the migration is stream order on h2d */
        b->dev_s = e->h2d;
        b->dev_rec = false;
        b->dev_touched = true;
        if ((st = spw__copy_record_dev(ctx, b, e->h2d))) return st;
        b->dev_rec = true;
        b->xfer = true;
        /* a read-mostly replica still in place (its collapse was pending) was counted when
         * it was made: the prefetch finds the pages and moves nothing */
        if (!b->replica) spw__stat_add(&ctx->stats.bytes_h2d, (int64_t)b->bytes);
        b->replica = b->adv_rm;
        return SPW_OK;
    }
    /* explicit: the block was allocated on h2d (dev_s == h2d), so the copy is ordered after
     * the block's previous life by the arena */
    return spw__copy_upload_range(ctx, b, 0, b->bytes);
}

/* Enqueue the H2D copy of [off, off+n) of b. */
static spw_status copy_piece(spw_ctx *ctx, spw_buf *b, size_t off, size_t n) {
    struct spw_engine *e = ctx->engine;
    void *sp = spw__tsink_span_begin(ctx, e->h2d, "upload", "copy H2D", n, b->id, 0);
    spw_status st = OPS(ctx)->memcpy_async(BE(ctx), (char *)b->dev + off, (char *)b->host + off, n, SPW_COPY_H2D, e->h2d);
    spw__tsink_span_end(ctx, e->h2d, sp);
    return st;
}

static spw_status upload_done(spw_ctx *ctx, spw_buf *b, size_t n);

spw_status spw__copy_upload_range(spw_ctx *ctx, spw_buf *b, size_t off, size_t n) {
    struct spw_engine *e = ctx->engine;
    spw_status st;
    if ((st = spw__copy_order_dev(ctx, b, e->h2d))) return st;
    if ((st = order_host(ctx, b, e->h2d))) return st;
    if ((st = copy_piece(ctx, b, off, n))) return st;
    return upload_done(ctx, b, n);
}

typedef struct span {
    size_t lo, hi;
} span;

/* Whether any of the nw owed waits is on an event not yet complete. A wait whose event is
 * complete orders nothing: dropped, it costs neither the stream wait nor a copy of its own. A
 * victim's last read is usually long done when the caller, not the device, bounds the step, and
 * each enqueue is a driver call on the caller's own time. */
static bool waits_pending(spw_ctx *ctx, const spw_arena_wait *w, int nw) {
    for (int i = 0; i < nw; i++)
        if (OPS(ctx)->event_query(BE(ctx), w[i].ev) != SPW_OK) {
            spw__error_clear(); /* "not complete" is an answer here, not a failure */
            return true;
        }
    return false;
}

spw_status spw__copy_upload_ordered(spw_ctx *ctx, spw_buf *b, const spw_arena_wait *w, int nw) {
    if (!nw || b->managed || !waits_pending(ctx, w, nw)) return spw__copy_upload(ctx, b);
    struct spw_engine *e = ctx->engine;
    spw_status st;
    if ((st = spw__copy_order_dev(ctx, b, e->h2d))) return st;
    if ((st = order_host(ctx, b, e->h2d))) return st;
    /* the bytes of b that owe a wait, as sorted disjoint spans relative to b->dev */
    span owe[SPW_ARENA_OWED_MAX];
    int no = 0;
    uintptr_t d = (uintptr_t)b->dev;
    for (int i = 0; i < nw; i++) {
        size_t lo = w[i].lo > d ? w[i].lo - d : 0, hi = w[i].hi > d ? SPW_MIN(w[i].hi - d, b->bytes) : 0;
        if (hi <= lo) continue;
        int j = no++;
        for (; j > 0 && owe[j - 1].lo > lo; j--) owe[j] = owe[j - 1];
        owe[j] = (span){lo, hi};
    }
    int m = 0;
    for (int i = 0; i < no; i++) {
        if (m && owe[i].lo <= owe[m - 1].hi) owe[m - 1].hi = SPW_MAX(owe[m - 1].hi, owe[i].hi);
        else owe[m++] = owe[i];
    }
    /* what owes nothing first (it may run while the previous occupant's reader still does),
     * then the waits, then the rest */
    bool enqueued = false;
    size_t at = 0;
    for (int i = 0; i <= m && !st; i++) {
        size_t end = i < m ? owe[i].lo : b->bytes;
        if (end > at && !(st = copy_piece(ctx, b, at, end - at))) enqueued = true;
        if (i < m) at = owe[i].hi;
    }
    for (int i = 0; i < nw && !st; i++) {
        st = spw__backend_order_after(BE(ctx), e->h2d, w[i].ev);
    }
    for (int i = 0; i < m && !st; i++)
        if (!(st = copy_piece(ctx, b, owe[i].lo, owe[i].hi - owe[i].lo))) enqueued = true;
    if (st) {
        if (enqueued) b->untracked |= SPW_UNTRACKED_H2D; /* pieces still read the host copy */
        return st;
    }
    return upload_done(ctx, b, b->bytes);
}

/* After the copies of n bytes of b on the H2D stream: record them as the device copy's latest
 * touch and the host copy's last transfer. */
static spw_status upload_done(spw_ctx *ctx, spw_buf *b, size_t n) {
    struct spw_engine *e = ctx->engine;
    spw_status st;
    /* h2d now follows every touch of the device copy (order_dev) */
    b->dev_s = e->h2d;
    b->dev_rec = false;
    if ((st = spw__copy_record_dev(ctx, b, e->h2d))) {
        b->untracked |= SPW_UNTRACKED_H2D; /* the copy still reads the host copy */
        return st;
    }
    /* one record marks both: the copy's end on h2d is the device copy's latest touch and the
     * host copy's last transfer */
    b->dev_rec = true;
    b->host_s = e->h2d;
    b->host_rec = false;
    b->host_in_dev = true;
    b->xfer = true;
    b->up_step = e->step;
    spw__stat_add(&ctx->stats.bytes_h2d, (int64_t)n);
    if (b->pageable) spw__stat_add(&ctx->stats.h2d_pageable, (int64_t)n);
    return SPW_OK;
}

spw_status spw__copy_writeback(spw_ctx *ctx, spw_buf *b) {
    struct spw_engine *e = ctx->engine;
    spw_status st;
    if ((st = spw__copy_order_dev(ctx, b, e->d2h))) return st;
    if ((st = order_host(ctx, b, e->d2h))) return st;
    void *sp = spw__tsink_span_begin(ctx, e->d2h, "write-back", "copy D2H", b->bytes, b->id, 0);
    st = OPS(ctx)->memcpy_async(BE(ctx), b->host, b->dev, b->bytes, SPW_COPY_D2H, e->d2h);
    spw__tsink_span_end(ctx, e->d2h, sp);
    if (st) return st;
    /* d2h now follows every touch and reads the block: it is the device copy's last toucher */
    b->dev_s = e->d2h;
    b->dev_rec = false;
    if ((st = OPS(ctx)->event_record(BE(ctx), b->ev_host, e->d2h))) {
        b->untracked |= SPW_UNTRACKED_D2H; /* writes into the (invalid) host copy, untracked */
        return st;
    }
    b->host_s = e->d2h;
    b->host_rec = true;
    b->hv = true;
    spw__stat_add(&ctx->stats.bytes_d2h, (int64_t)b->bytes);
    return SPW_OK;
}

spw_status spw__copy_managed_to_host(spw_ctx *ctx, spw_buf *b) {
    struct spw_engine *e = ctx->engine;
    spw_status st;
    if ((st = spw__copy_order_dev(ctx, b, e->d2h))) return st;
    void *sp = spw__tsink_span_begin(ctx, e->d2h, "prefetch to host", "copy D2H", b->bytes, b->id, 0);
    st = OPS(ctx)->prefetch(BE(ctx), b->host, b->bytes, 0, e->d2h);
    spw__tsink_span_end(ctx, e->d2h, sp);
    if (st) return st;
    b->dev_s = e->d2h;
    b->dev_rec = false;
    b->dev_touched = true;
    /* the pages move whatever their state: unified memory does not know they are clean */
    spw__stat_add(&ctx->stats.bytes_d2h, (int64_t)b->bytes);
    /* recording is an optimization here (host waiters can synchronize d2h instead) */
    if (!spw__copy_record_dev(ctx, b, e->d2h)) b->dev_rec = true;
    return SPW_OK;
}

void spw__copy_host_wait_collect(spw_ctx *ctx, spw_buf *b, bool include_dev, spw_host_wait *w) {
    struct spw_engine *e = ctx->engine;
    w->nev = w->nsync = 0;
    if (b->host_rec) w->ev[w->nev++] = b->ev_host;
    if (b->host_in_dev) w->ev[w->nev++] = b->ev_dev;
    if (b->untracked & SPW_UNTRACKED_H2D) w->sync[w->nsync++] = e->h2d;
    if (b->untracked & SPW_UNTRACKED_D2H) w->sync[w->nsync++] = e->d2h;
    if (include_dev && b->managed) {
        if (b->dev_rec) w->ev[w->nev++] = b->ev_dev;
        else if (b->dev_touched) w->sync[w->nsync++] = b->dev_s;
    }
}

spw_status spw__copy_host_wait(spw_ctx *ctx, const spw_host_wait *w) {
    spw_status st;
    for (int i = 0; i < w->nev; i++)
        if ((st = OPS(ctx)->event_sync(BE(ctx), w->ev[i]))) return st;
    for (int i = 0; i < w->nsync; i++)
        if ((st = OPS(ctx)->stream_sync(BE(ctx), w->sync[i]))) return st;
    return SPW_OK;
}
