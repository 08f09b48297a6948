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
 * All functions here run under the owning context's lock.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ROUND 512u   /* allocation granularity and alignment */
#define SL_BITS 4    /* 16 sub-bins per power of two: fit within 1/16 */
#define NBINS (16 + 40 * 16)
#define NWORDS ((NBINS + 63) / 64)
#define SCAN_LIMIT 64 /* blocks examined in one bin before taking the best seen */

typedef enum { B_HOLE, B_FREE, B_LIVE } bstate;

typedef struct spool spool;

struct spw_block {
    uintptr_t addr;
    size_t size;
    spw_block *prev, *next;   /* address order, within the segment */
    spw_block *fprev, *fnext; /* bin list (FREE) or hole list (HOLE) */
    struct seg *seg;
    spool *pool;
    int bin;
    bstate state;
};

/* One stream's free blocks, binned by size. */
struct spool {
    spw_stream stream;
    bool retired;       /* the stream was destroyed: nothing to synchronize or wait on */
    spw_event ev;       /* for cross-stream reuse; created on first need */
    uint64_t bitmap[NWORDS];
    spw_block *bins[NBINS];
};

/* A wait pool `pool` owes on ev before touching [lo, hi). */
typedef struct owed {
    uintptr_t lo, hi;
    spw_event ev;
    spool *pool;
} owed;

typedef struct seg {
    uintptr_t base;
    size_t size;
    spw_block *first;
    struct seg *prev, *next;
} seg;

struct spw_arena {
    spw_arena_params p;
    spw_backend *be;
    struct spw_ctx *ctx;
    seg *segs;          /* VMM: exactly one (the reservation) */
    spw_block *holes;   /* VMM: HOLE blocks */
    spool **pools;
    size_t npools, cap_pools;
    spool *last_pool;
    spw_block *spare;   /* recycled block structs */
    size_t held;        /* bytes mapped or allocated from the backend by this arena */
    owed owed[SPW_ARENA_OWED_MAX];
    int nowed;
};

/* ---- small helpers ---- */

static inline int bin_of(size_t size) {
    size_t u = size / ROUND;
    if (u < 16) return (int)u;
    int fl = 63 - __builtin_clzll((unsigned long long)u);
    int sl = (int)((u >> (fl - SL_BITS)) & 15);
    int b = 16 + (fl - SL_BITS) * 16 + sl;
    return b < NBINS ? b : NBINS - 1;
}

static spw_block *block_new(spw_arena *a) {
    spw_block *b = a->spare;
    if (b) a->spare = b->fnext;
    else b = malloc(sizeof *b);
    if (b) memset(b, 0, sizeof *b);
    return b;
}

static void block_put(spw_arena *a, spw_block *b) {
    b->fnext = a->spare;
    a->spare = b;
}

static void bin_insert(spool *p, spw_block *b) {
    int i = bin_of(b->size);
    b->bin = i;
    b->fprev = NULL;
    b->fnext = p->bins[i];
    if (b->fnext) b->fnext->fprev = b;
    p->bins[i] = b;
    p->bitmap[i / 64] |= 1ull << (i % 64);
}

static void bin_remove(spool *p, spw_block *b) {
    int i = b->bin;
    if (b->fprev) b->fprev->fnext = b->fnext;
    else p->bins[i] = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    if (!p->bins[i]) p->bitmap[i / 64] &= ~(1ull << (i % 64));
    b->fprev = b->fnext = NULL;
}

static void hole_insert(spw_arena *a, spw_block *b) {
    b->state = B_HOLE;
    b->pool = NULL;
    b->fprev = NULL;
    b->fnext = a->holes;
    if (a->holes) a->holes->fprev = b;
    a->holes = b;
}

static void hole_remove(spw_arena *a, spw_block *b) {
    if (b->fprev) b->fprev->fnext = b->fnext;
    else a->holes = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    b->fprev = b->fnext = NULL;
}

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

static inline size_t page_floor(const spw_arena *a, uintptr_t x) { return SPW_ALIGN_DOWN(x, a->p.page); }
static inline size_t page_ceil(const spw_arena *a, uintptr_t x) { return SPW_ALIGN_UP(x, a->p.page); }

/* ---- accounting against the context ---- */

static void account_held(spw_arena *a, int64_t delta) {
    a->held = (size_t)((int64_t)a->held + delta);
    spw__stat_add(&a->ctx->stats.held, delta);
    spw__stat_add(&a->ctx->stats.cached, delta);
    if (delta > 0) spw__stat_event(&a->ctx->stats.backend_allocs);
    else spw__stat_event(&a->ctx->stats.backend_frees);
}

/* ---- block surgery ---- */

/* Split b so that it keeps its first n bytes; the rest goes into t (or a new block when t is
 * NULL), state st, same pool, returned out of any list. NULL on host allocation failure (b
 * unchanged). */
static spw_block *split_tail(spw_arena *a, spw_block *b, size_t n, bstate st, spw_block *t) {
    if (!t) t = block_new(a);
    if (!t) return NULL;
    t->addr = b->addr + n;
    t->size = b->size - n;
    t->seg = b->seg;
    t->pool = b->pool;
    t->state = st;
    t->prev = b;
    t->next = b->next;
    if (b->next) b->next->prev = t;
    b->next = t;
    b->size = n;
    return t;
}

/* Merge b->next into b (both out of any list); frees b->next's struct. */
static void absorb_next(spw_arena *a, spw_block *b) {
    spw_block *n = b->next;
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    block_put(a, n);
}

/* Turn a FREE block (already out of its bin) into the caller's LIVE block of n bytes; the tail,
 * if any, goes back to the bins of pool p as FREE. On host allocation failure of the split the
 * whole block is handed out (a little waste, never a failure). */
static void carve(spw_arena *a, spw_block *b, size_t n, spool *p) {
    b->pool = p;
    b->state = B_LIVE;
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
    a->ctx = p->ctx;
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
        spw__stat_add(&a->ctx->stats.segments, 1);
    }
    *out = a;
    return SPW_OK;
}

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

/* Enqueue owed wait i (on the host where the stream wait fails, or where the stream is gone)
 * and drop it. On failure it stays owed. */
static spw_status settle_one(spw_arena *a, int i) {
    owed *o = &a->owed[i];
    spw_status st = o->pool->retired ? SPW_ERR_STATE : a->be->ops->stream_wait(a->be, o->pool->stream, o->ev);
    if (st && (st = a->be->ops->event_sync(a->be, o->ev))) return st;
    a->owed[i] = a->owed[--a->nowed];
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
        if (a->owed[i].ev == ev) a->owed[i] = a->owed[--a->nowed];
}

spw_status spw__arena_free_after(spw_arena *a, spw_block *b, spw_stream s, spw_event ev) {
    spool *p = a->nowed < SPW_ARENA_OWED_MAX ? pool_get(a, s, true) : NULL;
    if (!p) return SPW_ERR_UNSUPPORTED;
    a->owed[a->nowed++] = (owed){b->addr, b->addr + b->size, ev, p};
    free_coalesce(a, b, p);
    return SPW_OK;
}

void spw__arena_owe(spw_arena *a, const spw_arena_wait *w, spw_stream s) {
    spool *p = a->nowed < SPW_ARENA_OWED_MAX ? pool_get(a, s, true) : NULL;
    if (p) a->owed[a->nowed++] = (owed){w->lo, w->hi, w->ev, p};
    else a->be->ops->event_sync(a->be, w->ev); /* no room to remember it: wait now */
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
    spw__stat_event(&a->ctx->stats.cross_stream_waits);
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

/* ---- trimming: return cached memory ---- */

static spw_status sync_pool(spw_arena *a, spool *p) {
    return p->retired ? SPW_OK : a->be->ops->stream_sync(a->be, p->stream);
}

/* VMM: unmap the whole pages inside FREE block b that no other block touches. The block
 * structs needed are taken before the unmap so that nothing can fail after it. */
static spw_status trim_block_vmm(spw_arena *a, spw_block *b, size_t *released) {
    uintptr_t r0 = page_ceil(a, b->addr), r1 = page_floor(a, b->addr + b->size);
    if (r1 <= r0) return SPW_OK;
    spw_block *s1 = block_new(a), *s2 = s1 ? block_new(a) : NULL;
    if (!s2) {
        if (s1) block_put(a, s1);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena trim: out of host memory");
    }
    spw_status st = a->be->ops->unmap(a->be, (void *)r0, r1 - r0);
    if (st) {
        block_put(a, s1);
        block_put(a, s2);
        return st;
    }
    spool *p = b->pool;
    bin_remove(p, b);
    /* b becomes [addr, r0) FREE, [r0, r1) HOLE, [r1, end) FREE; head and tail may be empty */
    spw_block *mid = b;
    if (r0 > b->addr) {
        mid = split_tail(a, b, r0 - b->addr, B_HOLE, s1);
        s1 = NULL;
        bin_insert(p, b);
    }
    if (mid->addr + mid->size > r1) {
        spw_block *tail = split_tail(a, mid, r1 - mid->addr, B_FREE, s2);
        s2 = NULL;
        bin_insert(p, tail);
    }
    if (s1) block_put(a, s1);
    if (s2) block_put(a, s2);
    if (mid->next && mid->next->state == B_HOLE) {
        hole_remove(a, mid->next);
        absorb_next(a, mid);
    }
    if (mid->prev && mid->prev->state == B_HOLE) {
        spw_block *pr = mid->prev;
        hole_remove(a, pr);
        absorb_next(a, pr);
        mid = pr;
    }
    hole_insert(a, mid);
    account_held(a, -(int64_t)(r1 - r0));
    *released += r1 - r0;
    return SPW_OK;
}

typedef struct trim_cand {
    spw_block *b;
    size_t gain;
} trim_cand;

static int cand_cmp(const void *x, const void *y) {
    const trim_cand *a = x, *b = y;
    return a->gain < b->gain ? 1 : a->gain > b->gain ? -1 : 0;
}

/* After every stream is synchronized, no FREE block has pending work: FREE neighbours of
 * different pools can merge (into the left one's pool), so the pages they share can go too. */
static void merge_idle_pools(spw_arena *a) {
    for (seg *s = a->segs; s; s = s->next) {
        for (spw_block *b = s->first; b; b = b->next) {
            while (b->state == B_FREE && b->next && b->next->state == B_FREE) {
                bin_remove(b->pool, b);
                bin_remove(b->next->pool, b->next);
                absorb_next(a, b);
                bin_insert(b->pool, b);
            }
        }
    }
}

static size_t trim_gain(const spw_arena *a, const seg *s, const spw_block *b) {
    if (!a->p.vmm) return (b == s->first && !b->next) ? s->size : 0;
    uintptr_t r0 = page_ceil(a, b->addr), r1 = page_floor(a, b->addr + b->size);
    return r1 > r0 ? r1 - r0 : 0;
}

spw_status spw__arena_trim(spw_arena *a, size_t want, size_t *released) {
    size_t got = 0;
    spw_status st = SPW_OK;
    if (released) *released = 0;
    if (a->nowed && (st = spw__arena_settle(a))) return st; /* before the syncs that make blocks idle */
    bool any = false;
    for (seg *s = a->segs; s && !any; s = s->next)
        for (spw_block *b = s->first; b && !any; b = b->next) any = b->state == B_FREE;
    if (!any) return SPW_OK;
    /* queued work may still touch free blocks: wait for every stream of this arena once */
    for (size_t k = 0; k < a->npools; k++)
        if ((st = sync_pool(a, a->pools[k]))) return st;
    spw__stat_event(&a->ctx->stats.trim_syncs);
    merge_idle_pools(a);
    /* candidates: FREE blocks (VMM) or wholly free segments, largest gain first */
    size_t n = 0, cap = 64;
    trim_cand *c = malloc(cap * sizeof *c);
    if (!c) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena trim: out of host memory");
    for (seg *s = a->segs; s; s = s->next) {
        for (spw_block *b = s->first; b; b = b->next) {
            size_t gain = b->state == B_FREE ? trim_gain(a, s, b) : 0;
            if (!gain) continue;
            if (n == cap) {
                trim_cand *nc = realloc(c, 2 * cap * sizeof *c);
                if (!nc) break;
                c = nc;
                cap *= 2;
            }
            c[n++] = (trim_cand){b, gain};
        }
    }
    qsort(c, n, sizeof *c, cand_cmp);
    for (size_t i = 0; i < n && got < want; i++) {
        spw_block *b = c[i].b;
        if (a->p.vmm) {
            if ((st = trim_block_vmm(a, b, &got))) break;
        } else {
            seg *s = b->seg;
            if ((st = a->be->ops->dev_free(a->be, (void *)s->base))) break;
            bin_remove(b->pool, b);
            if (s->prev) s->prev->next = s->next;
            else a->segs = s->next;
            if (s->next) s->next->prev = s->prev;
            account_held(a, -(int64_t)s->size);
            spw__stat_add(&a->ctx->stats.segments, -1);
            got += s->size;
            free(b);
            free(s);
        }
    }
    free(c);
    if (released) *released = got;
    return st;
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
    if (!spw__ctx_can_hold(a->ctx, size)) return SPW_ERR_OUT_OF_MEMORY;
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
    spw__stat_add(&a->ctx->stats.segments, 1);
    carve(a, b, n, p);
    *out = b;
    return SPW_OK;
}

/* Bytes the growth for n would map, or 0 if no placement exists (VMM). */
static spw_status grow(spw_arena *a, spool *p, size_t n, spw_block **out) {
    if (!a->p.vmm) return grow_segment(a, p, n, out);
    placement pl;
    if (!place_vmm(a, p, n, &pl)) return SPW_ERR_OUT_OF_MEMORY; /* address space exhausted */
    if (!spw__ctx_can_hold(a->ctx, pl.map_bytes)) return SPW_ERR_OUT_OF_MEMORY;
    /* Map a little ahead: a growing working set then costs fewer backend calls. The extra is
     * bounded by a fraction of what is held, so it adds at most that fraction to the peak. */
    size_t ahead = SPW_ALIGN_DOWN((size_t)((double)a->held * a->ctx->cfg.grow_ahead), a->p.page);
    size_t room = pl.hole->size - pl.map_bytes;
    ahead = SPW_MIN(ahead, room);
    if (ahead && spw__ctx_can_hold(a->ctx, pl.map_bytes + ahead)) pl.map_bytes += ahead;
    return grow_vmm(a, p, n, &pl, out);
}

spw_status spw__arena_map_free(spw_arena *a, size_t bytes, spw_stream s) {
    size_t n = SPW_ALIGN_DOWN(bytes, a->p.page);
    if (!a->p.vmm || !n) return SPW_OK;
    spool *p = pool_get(a, s, true);
    if (!p) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    placement pl;
    if (!place_vmm(a, p, n, &pl) || !spw__ctx_can_hold(a->ctx, pl.map_bytes)) return SPW_OK;
    spw_block *b;
    spw_status st = grow_vmm(a, p, n, &pl, &b);
    if (st) return st;
    free_coalesce(a, b, p);
    return SPW_OK;
}

/* Would mapping `more` bytes leave more cached memory than the fragmentation slack allows? */
static bool over_slack(spw_arena *a, size_t n, size_t more) {
    const spw_stats *st = &a->ctx->stats;
    double target = (double)(st->live.current + (int64_t)n) * (1.0 + a->ctx->cfg.frag_slack);
    return (double)(st->held.current + (int64_t)more) > target + (double)a->p.page;
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
    if (!h || h->state != B_HOLE || !spw__ctx_can_hold(a->ctx, a->p.page)) return;
    size_t ext = SPW_ALIGN_DOWN(SPW_MIN(h->size, n), a->p.page);
    while (ext && !spw__ctx_can_hold(a->ctx, ext)) ext -= a->p.page;
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

spw_status spw__arena_alloc_ordered(spw_arena *a, size_t bytes, spw_stream s, spw_block **out,
                                    spw_arena_wait w[SPW_ARENA_OWED_MAX], int *nw) {
    *nw = 0;
    size_t n = SPW_ALIGN_UP(bytes, ROUND);
    spool *p = pool_get(a, s, true);
    if (!p) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "arena: out of host memory");
    for (int i = a->nowed; i-- > 0;) { /* only p's own waits can be passed on */
        spw_status st = a->owed[i].pool != p ? settle_one(a, i) : SPW_OK;
        if (st) return st;
    }
    spw_block *b = a->nowed ? pool_fit(a, p, n) : NULL;
    if (!b) return spw__arena_alloc(a, bytes, s, out);
    bin_remove(p, b);
    if (a->p.vmm && owed_in(a, p, b->addr, b->addr + b->size) >= b->size) extend_right(a, b, n);
    b = carve_least_owed(a, b, n, p);
    uintptr_t lo = b->addr, hi = b->addr + b->size;
    for (int i = a->nowed; i-- > 0;) {
        owed *o = &a->owed[i];
        if (o->pool != p || o->hi <= lo || o->lo >= hi) continue;
        w[(*nw)++] = (spw_arena_wait){SPW_MAX(lo, o->lo), SPW_MIN(hi, o->hi), o->ev};
        if (o->lo >= lo && o->hi <= hi) a->owed[i] = a->owed[--a->nowed]; /* wholly passed on */
    }
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
        a->owed[i] = a->owed[--a->nowed];
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

/* ---- inspection ---- */

size_t spw__arena_largest_free(const spw_arena *a) {
    size_t best = 0;
    for (size_t i = 0; i < a->npools; i++) {
        const spool *p = a->pools[i];
        for (int w = NWORDS - 1; w >= 0; w--) {
            if (!p->bitmap[w]) continue;
            int bi = w * 64 + 63 - __builtin_clzll(p->bitmap[w]);
            for (spw_block *b = p->bins[bi]; b; b = b->fnext) best = SPW_MAX(best, b->size);
            break;
        }
    }
    return best;
}

void *spw__block_ptr(const spw_block *b) { return (void *)b->addr; }
size_t spw__block_size(const spw_block *b) { return b->size; }

void spw__arena_walk(const spw_arena *a, void (*fn)(void *u, uintptr_t addr, size_t size, int state),
                     void *u) {
    for (const seg *s = a->segs; s; s = s->next)
        for (const spw_block *b = s->first; b; b = b->next) fn(u, b->addr, b->size, (int)b->state);
}

bool spw__arena_owns(const spw_arena *a, const void *ptr) {
    uintptr_t x = (uintptr_t)ptr;
    for (const seg *s = a->segs; s; s = s->next)
        if (x >= s->base && x < s->base + s->size) return true;
    return false;
}

static size_t mapped_bytes(const spw_arena *a) {
    size_t mapped = 0;
    for (const seg *s = a->segs; s; s = s->next) {
        if (!a->p.vmm) {
            mapped += s->size;
            continue;
        }
        uintptr_t covered_to = 0;
        for (const spw_block *b = s->first; b; b = b->next) {
            if (b->state == B_HOLE) continue;
            uintptr_t p0 = page_floor(a, b->addr), p1 = page_ceil(a, b->addr + b->size);
            if (p0 < covered_to) p0 = covered_to;
            if (p1 > p0) mapped += p1 - p0;
            if (p1 > covered_to) covered_to = p1;
        }
    }
    return mapped;
}

spw_status spw__arena_check(const spw_arena *a) {
    for (const seg *s = a->segs; s; s = s->next) {
        uintptr_t expect = s->base;
        const spw_block *prev = NULL;
        for (const spw_block *b = s->first; b; prev = b, b = b->next) {
            unsigned long at = (unsigned long)b->addr;
            if (b->addr != expect || b->size == 0 || b->prev != prev || b->seg != s)
                return spw__error(SPW_ERR_STATE, "arena check: block list broken at 0x%lx", at);
            if (b->state == B_HOLE) {
                if (!a->p.vmm || b->addr % a->p.page || b->size % a->p.page)
                    return spw__error(SPW_ERR_STATE, "arena check: misplaced hole at 0x%lx", at);
                if (prev && prev->state == B_HOLE)
                    return spw__error(SPW_ERR_STATE, "arena check: adjacent holes at 0x%lx", at);
            } else {
                if (b->addr % ROUND || b->size % ROUND)
                    return spw__error(SPW_ERR_STATE, "arena check: misaligned block at 0x%lx", at);
                if (b->state == B_FREE && prev && prev->state == B_FREE && prev->pool == b->pool)
                    return spw__error(SPW_ERR_STATE, "arena check: uncoalesced free blocks at 0x%lx", at);
            }
            expect = b->addr + b->size;
        }
        if (expect != s->base + s->size) return spw__error(SPW_ERR_STATE, "arena check: segment not tiled");
    }
    size_t mapped = mapped_bytes(a);
    if (mapped != a->held)
        return spw__error(SPW_ERR_STATE, "arena check: %zu B mapped by blocks but %zu B accounted held",
                          mapped, a->held);
    return SPW_OK;
}

size_t spw__arena_held(const spw_arena *a) { return a->held; }
