/*
 * The device arena: returning cached memory to the backend (the budget needs it, or a growth
 * would leave too much cached). The streams of released blocks are synchronized first: the one
 * place the arena makes the host wait. Context lock held.
 */
#include "arena_impl.h"

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

/* Whether a trim could return anything: a run of adjacent FREE blocks (of any pools, as
 * merge_idle_pools would join them) that is a whole segment, or (VMM) spans a whole page. A trim
 * that could return nothing must not make the host wait for the device. */
static bool releasable(const spw_arena *a) {
    for (seg *s = a->segs; s; s = s->next) {
        for (spw_block *b = s->first; b; b = b->next) {
            if (b->state != B_FREE) continue;
            spw_block *e = b;
            while (e->next && e->next->state == B_FREE) e = e->next;
            if (a->p.vmm ? page_ceil(a, b->addr) < page_floor(a, e->addr + e->size) : b == s->first && !e->next)
                return true;
            b = e;
        }
    }
    return false;
}

void spw__arena_allow_trim(spw_arena *a, bool allowed) { a->no_trim = !allowed; }

spw_status spw__arena_trim(spw_arena *a, size_t want, size_t *released) {
    size_t got = 0;
    spw_status st = SPW_OK;
    if (released) *released = 0;
    if (a->no_trim) return SPW_OK;
    if (a->nowed && (st = spw__arena_settle(a))) return st; /* before the syncs that make blocks idle */
    if (!releasable(a)) return SPW_OK;
    /* queued work may still touch free blocks: wait for every stream of this arena once */
    for (size_t k = 0; k < a->npools; k++)
        if ((st = sync_pool(a, a->pools[k]))) return st;
    spw__stat_event(a->p.acct.trim_syncs);
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
            spw__stat_add(a->p.acct.segments, -1);
            got += s->size;
            free(b);
            free(s);
        }
    }
    free(c);
    if (released) *released = got;
    return st;
}
