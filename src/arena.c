/*
 * The device arena: a best-fit caching allocator with a hard budget.
 *
 * Two modes share the block machinery:
 * - VMM: one large virtual address reservation, tiled by blocks that are HOLE (unmapped), FREE
 *   (mapped, cached) or LIVE. Physical pages are mapped only where FREE or LIVE blocks lie, so
 *   the bytes held track the bytes live: cached memory in the middle of the range can be returned
 *   page by page ("trimmed") without moving anything, and growth maps pages in place.
 *   Invariants: HOLE blocks start and end on page boundaries and cover only unmapped pages; every
 *   page that overlaps a FREE or LIVE block is mapped. No two HOLE blocks are adjacent.
 * - Segments (no VMM): memory comes from dev_alloc in segments tiled by FREE and LIVE blocks;
 *   a segment is returned when it is entirely free. With `whole` (the large arena) a block is
 *   its entire segment: never split, reused only by a request of the same size in pages. Every
 *   cached block is then a segment a trim can return, so blocks of different owners (PyTorch's
 *   segments, offloaded weights) never pin each other's cached memory; the cost is a fresh
 *   dev_alloc where another size is cached (the trim returns that one when the budget needs it).
 *
 * Stream order: every FREE and LIVE block belongs to a stream pool. A FREE block is reused at
 * once by its own stream; another stream may take it only after waiting on an event recorded
 * on the owner stream at the time of reuse (recorded then, after the free, so it orders every
 * earlier use). FREE blocks coalesce only within one pool. The hot path (a fit in the caller's
 * pool) makes no backend call.
 *
 * Owed waits (internal.h): bytes freed into a pool while another stream's work still reads them
 * carry the event that marks that work's end until the pool's stream waits on it. Everything
 * that could hand those bytes to anyone else enqueues the wait first; only
 * spw__arena_alloc_ordered passes it on, to a caller that orders its own use of the block.
 *
 * Trimming is in arena_trim.c, inspection and the invariant check in arena_inspect.c, the
 * structures they share in arena_impl.h. All functions here run under the owning context's lock.
 */
#include "arena_impl.h"

/* ---- small helpers ---- */

/* Next non-empty bin at index >= i, or -1. */
static int next_bin(const spool *p, int i) {
    if (i >= NBINS) return -1;
    int w = i / 64;
    uint64_t m = p->bitmap[w] & (~0ull << (i % 64));
    for (;;) {
        if (m) return w * 64 + __builtin_ctzll(m);
        if (++w >= NWORDS) return -1;
        m = p->bitmap[w];
    }
}

/* Smallest FREE block of p with size >= n (best fit; within a crowded bin, best of SCAN_LIMIT). */
static spw_block *pool_best_fit(const spool *p, size_t n) {
    int i = bin_of(n);
    spw_block *best = NULL;
    int seen = 0;
    for (spw_block *b = p->bins[i]; b && seen < SCAN_LIMIT; b = b->fnext, seen++) {
        if (b->size >= n && (!best || b->size < best->size)) {
            best = b;
            if (b->size == n) return b;
        }
    }
    if (best) return best;
    i = next_bin(p, i + 1);
    if (i < 0) return NULL;
    seen = 0;
    for (spw_block *b = p->bins[i]; b && seen < SCAN_LIMIT; b = b->fnext, seen++)
        if (!best || b->size < best->size) best = b;
    return best;
}

static spool *pool_get(spw_arena *a, spw_stream s, bool create) {
    if (SPW_LIKELY(a->last_pool && a->last_pool->stream == s)) return a->last_pool;
    for (size_t i = 0; i < a->npools; i++) {
        if (a->pools[i]->stream == s) {
            if (create) a->pools[i]->retired = false; /* a new stream got the old handle */
            return a->last_pool = a->pools[i];
        }
    }
    if (!create) return NULL;
    if (a->npools == a->cap_pools) {
        size_t cap = a->cap_pools ? a->cap_pools * 2 : 4;
        spool **np = realloc(a->pools, cap * sizeof *np);
        if (!np) return NULL;
        a->pools = np;
        a->cap_pools = cap;
    }
    spool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->stream = s;
    a->pools[a->npools++] = p;
    return a->last_pool = p;
}

/* ---- block surgery ---- */

/* Turn a FREE block (already out of its bin) into the caller's LIVE block of n bytes; the tail,
 * if any, goes back to the bins of pool p as FREE. On host allocation failure of the split the
 * whole block is handed out (a little waste, never a failure). */
static void carve(spw_arena *a, spw_block *b, size_t n, spool *p) {
    b->pool = p;
    b->state = B_LIVE;
    b->owner = NULL;
    if (!a->p.whole && b->size - n >= ROUND) {
        spw_block *t = split_tail(a, b, n, B_FREE, NULL);
        if (t) {
            /* the tail may now touch a FREE neighbour of the same pool */
            if (t->next && t->next->state == B_FREE && t->next->pool == p) {
                bin_remove(p, t->next);
                absorb_next(a, t);
            }
            bin_insert(p, t);
        }
    }
}

/* Insert a FREE block into pool p, coalescing with FREE neighbours of the same pool. */
static spw_block *free_coalesce(spw_arena *a, spw_block *b, spool *p) {
    b->state = B_FREE;
    b->owner = NULL;
    b->pool = p;
    if (b->next && b->next->state == B_FREE && b->next->pool == p) {
        bin_remove(p, b->next);
        absorb_next(a, b);
    }
    if (b->prev && b->prev->state == B_FREE && b->prev->pool == p) {
        spw_block *pr = b->prev;
        bin_remove(p, pr);
        absorb_next(a, pr);
        b = pr;
    }
    bin_insert(p, b);
    return b;
}

/* ---- creation ---- */

spw_status spw__arena_create(const spw_arena_params *p, spw_arena **out) {
    spw_arena *a = calloc(1, sizeof *a);
    if (!a) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    a->p = *p;
    a->be = p->backend;
    if (!a->p.page) a->p.page = 2 * SPW_MiB;
    if (p->vmm) {
        size_t reserve = SPW_ALIGN_UP(p->reserve_bytes, a->p.page);
        void *va = NULL;
        spw_status st = a->be->ops->va_reserve(a->be, reserve, a->p.page, &va);
        if (st) {
            free(a);
            return spw__error_prefix(st, "arena '%s': reserving %zu B of address space", p->name, reserve);
        }
        seg *s = calloc(1, sizeof *s);
        spw_block *h = calloc(1, sizeof *h);
        if (!s || !h) {
            free(s);
            free(h);
            a->be->ops->va_release(a->be, va, reserve);
            free(a);
            return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
        }
        s->base = (uintptr_t)va;
        s->size = reserve;
        s->first = h;
        h->addr = s->base;
        h->size = reserve;
        h->seg = s;
        hole_insert(a, h);
        a->segs = s;
        spw__stat_add(a->p.acct.segments, 1);
    }
    *out = a;
    return SPW_OK;
}

bool spw__arena_whole(const spw_arena *a) { return a->p.whole; }

bool spw__arena_pages(const spw_arena *a) { return a->p.vmm; }

void spw__arena_destroy(spw_arena *a) {
    if (!a) return;
    for (seg *s = a->segs, *sn; s; s = sn) {
        sn = s->next;
        /* unmap each page once: a page shared with the previous mapped block went with it */
        uintptr_t unmapped_to = s->base;
        for (spw_block *b = s->first, *bn; b; b = bn) {
            bn = b->next;
            if (a->p.vmm && b->state != B_HOLE) {
                uintptr_t r0 = SPW_MAX(page_floor(a, b->addr), unmapped_to);
                uintptr_t r1 = page_ceil(a, b->addr + b->size);
                if (r1 > r0) {
                    a->be->ops->unmap(a->be, (void *)r0, r1 - r0);
                    unmapped_to = r1;
                }
            }
            free(b);
        }
        if (a->p.vmm) a->be->ops->va_release(a->be, (void *)s->base, s->size);
        else a->be->ops->dev_free(a->be, (void *)s->base);
        free(s);
    }
    for (size_t i = 0; i < a->npools; i++) {
        if (a->pools[i]->ev) a->be->ops->event_destroy(a->be, a->pools[i]->ev);
        free(a->pools[i]);
    }
    free(a->pools);
    free(a->ranks);
    for (spw_block *b = a->spare, *bn; b; b = bn) {
        bn = b->fnext;
        free(b);
    }
    free(a);
}

/* ---- owed waits ---- */

/* Bytes of [lo, hi) that pool p owes a wait on. */
static size_t owed_in(const spw_arena *a, const spool *p, uintptr_t lo, uintptr_t hi) {
    size_t n = 0;
    for (int i = 0; i < a->nowed; i++) {
        const owed *o = &a->owed[i];
        uintptr_t l = SPW_MAX(lo, o->lo), h = SPW_MIN(hi, o->hi);
        if (o->pool == p && h > l) n += h - l;
    }
    return n;
}

/* Remember that stream s's pool owes a wait on ev for [lo, hi); false (nothing done) when the
 * table is full or the pool cannot be had. */
static bool owed_add(spw_arena *a, spw_stream s, uintptr_t lo, uintptr_t hi, spw_event ev) {
    spool *p = a->nowed < SPW_ARENA_OWED_MAX ? pool_get(a, s, true) : NULL;
    if (p) a->owed[a->nowed++] = (owed){lo, hi, ev, p};
    return p != NULL;
}

static void owed_drop(spw_arena *a, int i) { a->owed[i] = a->owed[--a->nowed]; }

/* Enqueue owed wait i (on the host where the stream wait fails, or where the stream is gone)
 * and drop it. On failure it stays owed. */
static spw_status settle_one(spw_arena *a, int i) {
    owed *o = &a->owed[i];
    spw_status st = o->pool->retired ? a->be->ops->event_sync(a->be, o->ev)
                                     : spw__backend_order_after(a->be, o->pool->stream, o->ev);
    if (st) return st;
    owed_drop(a, i);
    return SPW_OK;
}

spw_status spw__arena_settle(spw_arena *a) {
    for (int i = a->nowed; i-- > 0;) {
        spw_status st = settle_one(a, i);
        if (st) return st;
    }
    return SPW_OK;
}

void spw__arena_forget_event(spw_arena *a, spw_event ev) {
    for (int i = a->nowed; i-- > 0;)
        if (a->owed[i].ev == ev) owed_drop(a, i);
}

spw_status spw__arena_free_after(spw_arena *a, spw_block *b, spw_stream s, spw_event ev) {
    if (!owed_add(a, s, b->addr, b->addr + b->size, ev)) return SPW_ERR_UNSUPPORTED;
    free_coalesce(a, b, a->owed[a->nowed - 1].pool);
    return SPW_OK;
}

void spw__arena_owe(spw_arena *a, const spw_arena_wait *w, spw_stream s) {
    if (!owed_add(a, s, w->lo, w->hi, w->ev)) a->be->ops->event_sync(a->be, w->ev); /* wait now */
}

/* ---- cache reuse ---- */

/* Take a FREE block of another stream's pool for stream p: order p's stream after the owner's
 * work by an event, without blocking the host. */
static spw_status adopt_cross_stream(spw_arena *a, spool *owner, spool *p) {
    if (owner->retired) return SPW_OK; /* its stream finished everything before it was destroyed */
    if (!owner->ev) {
        spw_status st = a->be->ops->event_create(a->be, &owner->ev);
        if (st) return st;
    }
    spw_status st = a->be->ops->event_record(a->be, owner->ev, owner->stream);
    if (st) return st;
    st = a->be->ops->stream_wait(a->be, p->stream, owner->ev);
    if (st) return st;
    spw__stat_event(a->p.acct.cross_stream_waits);
    return SPW_OK;
}

/* The segment a request of n bytes gets (non-VMM). */
static size_t segment_size(const spw_arena *a, size_t n) {
    return SPW_ALIGN_UP(SPW_MAX(n, a->p.min_segment), a->p.page);
}

/* The cached block of p that serves n: the best fit, or with whole segments a block of exactly
 * the segment size n would get. */
static spw_block *pool_fit(const spw_arena *a, const spool *p, size_t n) {
    if (!a->p.whole) return pool_best_fit(p, n);
    size_t want = segment_size(a, n);
    for (spw_block *b = p->bins[bin_of(want)]; b; b = b->fnext)
        if (b->size == want) return b;
    return NULL;
}

static spw_block *take_cached(spw_arena *a, spool *p, size_t n) {
    spw_block *b = pool_fit(a, p, n);
    if (SPW_LIKELY(b)) {
        bin_remove(p, b);
        carve(a, b, n, p);
        return b;
    }
    spool *owner = NULL;
    for (size_t i = 0; i < a->npools; i++) {
        spool *q = a->pools[i];
        if (q == p) continue;
        spw_block *c = pool_fit(a, q, n);
        if (c && (!b || c->size < b->size)) {
            b = c;
            owner = q;
        }
    }
    if (!b || adopt_cross_stream(a, owner, p)) return NULL;
    bin_remove(owner, b);
    carve(a, b, n, p);
    return b;
}

/* ---- growth ---- */

/* VMM placement: the hole (with FREE neighbours of pool p merged in) that needs the fewest new
 * pages for n bytes, ties broken by the smallest span. */
typedef struct placement {
    spw_block *hole, *left, *right;
    uintptr_t start;
    size_t map_bytes;
} placement;

static bool place_vmm(spw_arena *a, spool *p, size_t n, placement *out) {
    bool found = false;
    size_t best_span = 0;
    for (spw_block *h = a->holes; h; h = h->fnext) {
        spw_block *l = (h->prev && h->prev->state == B_FREE && h->prev->pool == p) ? h->prev : NULL;
        spw_block *r = (h->next && h->next->state == B_FREE && h->next->pool == p) ? h->next : NULL;
        uintptr_t start = l ? l->addr : h->addr;
        uintptr_t end = r ? r->addr + r->size : h->addr + h->size;
        if (end - start < n) continue;
        uintptr_t need_end = SPW_MIN(start + n, h->addr + h->size);
        size_t map = need_end > h->addr ? page_ceil(a, need_end) - h->addr : 0;
        size_t span = end - start;
        if (!found || map < out->map_bytes || (map == out->map_bytes && span < best_span)) {
            *out = (placement){h, l, r, start, map};
            best_span = span;
            found = true;
        }
    }
    return found;
}

/* Map the placement's pages and hand out [start, start+n) as LIVE in pool p. */
static spw_status grow_vmm(spw_arena *a, spool *p, size_t n, const placement *pl, spw_block **out) {
    spw_block *h = pl->hole;
    spw_block *rest = NULL;
    if (pl->map_bytes < h->size) {
        rest = block_new(a); /* prepare first so that nothing fails after the map */
        if (!rest) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    }
    if (pl->map_bytes) {
        spw_status st = a->be->ops->map(a->be, (void *)h->addr, pl->map_bytes);
        if (st) {
            if (rest) block_put(a, rest);
            return st;
        }
        account_held(a, (int64_t)pl->map_bytes);
    }
    hole_remove(a, h);
    if (rest) {
        /* the unmapped remainder stays a hole */
        rest->addr = h->addr + pl->map_bytes;
        rest->size = h->size - pl->map_bytes;
        rest->seg = h->seg;
        rest->prev = h;
        rest->next = h->next;
        if (h->next) h->next->prev = rest;
        h->next = rest;
        h->size = pl->map_bytes;
        hole_insert(a, rest);
    }
    h->state = B_FREE;
    h->pool = p;
    spw_block *b = h;
    if (pl->left) {
        bin_remove(p, pl->left);
        absorb_next(a, pl->left);
        b = pl->left;
    }
    if (!rest && pl->right) {
        bin_remove(p, pl->right);
        absorb_next(a, b);
    }
    carve(a, b, n, p);
    *out = b;
    return SPW_OK;
}

static spw_status grow_segment(spw_arena *a, spool *p, size_t n, spw_block **out) {
    size_t size = segment_size(a, n);
    if (!can_hold(a, size)) return SPW_ERR_OUT_OF_MEMORY;
    seg *s = calloc(1, sizeof *s);
    spw_block *b = block_new(a);
    if (!s || !b) {
        free(s);
        if (b) block_put(a, b);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    }
    void *ptr = NULL;
    spw_status st = a->be->ops->dev_alloc(a->be, size, &ptr);
    if (st) {
        free(s);
        block_put(a, b);
        return st;
    }
    s->base = (uintptr_t)ptr;
    s->size = size;
    s->first = b;
    s->next = a->segs;
    if (a->segs) a->segs->prev = s;
    a->segs = s;
    b->addr = s->base;
    b->size = size;
    b->seg = s;
    account_held(a, (int64_t)size);
    spw__stat_add(a->p.acct.segments, 1);
    carve(a, b, n, p);
    *out = b;
    return SPW_OK;
}

/* Bytes the growth for n would map, or 0 if no placement exists (VMM). */
static spw_status grow(spw_arena *a, spool *p, size_t n, spw_block **out) {
    if (!a->p.vmm) return grow_segment(a, p, n, out);
    placement pl;
    if (!place_vmm(a, p, n, &pl)) return SPW_ERR_OUT_OF_MEMORY; /* address space exhausted */
    if (!can_hold(a, pl.map_bytes)) return SPW_ERR_OUT_OF_MEMORY;
    /* Map a little ahead: a growing working set then costs fewer backend calls. The extra is
     * bounded by a fraction of what is held, so it adds at most that fraction to the peak. */
    size_t ahead = SPW_ALIGN_DOWN((size_t)((double)a->held * a->p.grow_ahead), a->p.page);
    size_t room = pl.hole->size - pl.map_bytes;
    ahead = SPW_MIN(ahead, room);
    if (ahead && can_hold(a, pl.map_bytes + ahead)) pl.map_bytes += ahead;
    return grow_vmm(a, p, n, &pl, out);
}

spw_status spw__arena_map_free(spw_arena *a, size_t bytes, spw_stream s) {
    size_t n = SPW_ALIGN_DOWN(bytes, a->p.page);
    if (!a->p.vmm || !n) return SPW_OK;
    spool *p = pool_get(a, s, true);
    if (!p) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    placement pl;
    if (!place_vmm(a, p, n, &pl) || !can_hold(a, pl.map_bytes)) return SPW_OK;
    spw_block *b;
    spw_status st = grow_vmm(a, p, n, &pl, &b);
    if (st) return st;
    free_coalesce(a, b, p);
    return SPW_OK;
}

bool spw__arena_fits(spw_arena *a, size_t bytes, spw_stream s) {
    size_t n = SPW_ALIGN_UP(bytes, ROUND);
    for (size_t i = 0; i < a->npools; i++)
        if (pool_fit(a, a->pools[i], n)) return true;
    if (!a->p.vmm) return can_hold(a, segment_size(a, n));
    spool *p = pool_get(a, s, false); /* NULL (no pool yet): only holes can serve */
    placement pl;
    return place_vmm(a, p, n, &pl) && can_hold(a, pl.map_bytes);
}

/* Would mapping `more` bytes leave more cached memory than the fragmentation slack allows? */
static bool over_slack(spw_arena *a, size_t n, size_t more) {
    const spw_arena_acct *ac = &a->p.acct;
    double target = (double)(ac->live->current + (int64_t)n) * (1.0 + a->p.frag_slack);
    return (double)(ac->held->current + (int64_t)more) > target + (double)a->p.page;
}

spw_status spw__arena_alloc(spw_arena *a, size_t bytes, spw_stream s, spw_block **out) {
    size_t n = SPW_ALIGN_UP(bytes, ROUND);
    spool *p = pool_get(a, s, true);
    if (!p) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    if (SPW_UNLIKELY(a->nowed)) {
        spw_status st = spw__arena_settle(a);
        if (st) return st;
    }
    spw_block *b = take_cached(a, p, n);
    if (SPW_LIKELY(b)) {
        *out = b;
        return SPW_OK;
    }
    /* Growth. Keep held close to live: if the new pages would push cached memory past the
     * slack, return cached pages elsewhere first (their holes may also give a better place). */
    if (a->p.vmm) {
        placement pl;
        if (place_vmm(a, p, n, &pl) && pl.map_bytes && over_slack(a, n, pl.map_bytes)) {
            size_t got = 0;
            spw_status st = spw__arena_trim(a, pl.map_bytes, &got);
            if (st) return st;
        }
    }
    spw_status st = grow(a, p, n, out);
    if (st != SPW_ERR_OUT_OF_MEMORY) return st;
    /* At the budget (or the device's limit): release all cached memory and try once more. */
    size_t got = 0;
    spw_status tst = spw__arena_trim(a, SIZE_MAX, &got);
    if (tst) return tst;
    if (!got) return SPW_ERR_OUT_OF_MEMORY;
    return grow(a, p, n, out);
}

/* VMM, b FREE and out of its bins, owing waits on all its bytes: map pages of the hole after it
 * (up to n bytes, within the budget) into it, so that a block of n can start beyond what is owed.
 * Best effort: nothing changes when no page can be had. */
static void extend_right(spw_arena *a, spw_block *b, size_t n) {
    spw_block *h = b->next;
    if (!h || h->state != B_HOLE || !can_hold(a, a->p.page)) return;
    size_t ext = SPW_ALIGN_DOWN(SPW_MIN(h->size, n), a->p.page);
    while (ext && !can_hold(a, ext)) ext -= a->p.page;
    if (!ext) return;
    if (a->be->ops->map(a->be, (void *)h->addr, ext)) {
        spw__error_clear();
        return;
    }
    account_held(a, (int64_t)ext);
    b->size += ext;
    if (ext < h->size) {
        h->addr += ext;
        h->size -= ext;
        return;
    }
    hole_remove(a, h);
    b->next = h->next;
    if (h->next) h->next->prev = b;
    block_put(a, h);
}

/* carve, from whichever end of b owes pool p fewer waits. */
static spw_block *carve_least_owed(spw_arena *a, spw_block *b, size_t n, spool *p) {
    uintptr_t end = b->addr + b->size;
    spw_block *t = NULL;
    if (!a->p.whole && b->size - n >= ROUND && owed_in(a, p, end - n, end) < owed_in(a, p, b->addr, b->addr + n))
        t = split_tail(a, b, b->size - n, B_LIVE, NULL);
    if (!t) {
        carve(a, b, n, p);
        return b;
    }
    /* b (the head) stays FREE; its left neighbour is not FREE in p, or they would be one */
    b->state = B_FREE;
    bin_insert(p, b);
    return t;
}

/* Enqueue the waits owed by pools other than p: only p's own can be passed on to a caller. */
static spw_status settle_others(spw_arena *a, const spool *p) {
    for (int i = a->nowed; i-- > 0;) {
        spw_status st = a->owed[i].pool != p ? settle_one(a, i) : SPW_OK;
        if (st) return st;
    }
    return SPW_OK;
}

/* Hand p's waits owed on live block b's bytes to the caller (w, *nw: clipped to b), dropping
 * those wholly passed on. */
static void pass_owed(spw_arena *a, const spool *p, const spw_block *b, spw_arena_wait *w, int *nw) {
    uintptr_t lo = b->addr, hi = b->addr + b->size;
    for (int i = a->nowed; i-- > 0;) {
        owed *o = &a->owed[i];
        if (o->pool != p || o->hi <= lo || o->lo >= hi) continue;
        w[(*nw)++] = (spw_arena_wait){SPW_MAX(lo, o->lo), SPW_MIN(hi, o->hi), o->ev};
        if (o->lo >= lo && o->hi <= hi) owed_drop(a, i);
    }
}

spw_status spw__arena_alloc_ordered(spw_arena *a, size_t bytes, spw_stream s, spw_block **out,
                                    spw_arena_wait w[SPW_ARENA_OWED_MAX], int *nw) {
    *nw = 0;
    size_t n = SPW_ALIGN_UP(bytes, ROUND);
    spool *p = pool_get(a, s, true);
    if (!p) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    spw_status st = settle_others(a, p);
    if (st) return st;
    spw_block *b = a->nowed ? pool_fit(a, p, n) : NULL;
    if (!b) return spw__arena_alloc(a, bytes, s, out);
    bin_remove(p, b);
    if (a->p.vmm && owed_in(a, p, b->addr, b->addr + b->size) >= b->size) extend_right(a, b, n);
    b = carve_least_owed(a, b, n, p);
    pass_owed(a, p, b, w, nw);
    *out = b;
    return SPW_OK;
}

spw_status spw__arena_alloc_at(spw_arena *a, uintptr_t addr, size_t bytes, spw_stream s, spw_block **out,
                               spw_arena_wait w[SPW_ARENA_OWED_MAX], int *nw) {
    *nw = 0;
    size_t n = SPW_ALIGN_UP(bytes, ROUND);
    spool *p = pool_get(a, s, false);
    if (!a->p.vmm || !a->segs || !p || addr % ROUND) return SPW_ERR_OUT_OF_MEMORY;
    spw_block *b = block_from(a, addr);
    if (!b || b->state != B_FREE || b->pool != p || b->addr + b->size < addr + n) return SPW_ERR_OUT_OF_MEMORY;
    spw_status st = settle_others(a, p);
    if (st) return st;
    bin_remove(p, b);
    if (addr > b->addr) { /* the bytes before addr stay cached */
        spw_block *t = split_tail(a, b, addr - b->addr, B_FREE, NULL);
        bin_insert(p, b);
        if (!t) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
        b = t;
    }
    carve(a, b, n, p);
    pass_owed(a, p, b, w, nw);
    *out = b;
    return SPW_OK;
}

void spw__arena_free(spw_arena *a, spw_block *b, spw_stream s) {
    spool *p = b->pool;
    if (SPW_UNLIKELY(p->stream != s)) {
        spool *q = pool_get(a, s, true);
        if (q) p = q; /* else keep it in the allocating stream's pool: still ordered there */
    }
    free_coalesce(a, b, p);
}

spw_status spw__arena_retire_stream(spw_arena *a, spw_stream s) {
    spool *p = pool_get(a, s, false);
    if (!p || !s) return SPW_OK;
    spool *dflt = pool_get(a, NULL, true);
    if (!dflt) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    /* The caller synchronized s; bytes it still owes a wait wait for it on the host. Then its
     * free blocks are idle and may serve any stream. */
    for (int i = a->nowed; i-- > 0;) {
        if (a->owed[i].pool != p) continue;
        spw_status st = a->be->ops->event_sync(a->be, a->owed[i].ev);
        if (st) return st;
        owed_drop(a, i);
    }
    for (int i = 0; i < NBINS; i++) {
        while (p->bins[i]) {
            spw_block *b = p->bins[i];
            bin_remove(p, b);
            free_coalesce(a, b, dflt);
        }
    }
    if (p->ev) {
        a->be->ops->event_destroy(a->be, p->ev);
        p->ev = NULL;
    }
    p->retired = true;
    if (a->last_pool == p) a->last_pool = NULL;
    return SPW_OK;
}
