/*
 * The offload engine's residency machinery: device copies allocated under pressure (evicting
 * through the policy), eviction and write-back, managed budget charges, and the read-mostly
 * replica collapse list. States, invariants and locking: buffer.c; ordering model and
 * read-mostly replicas: engine.h. Every function here runs with the context lock held.
 */
#include "engine.h"

#define OPS(ctx) ((ctx)->backend->ops)
#define BE(ctx) ((ctx)->backend)

/* ---- residency bookkeeping ---- */

static void set_resident(spw_ctx *ctx, spw_buf *b, bool on) {
    if (b->resident == on) return;
    b->resident = on;
    spw__stat_add(&ctx->stats.buffers_resident, on ? 1 : -1);
    spw__stat_add(&ctx->stats.buffers_host, on ? -1 : 1);
    spw__stat_add(&ctx->stats.resident_bytes, on ? (int64_t)b->bytes : -(int64_t)b->bytes);
    if (on) {
        if (ctx->engine->pops->on_resident) ctx->engine->pops->on_resident(ctx->engine->pol, b);
    } else {
        if (ctx->engine->pops->on_evicted) ctx->engine->pops->on_evicted(ctx->engine->pol, b);
    }
}

/* Charge or refund a managed buffer's bytes as held and live device memory. */
static void managed_charge(spw_ctx *ctx, spw_buf *b, int sign) {
    spw__stat_add(&ctx->stats.held, sign * (int64_t)b->bytes);
    spw__stat_add(&ctx->stats.live, sign * (int64_t)b->bytes);
}

/* Give the device block back, ordered after every touch: freeing on dev_s (engine.h). */
static void release_block(spw_ctx *ctx, spw_buf *b) {
    spw__pf_unmark(ctx, b); /* a last use the worker has not recorded yet: recorded now */
    size_t size = spw__block_size(b->dblock);
    /* Hand the block to the H2D copy stream, ordered after the exact last use (the event
     * recorded at release): the next upload, on that stream, then reuses it at once. Freed on
     * the last-use stream instead, another stream could only take it after an event recorded
     * at reuse time, which on a caller running ahead also waits for all the work enqueued
     * since (the next layer's product): transfers would no longer overlap compute. */
    struct spw_engine *e = ctx->engine;
    spw_stream s = b->dev_s;
    bool owed = false;
    if (e->streams_ok && b->dev_rec && s != e->h2d) {
        /* during an upload's allocation the H2D stream only owes the wait: the upload then
         * copies first what does not overlap this block (spw__res_make_resident) */
        owed = e->owe_waits && spw__arena_free_after(b->darena, b->dblock, e->h2d, b->ev_dev) == SPW_OK;
        if (!owed && OPS(ctx)->stream_wait(BE(ctx), e->h2d, b->ev_dev) == SPW_OK) s = e->h2d;
    }
    if (!owed) spw__arena_free(b->darena, b->dblock, s);
    spw__stat_add(&ctx->stats.live, -(int64_t)size);
    spw__stat_add(&ctx->stats.cached, (int64_t)size);
    spw__stat_add(&ctx->stats.requested, -(int64_t)b->bytes);
    b->dblock = NULL;
    b->darena = NULL;
    b->dev = NULL;
}

/* ---- read-only managed buffers: read-mostly replicas (model in engine.h) ---- */

/* Ask for a device replica of read-only managed b before its prefetch to the device: preferred
 * location the device, read-mostly. Advice takes effect at once, not in stream order; that is
 * harmless here: it only makes device reads duplicate pages instead of moving them. Advice
 * already in effect (a collapse still pending) is not repeated. Cannot fail: a refused
 * preferred location is only slower; without read-mostly (adv_rm stays false) the prefetch
 * migrates the pages and eviction migrates them back, as for read-write buffers. */
static void replica_advise(spw_ctx *ctx, spw_buf *b) {
    if (!b->adv_dev) b->adv_dev = OPS(ctx)->managed_advise(BE(ctx), b->host, b->bytes, SPW_ADVISE_PREFERRED_HOST) == SPW_OK;
    if (!b->adv_rm) b->adv_rm = OPS(ctx)->managed_advise(BE(ctx), b->host, b->bytes, SPW_ADVISE_READ_MOSTLY) == SPW_OK;
}

void spw__res_collapse_unlink(struct spw_engine *e, spw_buf *b) {
    if (!b->collapsing) return;
    if (b->cprev) b->cprev->cnext = b->cnext;
    else e->c_first = b->cnext;
    if (b->cnext) b->cnext->cprev = b->cprev;
    else e->c_last = b->cprev;
    b->cprev = b->cnext = NULL;
    b->collapsing = false;
}

/* Make sure ev_dev marks b's last device use. It is unrecorded only after a failed
 * event_record, and then dev_s is a copy stream (releases fail unless they record), so
 * recording now orders after that use (and maybe later copies: late, never early). */
static bool last_use_recorded(spw_ctx *ctx, spw_buf *b) {
    if (!b->dev_touched || b->dev_rec) return true;
    if (spw__copy_record_dev(ctx, b, b->dev_s)) return false;
    b->dev_rec = true;
    return true;
}

/* b (read-mostly, just made non-resident) keeps its replica until its last device use is
 * complete: queue it for spw__res_collapse_poll. Best effort, cannot fail: the poll retries
 * whatever fails here. */
static void collapse_add(spw_ctx *ctx, spw_buf *b) {
    struct spw_engine *e = ctx->engine;
    if (b->collapsing) return;
    last_use_recorded(ctx, b);
    b->collapsing = true;
    b->cnext = NULL;
    b->cprev = e->c_last;
    if (e->c_last) e->c_last->cnext = b;
    else e->c_first = b;
    e->c_last = b;
}

/* Drop b's replica, its last use being complete: preferred location the host first, so that
 * unsetting read-mostly collapses the copies onto the host's (valid since the data was last
 * written there: no transfer). Advice failures keep b listed, to be retried by the next poll:
 * nothing is lost meanwhile (the host copy stays valid, the replica only lingers), and a
 * collapse that cannot be done at all ends at destroy, whose free drops every copy. */
static void collapse_now(spw_ctx *ctx, spw_buf *b) {
    if (OPS(ctx)->managed_advise(BE(ctx), b->host, b->bytes, SPW_ADVISE_UNSET_READ_MOSTLY)) return;
    /* set again at once (no data moves): the next acquire then needs no advice, which would
     * otherwise wait behind the migrations in flight, leaving the stream idle between buffers */
    b->adv_rm = OPS(ctx)->managed_advise(BE(ctx), b->host, b->bytes, SPW_ADVISE_READ_MOSTLY) == SPW_OK;
    b->replica = false;
    spw__res_collapse_unlink(ctx->engine, b);
    spw__stat_event(&ctx->stats.managed_collapses);
    spw__tsink_instant(ctx->engine->sink, "collapse replica", NULL, "engine", b->bytes, b->id);
}

/* Collapse every listed replica whose last device use is complete. Called with the lock held
 * at every engine entry (buffer calls, steps, spw_malloc's eviction path, stats): one
 * event_query per listed buffer, never a host-blocking wait; nothing when the list is empty
 * (the acquire hot path). Buffers being destroyed are left to their destroy. */
void spw__res_collapse_poll(spw_ctx *ctx) {
    struct spw_engine *e = ctx->engine;
    if (!e || !e->c_first) return;
    spw_buf *next;
    for (spw_buf *b = e->c_first; b; b = next) {
        next = b->cnext;
        if (atomic_load(&b->magic) != SPW_BUF_ALIVE || !last_use_recorded(ctx, b)) continue;
        if (b->dev_touched && OPS(ctx)->event_query(BE(ctx), b->ev_dev) != SPW_OK) continue;
        collapse_now(ctx, b);
    }
}

/* Forget the device copy (after a write-back, or when it is clean or dead). Cannot fail. A
 * read-mostly managed buffer is refunded at once but keeps its replica until
 * spw__res_collapse_poll sees its last device use complete (the budget is a logical cap: the
 * physical replica lingers at most until the first engine call after that use completes). */
void spw__res_drop_device(spw_ctx *ctx, spw_buf *b) {
    if (b->managed) managed_charge(ctx, b, -1);
    else release_block(ctx, b);
    b->dv = false;
    b->xfer = false;
    b->prefetched = false;
    if (!b->managed) {
        b->dev_rec = false;
        b->dev_touched = false;
    }
    set_resident(ctx, b, false);
    if (b->managed && b->adv_rm) collapse_add(ctx, b);
}

/* Evict b. `user`: spw_evict (always write dirty data back) rather than the policy. On
 * failure b is unchanged and its contents intact. */
spw_status spw__res_evict_buf(spw_ctx *ctx, spw_buf *b, bool user) {
    struct spw_engine *e = ctx->engine;
    if (!b->resident) return SPW_OK;
    if (b->acq)
        return spw__error(SPW_ERR_STATE, "evict: buffer #%llu is acquired (%u times); release it first",
                          (unsigned long long)b->id, b->acq);
    spw_status st;
    bool wrote = false;
    if (b->managed) {
        /* read-mostly: the host copy is valid, nothing moves (spw__res_drop_device queues
         * the replica's collapse); otherwise the pages migrate to the host */
        if (!b->adv_rm && (st = spw__copy_managed_to_host(ctx, b))) return st;
        wrote = !(b->flags & SPW_BUF_READ_ONLY) && !b->dead;
    } else if (spw__pol_dirty(b)) {
        if (!user && e->pops->need_writeback && !e->pops->need_writeback(e->pol, b)) {
            b->dead = true; /* the policy vouches that nobody reads these contents */
            b->policy_dead = true;
        } else {
            if ((st = spw__copy_writeback(ctx, b))) return st;
            wrote = true;
        }
    }
    spw__stat_event(wrote ? &ctx->stats.evictions_dirty : &ctx->stats.evictions_clean);
    spw__tsink_instant(e->sink, wrote ? "evict (write-back)" : "evict (drop)", NULL, "engine", b->bytes, b->id);
    spw__res_drop_device(ctx, b);
    return SPW_OK;
}

/* ---- device memory under pressure ---- */

static size_t obtainable(const spw_ctx *ctx) {
    int64_t room = (int64_t)ctx->budget - ctx->stats.held.current + ctx->stats.cached.current;
    return room > 0 ? (size_t)room : 0;
}

/* Ask the policy for the next victim and evict it. SPW_ERR_OUT_OF_MEMORY (no message) when
 * there is none. */
static spw_status evict_next(spw_ctx *ctx, size_t need, spw_buf *incoming, int for_prefetch) {
    struct spw_engine *e = ctx->engine;
    spw_buf *v = e->pops->choose_victim(e->pol, need, incoming, for_prefetch);
    if (!v || v == incoming || !spw__pol_evictable(v)) return SPW_ERR_OUT_OF_MEMORY;
    return spw__res_evict_buf(ctx, v, false);
}

/* Enqueue the waits the H2D stream still owes for victims of an upload (their bytes served
 * another block, or none), so that they are not left waiting on events their buffers record
 * again. Only after a success: a failure leaves them owed, which is still safe (the arenas settle
 * before any other reuse, a buffer's destroy before its events go), so it is not reported; the
 * failure paths of the caller skip it, keeping their own message. */
static void settle_owed(spw_ctx *ctx) {
    if (spw__arena_settle(ctx->small) || spw__arena_settle(ctx->large)) spw__error_clear();
}

/* ---- room in one piece ---- */

#define WINDOW_VICTIMS 32 /* at most this many evictions make one run of room */

typedef struct window_ask {
    struct spw_engine *e;
    spw_buf *incoming, *choice; /* choice: choose_victim's answer, which ranks above all */
    int for_prefetch;
} window_ask;

static uint64_t rank_owner(void *u, void *owner) {
    window_ask *w = u;
    spw_buf *b = owner;
    if (b == w->choice) return UINT64_MAX;
    if (b == w->incoming || !spw__pol_evictable(b)) return 0;
    uint64_t r = w->e->pops->rank_victim(w->e->pol, b, w->incoming, w->for_prefetch);
    return r == UINT64_MAX ? r - 1 : r;
}

/* Evict the buffers of the run of adjacent device blocks of arena a that the policy gives up
 * most readily (arena_window.c), so that an upload on stream s finds `need` bytes in one piece
 * where the budget is all mapped: the alternative, returning scattered cached pages to map new
 * ones, makes the host wait for the device. SPW_ERR_OUT_OF_MEMORY (no message) when the policy
 * has no victim for this room (choose_victim's word, asked first) or no run exists. */
static spw_status evict_window(spw_ctx *ctx, spw_arena *a, size_t need, spw_stream s, spw_buf *incoming,
                               int for_prefetch) {
    struct spw_engine *e = ctx->engine;
    spw_buf *cv;
    if (!e->pops->rank_victim || !(cv = e->pops->choose_victim(e->pol, need, incoming, for_prefetch)))
        return SPW_ERR_OUT_OF_MEMORY;
    /* A policy that ranks not even its own victim places its room itself (plan's splits: the
     * upload goes where the buffer it replaces was): no run, the plain path below. */
    if (!e->pops->rank_victim(e->pol, cv, incoming, for_prefetch)) return SPW_ERR_OUT_OF_MEMORY;
    void *v[WINDOW_VICTIMS];
    window_ask w = {e, incoming, cv, for_prefetch};
    size_t n = spw__arena_window(a, need, s, rank_owner, &w, v, WINDOW_VICTIMS);
    if (!n) return SPW_ERR_OUT_OF_MEMORY;
    for (size_t i = 0; i < n; i++) {
        spw_status st = spw__res_evict_buf(ctx, v[i], false);
        if (st) return st;
    }
    spw__stat_event(&ctx->stats.window_evictions);
    return SPW_OK;
}

/* ---- a split's streamed buffers in a ring ---- */

#define RING_VICTIMS 64 /* at most this many evictions place one upload */

typedef struct ring_ask {
    struct spw_engine *e;
    spw_buf *incoming;
    int for_prefetch;
} ring_ask;

static int ring_accept(void *u, void *owner) {
    ring_ask *r = u;
    return r->e->pops->ring_victim(r->e->pol, owner, r->incoming, r->for_prefetch);
}

/* Place b's upload (`bytes`, arena a) at the ring's next run (spw__arena_next_run from ring_at)
 * and evict the buffers there, owing their waits (the caller set owe_waits). SPW_ERR_UNSUPPORTED
 * (no message): no run, the plain path places it. SPW_ERR_OUT_OF_MEMORY (no message): a
 * prefetch whose run holds a buffer of the ring not free yet (the prefetch waits). */
static spw_status ring_alloc(spw_ctx *ctx, spw_arena *a, spw_buf *b, size_t bytes, int for_prefetch,
                             spw_block **out, spw_arena_wait *w, int *nw) {
    struct spw_engine *e = ctx->engine;
    void *v[RING_VICTIMS];
    size_t k = 0;
    uintptr_t at = 0;
    ring_ask r = {e, b, for_prefetch};
    int found = spw__arena_next_run(a, e->ring_at, bytes, e->h2d, ring_accept, &r, v, RING_VICTIMS, &k, &at);
    if (found == -1 && for_prefetch) return SPW_ERR_OUT_OF_MEMORY;
    if (found != 1) return SPW_ERR_UNSUPPORTED;
    for (size_t i = 0; i < k; i++) {
        spw_status st = spw__res_evict_buf(ctx, v[i], false);
        if (st) return st;
    }
    spw_status st = spw__arena_alloc_at(a, at, bytes, e->h2d, out, w, nw);
    if (st == SPW_ERR_OUT_OF_MEMORY) return SPW_ERR_UNSUPPORTED; /* a victim's bytes went to another pool */
    if (st) return st;
    e->ring_at = at + spw__block_size(*out);
    spw__stat_event(&ctx->stats.ring_uploads);
    return SPW_OK;
}

/* spw__ctx_alloc_block_ordered, with trims refused in both arenas while it runs when `hint` (a
 * prefetch under prefetch_trim=off: room that only a trim, a wait for the device, would give is
 * declined; the demand load, later, may trim). */
static spw_status alloc_block(spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s, spw_block **out,
                              spw_arena_wait *w, int *nw, bool hint) {
    if (!hint) return spw__ctx_alloc_block_ordered(ctx, a, bytes, s, out, w, nw);
    spw__arena_allow_trim(ctx->small, false);
    spw__arena_allow_trim(ctx->large, false);
    spw_status st = spw__ctx_alloc_block_ordered(ctx, a, bytes, s, out, w, nw);
    spw__arena_allow_trim(ctx->small, true);
    spw__arena_allow_trim(ctx->large, true);
    return st;
}

/* Allocate `bytes` from arena a for stream s, evicting through the policy when allowed.
 * `tried`: the caller already made (and lost) one plain attempt. Returns SPW_ERR_OUT_OF_MEMORY
 * without a message when nothing more can be evicted. */
static spw_status alloc_evicting(spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s, spw_buf *incoming,
                                 int for_prefetch, bool may_evict, bool tried, spw_block **out, spw_arena_wait *w,
                                 int *nw) {
    if (ctx->cfg.on_exhaust == SPW_EXHAUST_FAIL) may_evict = false;
    size_t need = SPW_ALIGN_UP(bytes, 512);
    bool hint = for_prefetch && !ctx->cfg.prefetch_trim; /* a prefetch that may not trim */
    /* A block on the H2D stream (an upload, or one for another stream: make_resident) that would
     * need a trim takes its room in one piece instead, where it can. */
    struct spw_engine *e = ctx->engine;
    if (may_evict && !tried && e->streams_ok && s == e->h2d && !spw__arena_fits(a, bytes, s)) {
        spw_status st = evict_window(ctx, a, need, s, incoming, for_prefetch);
        /* the run may still not serve s (a victim's block freed on its own stream): then the
         * plain path below, which trims if it must */
        if (st == SPW_OK) st = alloc_block(ctx, a, bytes, s, out, w, nw, hint);
        if (st != SPW_ERR_OUT_OF_MEMORY) return st;
    }
    for (;;) {
        if (!tried && (obtainable(ctx) >= need || !may_evict)) {
            spw_status st = alloc_block(ctx, a, bytes, s, out, w, nw, hint);
            if (st != SPW_ERR_OUT_OF_MEMORY) return st;
            if (hint && obtainable(ctx) >= need) return SPW_ERR_OUT_OF_MEMORY;
        }
        tried = false;
        if (!may_evict) return SPW_ERR_OUT_OF_MEMORY;
        spw_status st = evict_next(ctx, need, incoming, for_prefetch);
        if (st == SPW_ERR_OUT_OF_MEMORY) {
            /* nothing left to evict: one last attempt if the budget might fit after all (not for a
             * prefetch that may not trim: its attempt above found no room without one) */
            return obtainable(ctx) >= need && !hint ? spw__ctx_alloc_block_ordered(ctx, a, bytes, s, out, w, nw)
                                           : SPW_ERR_OUT_OF_MEMORY;
        }
        if (st) return st;
    }
}

spw_status spw__engine_alloc_evicting(spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s, spw_block **out) {
    if (!ctx->engine) return SPW_ERR_OUT_OF_MEMORY;
    spw__res_collapse_poll(ctx);
    return alloc_evicting(ctx, a, bytes, s, NULL, 0, true, true, out, NULL, NULL);
}

/* Managed: room in the budget for b's bytes, then charge them. */
static spw_status managed_room(spw_ctx *ctx, spw_buf *b, int for_prefetch, bool may_evict) {
    if (ctx->cfg.on_exhaust == SPW_EXHAUST_FAIL) may_evict = false;
    while (!spw__ctx_can_hold(ctx, b->bytes)) {
        size_t got = 0, g2 = 0;
        spw_status st;
        if (ctx->stats.cached.current > 0) {
            if ((st = spw__arena_trim(ctx->small, SIZE_MAX, &got))) return st;
            if ((st = spw__arena_trim(ctx->large, SIZE_MAX, &g2))) return st;
            if (got + g2) continue;
        }
        if (!may_evict) return SPW_ERR_OUT_OF_MEMORY;
        if ((st = evict_next(ctx, b->bytes, b, for_prefetch))) return st;
    }
    managed_charge(ctx, b, 1);
    return SPW_OK;
}

/* Make b resident (not acquired). `upload`: bring the contents (else the device copy starts
 * undefined). `s`: the stream the block is for when there is no upload. On failure nothing
 * about b changed (other buffers may have been evicted, their contents intact). */
spw_status spw__res_make_resident(spw_ctx *ctx, spw_buf *b, bool upload, spw_stream s, int for_prefetch,
                                  bool may_evict) {
    struct spw_engine *e = ctx->engine;
    spw_status st;
    if (b->managed) {
        if ((st = managed_room(ctx, b, for_prefetch, may_evict))) return st;
        if (b->flags & SPW_BUF_READ_ONLY) replica_advise(ctx, b);
        if ((st = spw__copy_upload(ctx, b))) {
            managed_charge(ctx, b, -1);
            if (b->adv_rm) collapse_add(ctx, b); /* adv_rm => resident || collapsing */
            return st;
        }
        /* a pending collapse is cancelled: the replica, if still there, serves again (the
         * prefetch found it and moved nothing) */
        spw__res_collapse_unlink(e, b);
        b->dv = true;
        set_resident(ctx, b, true);
        return SPW_OK;
    }
    spw_stream as = upload ? e->h2d : s;
    spw_arena *a = b->bytes <= ctx->cfg.small_limit ? ctx->small : ctx->large;
    size_t want = b->bytes; /* the block asked for: the policy's slot where a block is a segment */
    if (a == ctx->large && e->pops->block_bytes && spw__arena_whole(a))
        want = SPW_MAX(want, e->pops->block_bytes(e->pol, b));
    /* A block for work on another stream that its cached blocks cannot serve without a trim
     * is taken as an upload's is, from the H2D stream's room (where release_block hands every
     * freed block, and where the room in one piece is found); s then waits for the H2D
     * stream's work so far by an event (spw__copy_order_dev at the acquire), which a trim
     * would make the host wait for. */
    bool via_h2d = !upload && e->streams_ok && s != e->h2d && !spw__arena_fits(a, want, s);
    if (via_h2d) as = e->h2d;
    spw_block *blk = NULL;
    /* An upload's victims are freed owing their waits (release_block) and the block comes with
     * the waits it owes, so that the upload can start on bytes no victim is still read from. */
    spw_arena_wait w[SPW_ARENA_OWED_MAX];
    int nw = 0;
    e->owe_waits = upload && e->streams_ok;
    st = SPW_ERR_UNSUPPORTED;
    /* the ring is the large arena's (its cursor, ring_at): spw__pol_ring says whether it runs */
    if (e->owe_waits && a == ctx->large && spw__pol_ring(ctx) && may_evict && ctx->cfg.on_exhaust == SPW_EXHAUST_EVICT &&
        e->pops->ring_member && e->pops->ring_member(e->pol, b))
        st = ring_alloc(ctx, a, b, want, for_prefetch, &blk, w, &nw);
    if (st == SPW_ERR_UNSUPPORTED)
        st = alloc_evicting(ctx, a, want, as, b, for_prefetch, may_evict, false, &blk, e->owe_waits ? w : NULL, &nw);
    e->owe_waits = false;
    if (st) return st;
    size_t size = spw__block_size(blk);
    spw__stat_add(&ctx->stats.live, (int64_t)size);
    spw__stat_add(&ctx->stats.cached, -(int64_t)size);
    spw__stat_add(&ctx->stats.requested, (int64_t)b->bytes);
    b->dblock = blk;
    spw__block_set_owner(blk, b);
    b->darena = a;
    b->dev = spw__block_ptr(blk);
    b->dev_s = as; /* via_h2d: an unrecorded touch on the H2D stream, which s is ordered after */
    b->dev_rec = false;
    b->dev_touched = true;
    if (upload && (st = spw__copy_upload_ordered(ctx, b, w, nw))) {
        for (int i = 0; i < nw; i++) spw__arena_owe(a, &w[i], e->h2d); /* those not enqueued, at least */
        release_block(ctx, b); /* on dev_s: after whatever part of the upload was enqueued */
        b->dev_rec = b->dev_touched = false;
        return st;
    }
    if (upload) spw__pf_watch(ctx, b); /* the worker may see the upload complete */
    settle_owed(ctx);
    b->dv = upload;
    set_resident(ctx, b, true);
    return SPW_OK;
}
