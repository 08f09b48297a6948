/*
 * The device arena: which live blocks to give up so that an allocation finds one run of
 * adjacent bytes without a trim (a window of the arena's choosing, or a ring's next run from the
 * caller's address). At the budget with no cached block large enough, the arena would return
 * scattered cached pages to the backend and map new ones, and an unmap waits for the device
 * (arena_trim.c). Emptying adjacent blocks instead costs only stream-ordered waits.
 * The caller ranks the candidates (the engine asks its policy) and evicts the owners this
 * names. Context lock held.
 */
#include "arena_impl.h"

/* A block's rank inside a run: FREE blocks of pool p cost nothing; LIVE blocks with an owner
 * rank as the caller says; anything else (a hole, another stream's cached block, a block
 * nobody claimed or that must stay) ends the run (0). */
static uint64_t block_rank(const spw_block *b, const spool *p, spw_arena_rank rank, void *u) {
    if (b->state == B_FREE) return b->pool == p ? UINT64_MAX : 0;
    if (b->state == B_LIVE && b->owner) return rank(u, b->owner);
    return 0;
}

size_t spw__arena_window(spw_arena *a, size_t bytes, spw_stream s, spw_arena_rank rank, void *u, void **owners,
                         size_t max) {
    if (!a->p.vmm || !a->segs || !max) return 0;
    size_t n = SPW_ALIGN_UP(bytes, ROUND), nb = 0;
    const spool *p = pool_find(a, s);
    for (const spw_block *b = a->segs->first; b; b = b->next) nb++;
    if (nb > a->nranks) { /* each block ranked once: a rank may cost the caller a lookup */
        uint64_t *r = realloc(a->ranks, nb * sizeof *r);
        if (!r) return 0; /* no window: the caller trims instead */
        a->ranks = r;
        a->nranks = nb;
    }
    size_t k = 0;
    for (const spw_block *b = a->segs->first; b; b = b->next) a->ranks[k++] = block_rank(b, p, rank, u);
    /* Every start block: the shortest run from it that holds n, its lowest rank and live bytes. */
    const spw_block *best = NULL;
    uint64_t best_min = 0;
    size_t best_live = 0;
    k = 0;
    for (const spw_block *i = a->segs->first; i; i = i->next, k++) {
        uint64_t lo = UINT64_MAX;
        size_t got = 0, live = 0, count = 0, kj = k;
        for (const spw_block *j = i; j && got < n && a->ranks[kj]; j = j->next, kj++) {
            if (j->state == B_LIVE && (live += j->size, ++count > max)) break;
            lo = SPW_MIN(lo, a->ranks[kj]);
            got += j->size;
        }
        if (got < n || count > max || !live) continue;
        if (!best || lo > best_min || (lo == best_min && live < best_live)) {
            best = i;
            best_min = lo;
            best_live = live;
        }
    }
    if (!best) return 0;
    size_t got = 0;
    k = 0;
    for (const spw_block *j = best; got < n; j = j->next) {
        if (j->state == B_LIVE) owners[k++] = j->owner;
        got += j->size;
    }
    return k;
}

int spw__arena_next_run(const spw_arena *a, uintptr_t from, size_t bytes, spw_stream s, int (*accept)(void *u, void *owner),
                        void *u, void **owners, size_t max, size_t *n, uintptr_t *at) {
    *n = 0;
    const spool *p = pool_find(a, s);
    if (!a->p.vmm || !a->segs || !p) return 0;
    size_t need = SPW_ALIGN_UP(bytes, ROUND);
    const spw_block *first = a->segs->first, *b = block_from(a, from);
    bool wrapped = !b; /* from lies past every block: one pass from the first */
    if (wrapped) b = first;
    uintptr_t start = wrapped ? b->addr : SPW_MAX(b->addr, SPW_ALIGN_UP(from, ROUND));
    size_t k = 0;
    for (;;) {
        if (!b || (wrapped && b->addr >= from)) {
            if (wrapped) return 0;
            wrapped = true; /* a run does not cross the end: it starts again at the first block */
            b = first;
            start = b->addr;
            k = 0;
            continue;
        }
        int ok = b->state == B_FREE ? b->pool == p : b->state == B_LIVE && b->owner ? accept(u, b->owner) : 0;
        if (ok < 0) return -1;
        if (!ok) {
            b = b->next;
            if (b) start = b->addr;
            k = 0;
            continue;
        }
        if (b->state == B_LIVE) {
            if (k == max) return -2;
            owners[k++] = b->owner;
        }
        if (b->addr + b->size >= start + need) {
            *n = k;
            *at = start;
            return 1;
        }
        b = b->next;
    }
}

void spw__block_set_owner(spw_block *b, void *owner) { b->owner = owner; }
