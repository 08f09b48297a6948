/*
 * The pinned host pool: host copies of buffers come from large slabs of pinned memory (backend
 * host_alloc), never one host_alloc per buffer, because pinning is slow (its cost grows with the
 * bytes pinned: bench/RESULTS.md). Slabs grow geometrically (64 MiB, doubling, at most 1 GiB, or the
 * request when larger) and are sub-allocated best-fit with splitting and coalescing. The arena's
 * code is not reused: its blocks live in device address space with VMM holes, stream pools and
 * the device budget, none of which applies here; host blocks need no stream order because the
 * engine waits for every transfer touching a host copy before freeing it.
 *
 * Budget: the bytes of all slabs never exceed host_budget. At the budget, empty slabs are
 * returned and the allocation retried; then SPW_ERR_HOST_OUT_OF_MEMORY names the numbers.
 * All functions run under the context lock.
 */
#include <stdlib.h>
#include <string.h>

#include "hostmem.h"
#include "stats.h"

#define HALIGN ((size_t)256)
#define SLAB_MIN (64 * SPW_MiB)
#define SLAB_MAX (1 * SPW_GiB)
#define SLAB_ROUND (2 * SPW_MiB)

typedef struct hslab hslab;

struct spw_hblock {
    size_t off, size;
    bool used;
    spw_hblock *prev, *next; /* address order within the slab */
    hslab *slab;
};

struct hslab {
    char *base;
    size_t size;
    size_t used;
    spw_hblock *first;
    hslab *prev, *next;
};

struct spw_hostpool {
    spw_backend *be;
    spw_counter *held_ctr; /* the owner's host_held counter */
    size_t budget, held, used;
    size_t next_slab;
    hslab *slabs;
};

spw_status spw__hostpool_create(spw_backend *be, spw_counter *held, size_t budget, spw_hostpool **out) {
    spw_hostpool *hp = calloc(1, sizeof *hp);
    if (!hp) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "host pool: out of host memory");
    hp->be = be;
    hp->held_ctr = held;
    hp->budget = budget;
    hp->next_slab = SLAB_MIN;
    *out = hp;
    return SPW_OK;
}

static void slab_release(spw_hostpool *hp, hslab *s) {
    spw_backend *be = hp->be;
    be->ops->host_free(be, s->base); /* a failure leaves the memory to the backend's teardown */
    for (spw_hblock *b = s->first, *n; b; b = n) {
        n = b->next;
        free(b);
    }
    if (s->prev) s->prev->next = s->next;
    else hp->slabs = s->next;
    if (s->next) s->next->prev = s->prev;
    hp->held -= s->size;
    spw__stat_add(hp->held_ctr, -(int64_t)s->size);
    free(s);
}

void spw__hostpool_destroy(spw_hostpool *hp) {
    if (!hp) return;
    while (hp->slabs) slab_release(hp, hp->slabs);
    free(hp);
}

void spw__hostpool_trim(spw_hostpool *hp) {
    for (hslab *s = hp->slabs, *n; s; s = n) {
        n = s->next;
        if (!s->used) slab_release(hp, s);
    }
}

size_t spw__hostpool_budget(const spw_hostpool *hp) { return hp->budget; }

/* Best fit over every slab's free blocks. */
static spw_hblock *best_fit(spw_hostpool *hp, size_t n) {
    spw_hblock *best = NULL;
    for (hslab *s = hp->slabs; s; s = s->next) {
        if (s->size - s->used < n) continue;
        for (spw_hblock *b = s->first; b; b = b->next)
            if (!b->used && b->size >= n && (!best || b->size < best->size)) {
                best = b;
                if (b->size == n) return b;
            }
    }
    return best;
}

/* Mark free block b used for n bytes, splitting the tail off when large enough. */
static spw_status take(spw_hostpool *hp, spw_hblock *b, size_t n) {
    if (b->size - n >= HALIGN) {
        spw_hblock *t = calloc(1, sizeof *t);
        if (!t) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "host pool: out of host memory");
        t->off = b->off + n;
        t->size = b->size - n;
        t->slab = b->slab;
        t->prev = b;
        t->next = b->next;
        if (b->next) b->next->prev = t;
        b->next = t;
        b->size = n;
    }
    b->used = true;
    b->slab->used += b->size;
    hp->used += b->size;
    return SPW_OK;
}

static spw_status grow(spw_hostpool *hp, size_t n) {
    size_t room = hp->budget > hp->held ? hp->budget - hp->held : 0;
    size_t want = SPW_ALIGN_UP(SPW_MAX(n, hp->next_slab), SLAB_ROUND);
    if (want > room) want = SPW_MAX(SPW_ALIGN_DOWN(room, SLAB_ROUND), SPW_ALIGN_UP(n, HALIGN));
    if (want > room) return SPW_ERR_HOST_OUT_OF_MEMORY; /* message by the caller */
    hslab *s = calloc(1, sizeof *s);
    spw_hblock *b = calloc(1, sizeof *b);
    if (!s || !b) {
        free(s);
        free(b);
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "host pool: out of host memory");
    }
    spw_backend *be = hp->be;
    void *p = NULL;
    spw_status st = be->ops->host_alloc(be, want, &p);
    if (st) {
        free(s);
        free(b);
        char w[48];
        return spw__error_prefix(SPW_ERR_HOST_OUT_OF_MEMORY, "host pool: pinning a slab of %s",
                                 spw__fmt_bytes(w, sizeof w, want));
    }
    s->base = p;
    s->size = want;
    s->first = b;
    b->size = want;
    b->slab = s;
    s->next = hp->slabs;
    if (hp->slabs) hp->slabs->prev = s;
    hp->slabs = s;
    hp->held += want;
    spw__stat_add(hp->held_ctr, (int64_t)want);
    if (hp->next_slab < SLAB_MAX) hp->next_slab *= 2;
    return SPW_OK;
}

static spw_status host_oom(spw_hostpool *hp, size_t bytes) {
    char r[48], b[48], h[48], u[48];
    return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY,
                      "pinned host pool exhausted: requested %s; host budget %s, held %s, in use %s. "
                      "Raise option 'host_budget', destroy buffers, or give buffers your own memory "
                      "with spw_buf_register_host",
                      spw__fmt_bytes(r, sizeof r, bytes), spw__fmt_bytes(b, sizeof b, hp->budget),
                      spw__fmt_bytes(h, sizeof h, hp->held), spw__fmt_bytes(u, sizeof u, hp->used));
}

spw_status spw__hostpool_alloc(spw_hostpool *hp, size_t bytes, void **ptr, spw_hblock **blk) {
    if (bytes > hp->budget) return host_oom(hp, bytes);
    size_t n = SPW_ALIGN_UP(bytes, HALIGN);
    spw_hblock *b = best_fit(hp, n);
    if (!b) {
        spw_status st = grow(hp, n);
        if (st == SPW_ERR_HOST_OUT_OF_MEMORY && hp->budget - hp->held < n) {
            /* at the budget: empty slabs may be in the way of one that fits */
            spw__hostpool_trim(hp);
            st = grow(hp, n);
            if (st == SPW_ERR_HOST_OUT_OF_MEMORY && hp->budget - hp->held < n) return host_oom(hp, bytes);
        }
        if (st) return st;
        b = best_fit(hp, n);
        if (!b) return host_oom(hp, bytes);
    }
    spw_status st = take(hp, b, n);
    if (st) return st;
    *ptr = b->slab->base + b->off;
    *blk = b;
    return SPW_OK;
}

void spw__hostpool_free(spw_hostpool *hp, spw_hblock *b) {
    hslab *s = b->slab;
    b->used = false;
    s->used -= b->size;
    hp->used -= b->size;
    if (b->next && !b->next->used) {
        spw_hblock *n = b->next;
        b->size += n->size;
        b->next = n->next;
        if (n->next) n->next->prev = b;
        free(n);
    }
    if (b->prev && !b->prev->used) {
        spw_hblock *p = b->prev;
        p->size += b->size;
        p->next = b->next;
        if (b->next) b->next->prev = p;
        free(b);
    }
    /* Empty slabs stay cached (pinning again is slow), except ones bigger than the growth size
     * (a single huge buffer): those go back at once. */
    if (!s->used && s->size > hp->next_slab) slab_release(hp, s);
}
