/*
 * The device arena: inspection (tests, the summary, the tools) and the invariant check.
 * Context lock held.
 */
#include "arena_impl.h"

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
