/*
 * The device arena's private structures and block helpers, shared by arena.c (allocation, owed
 * waits, growth), arena_trim.c (returning cached memory) and arena_inspect.c (invariants and
 * inspection). Not an interface: everything outside the arena uses internal.h. Context lock held.
 */
#ifndef SPW_ARENA_IMPL_H
#define SPW_ARENA_IMPL_H

#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "stats.h"

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
    void *owner; /* LIVE: what the block's user said holds it (spw__block_set_owner), else NULL */
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
    seg *segs;          /* VMM: exactly one (the reservation) */
    spw_block *holes;   /* VMM: HOLE blocks */
    spool **pools;
    size_t npools, cap_pools;
    spool *last_pool;
    spw_block *spare;   /* recycled block structs */
    size_t held;        /* bytes mapped or allocated from the backend by this arena */
    owed owed[SPW_ARENA_OWED_MAX];
    int nowed;
    uint64_t *ranks;    /* arena_window.c's scratch: one rank a block */
    size_t nranks;
    bool no_trim;       /* spw__arena_allow_trim(a, false) in force */
};

static inline size_t page_floor(const spw_arena *a, uintptr_t x) { return SPW_ALIGN_DOWN(x, a->p.page); }
static inline size_t page_ceil(const spw_arena *a, uintptr_t x) { return SPW_ALIGN_UP(x, a->p.page); }

/* Stream s's pool, or NULL (no cache, no creation: arena.c's pool_get does both). */
static inline const spool *pool_find(const spw_arena *a, spw_stream s) {
    for (size_t i = 0; i < a->npools; i++)
        if (a->pools[i]->stream == s) return a->pools[i];
    return NULL;
}

/* VMM (one segment): the first block that ends past addr, the one holding addr or the next;
 * NULL past every block. */
static inline spw_block *block_from(const spw_arena *a, uintptr_t addr) {
    spw_block *b = a->segs->first;
    while (b && b->addr + b->size <= addr) b = b->next;
    return b;
}

static inline int bin_of(size_t size) {
    size_t u = size / ROUND;
    if (u < 16) return (int)u;
    int fl = 63 - __builtin_clzll((unsigned long long)u);
    int sl = (int)((u >> (fl - SL_BITS)) & 15);
    int b = 16 + (fl - SL_BITS) * 16 + sl;
    return b < NBINS ? b : NBINS - 1;
}

static inline spw_block *block_new(spw_arena *a) {
    spw_block *b = a->spare;
    if (b) a->spare = b->fnext;
    else b = malloc(sizeof *b);
    if (b) memset(b, 0, sizeof *b);
    return b;
}

static inline void block_put(spw_arena *a, spw_block *b) {
    b->fnext = a->spare;
    a->spare = b;
}

static inline void bin_insert(spool *p, spw_block *b) {
    int i = bin_of(b->size);
    b->bin = i;
    b->fprev = NULL;
    b->fnext = p->bins[i];
    if (b->fnext) b->fnext->fprev = b;
    p->bins[i] = b;
    p->bitmap[i / 64] |= 1ull << (i % 64);
}

static inline void bin_remove(spool *p, spw_block *b) {
    int i = b->bin;
    if (b->fprev) b->fprev->fnext = b->fnext;
    else p->bins[i] = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    if (!p->bins[i]) p->bitmap[i / 64] &= ~(1ull << (i % 64));
    b->fprev = b->fnext = NULL;
}

static inline void hole_insert(spw_arena *a, spw_block *b) {
    b->state = B_HOLE;
    b->pool = NULL;
    b->fprev = NULL;
    b->fnext = a->holes;
    if (a->holes) a->holes->fprev = b;
    a->holes = b;
}

static inline void hole_remove(spw_arena *a, spw_block *b) {
    if (b->fprev) b->fprev->fnext = b->fnext;
    else a->holes = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    b->fprev = b->fnext = NULL;
}

/* Whether `more` bytes can be held without passing the budget of the account (shared by every
 * arena charging the same counters). */
static inline bool can_hold(const spw_arena *a, size_t more) {
    return (uint64_t)a->p.acct.held->current + more <= *a->p.acct.budget;
}

/* Bytes mapped or allocated from the backend (+) or returned to it (-): held and cached in the
 * account's counters. */
static inline void account_held(spw_arena *a, int64_t delta) {
    a->held = (size_t)((int64_t)a->held + delta);
    spw__stat_add(a->p.acct.held, delta);
    spw__stat_add(a->p.acct.cached, delta);
    if (delta > 0) spw__stat_event(a->p.acct.backend_allocs);
    else spw__stat_event(a->p.acct.backend_frees);
}

/* Split b so that it keeps its first n bytes; the rest goes into t (or a new block when t is
 * NULL), state st, same pool, returned out of any list. NULL on host allocation failure (b
 * unchanged). */
static inline spw_block *split_tail(spw_arena *a, spw_block *b, size_t n, bstate st, spw_block *t) {
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
static inline void absorb_next(spw_arena *a, spw_block *b) {
    spw_block *n = b->next;
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    block_put(a, n);
}

#endif /* SPW_ARENA_IMPL_H */
