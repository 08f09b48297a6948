/*
 * The plan policy: where buffers should be. The start state of a newly learned plan (Belady's
 * cycle from an empty device, reached at once), the fixed set of STATIC and SLOT (the expert's
 * split found from the plan) and SLOT's take-up of it (the rest of the room in one piece). They
 * work from simulations and counts over the plan; the engine moves data only through
 * spw__engine_prefetch, spw__engine_evict and spw__engine_stream_room, from the policy's prefetch
 * callback. Context lock held.
 */
#include <stdlib.h>

#include "policy_plan.h"

/* ---- the start state of a new plan ----
 *
 * Belady's rule is optimal from whatever the device holds, but over a repeating plan the set
 * the recording step leaves (LRU's: the last buffers of the step) leads into a costlier cycle
 * than the one Belady reaches from an empty device. On a cyclic scan the two cycles differ by
 * one buffer a step; with buffers of 16-96 MiB by 6-16% of the bytes of the next five steps
 * (simulated). So once, when the first plan is learned (the step that ended ran without one),
 * the policy works out the set Belady would hold at the step boundary had it started empty, and
 * moves there at once, at the end of that first step: uploads of at most one budget, victims
 * only outside the set. The step that pays is the one that already paid every cold upload. */

/* Next position of e's key strictly after plan position i, wrapping into the next step. */
static size_t kpos_next(const spw_policy *p, const kpos *e, size_t i) {
    uint32_t lo = 0, hi = e->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (e->pos[mid] <= i) lo = mid + 1;
        else hi = mid;
    }
    return lo < e->n ? e->pos[lo] : e->pos[0] + p->nplan;
}

/* Device bytes the plan's buffers may use: the budget less what other allocations hold live. */
size_t spw__plan_capacity(spw_policy *p) {
    int64_t other = p->ctx->stats.live.current;
    for (spw_buf *b = spw__pol_first(p->ctx); b; b = spw__pol_next(b)) {
        kbuf *k = kb_of(b);
        kpos *e = NULL;
        if (k) HASH_FIND(hh, p->index, &k->key, sizeof(uint64_t), e);
        if (e && spw__pol_resident(b)) other -= (int64_t)spw__pol_device_bytes(b);
    }
    return other < 0 ? p->ctx->budget : other >= (int64_t)p->ctx->budget ? 0 : p->ctx->budget - (size_t)other;
}

/* Belady from an empty device over `periods` passes of the plan within `cap` bytes. Leaves
 * sim_in set on the keys resident at the end (after one pass: at the boundary to the next
 * step); *moved receives the mean upload bytes of the passes after the first (what its cycle
 * settles to; 0 with one pass). False on host allocation failure. */
static bool belady_run(spw_policy *p, size_t cap, size_t periods, double *moved) {
    size_t nkeys = HASH_COUNT(p->index), n_in = 0, used = 0;
    kpos **in = malloc((nkeys ? nkeys : 1) * sizeof *in);
    if (!in) return false;
    kpos *e, *tmp;
    HASH_ITER(hh, p->index, e, tmp) {
        kbuf *k = NULL;
        HASH_FIND(hh, p->by_key, &e->key, sizeof(uint64_t), k);
        e->sim_in = false;
        e->sim_bytes = k && spw__pol_resident(k->buf) ? spw__pol_device_bytes(k->buf)
                                                       : SPW_ALIGN_UP(p->plan[e->pos[0]].bytes, 512);
    }
    double sum = 0;
    for (size_t t = 0; t < periods * p->nplan; t++) {
        size_t i = t % p->nplan;
        HASH_FIND(hh, p->index, &p->plan[i].key, sizeof(uint64_t), e);
        if (!e || e->sim_in || e->sim_bytes > cap) continue;
        while (used + e->sim_bytes > cap && n_in) {
            size_t v = 0, vd = 0;
            for (size_t j = 0; j < n_in; j++) {
                size_t d = kpos_next(p, in[j], i);
                if (d > vd) vd = d, v = j;
            }
            in[v]->sim_in = false;
            used -= in[v]->sim_bytes;
            in[v] = in[--n_in];
        }
        e->sim_in = true;
        used += e->sim_bytes;
        in[n_in++] = e;
        if (t >= p->nplan && p->plan[i].mode != SPW_ACCESS_WRITE) sum += (double)e->sim_bytes;
    }
    free(in);
    *moved = periods > 1 ? sum / (double)(periods - 1) : 0;
    return true;
}

static bool simulate_start(spw_policy *p, size_t cap) {
    double moved;
    return belady_run(p, cap, 1, &moved);
}

/* Largest buffer the plan reads. */
size_t spw__plan_largest(const spw_policy *p) {
    size_t m = 0;
    for (size_t i = 0; i < p->nplan; i++) m = SPW_MAX(m, SPW_ALIGN_UP(p->plan[i].bytes, 512));
    return m;
}

/* The bytes of plan position i, rounded as the arena rounds, if it is its buffer's first use in
 * the plan (each buffer counts once), else 0; *e receives the buffer's positions. */
static size_t first_use(const spw_policy *p, size_t i, kpos **e) {
    *e = NULL;
    HASH_FIND(hh, p->index, &p->plan[i].key, sizeof(uint64_t), *e);
    return *e && (*e)->pos[0] == i ? SPW_ALIGN_UP(p->plan[i].bytes, 512) : 0;
}

size_t spw__plan_total(spw_policy *p) {
    size_t total = 0;
    kpos *e;
    for (size_t i = 0; i < p->nplan; i++) total += first_use(p, i, &e);
    return total;
}

/* The mean upload bytes of a pass in the cycle Belady settles to within `cap` (at most 2^16
 * plan entries simulated); 0 when it cannot say. */
double spw__plan_belady_bytes(spw_policy *p, size_t cap, size_t periods) {
    if (!p->index || !p->nplan || periods < 2) return 0;
    while (periods > 2 && periods * p->nplan > 65536) periods--;
    double moved = 0;
    bool ok = belady_run(p, cap, periods, &moved);
    kpos *e, *tmp;
    HASH_ITER(hh, p->index, e, tmp) e->sim_in = false;
    return ok ? moved : 0;
}

static void set_targets(spw_policy *p, bool from_sim) {
    kpos *e, *tmp;
    HASH_ITER(hh, p->index, e, tmp) {
        kbuf *k = NULL;
        HASH_FIND(hh, p->by_key, &e->key, sizeof(uint64_t), k);
        if (k) k->target = from_sim && e->sim_in;
    }
}

/* Move to the start state: upload the target buffers the plan reads first, soonest first,
 * evicting only buffers outside the target set; stop at the first that finds no room. */
void spw__plan_rebase(spw_policy *p, spw_ctx *ctx) {
    p->rebase_due = false;
    p->ring_prev = PF_OFF; /* a new plan's fixed set is placed in one run again */
    if (!p->index || !p->nplan || !simulate_start(p, spw__plan_capacity(p))) return;
    set_targets(p, true);
    p->cursor = 0;
    p->rebasing = true;
    for (size_t i = 0; i < p->nplan; i++) {
        const plan_entry *pe = &p->plan[i];
        kpos *e = NULL;
        kbuf *k = NULL;
        HASH_FIND(hh, p->index, &pe->key, sizeof(uint64_t), e);
        if (!e || !e->sim_in) continue;
        e->sim_in = false; /* the first use decides; a buffer first overwritten needs no upload */
        HASH_FIND(hh, p->by_key, &pe->key, sizeof(uint64_t), k);
        if (!k || pe->mode == SPW_ACCESS_WRITE || spw__pol_resident(k->buf) || spw__pol_acquired(k->buf))
            continue;
        spw_status st = spw__engine_prefetch(ctx, k->buf, 1);
        if (st == SPW_ERR_OUT_OF_MEMORY) spw__error_clear();
        if (st != SPW_OK || !spw__pol_resident(k->buf)) break;
        k->prefetched = true;
        spw__stat_add(&p->ctx->stats.plan_prefetch_bytes, (int64_t)spw__pol_bytes(k->buf));
    }
    p->rebasing = false;
    set_targets(p, false);
}

/* ---- STATIC: the fixed set ---- */

void spw__plan_clear_fixed(spw_policy *p) {
    kbuf *k, *tmp;
    HASH_ITER(hh, p->by_key, k, tmp) k->fixed = false;
    p->slot_bytes = 0;
}

static void fix_key(spw_policy *p, uint64_t key) {
    kbuf *k = NULL;
    HASH_FIND(hh, p->by_key, &key, sizeof(uint64_t), k);
    if (k) k->fixed = true;
}

/* Choose the fixed set for the current plan, as an expert places a static split: room for two
 * of the largest streamed buffers is kept (SLOT: one and a quarter); buffers used more than once
 * a step are fixed first (streamed, they would cross the link more than once); the rest, in
 * order of first use, are fixed while the fixed bytes stay within their share of the bytes seen
 * so far, which spreads them evenly over the step (layer l of N is fixed iff
 * floor((l+1)k/N) > floor(lk/N) when sizes are equal), so that work on fixed buffers hides each
 * streamed transfer. */
void spw__plan_choose_fixed(spw_policy *p, int mode) {
    spw__plan_clear_fixed(p);
    if (!p->index || !p->nplan) return;
    size_t cap = spw__plan_capacity(p), total = 0, largest = 0, once = 0;
    kpos *e;
    for (size_t i = 0; i < p->nplan; i++) {
        size_t b = first_use(p, i, &e);
        if (!b) continue;
        total += b;
        largest = SPW_MAX(largest, b);
        if (e->n == 1) once += b;
    }
    if (total <= cap) { /* everything fits: nothing streams */
        for (size_t i = 0; i < p->nplan; i++) fix_key(p, p->plan[i].key);
        return;
    }
    size_t stream = mode == PF_SLOT ? largest + SPW_ALIGN_UP(largest / 4, 512) : (spw__pol_ring(p->ctx) ? 3 : 2) * largest;
    if (cap <= stream) return;
    if (mode == PF_STATIC) p->slot_bytes = largest;
    size_t room = cap - stream, used = 0;
    for (int pass = 0; pass < 2; pass++) {
        size_t seen = 0, share = pass ? room - used : 0;
        for (size_t i = 0; i < p->nplan; i++) {
            size_t b = first_use(p, i, &e);
            if (!b || (pass == 0) != (e->n > 1)) continue;
            seen += b;
            bool fits = used + b <= room;
            /* pass 1: within the share of the single-use bytes seen so far */
            if (pass && fits) fits = (double)(used + b - (room - share)) <= (double)share * (double)seen / (double)once;
            if (fits) {
                fix_key(p, e->key);
                used += b;
            }
        }
    }
}

/* Evict every clean evictable buffer, or with keep_fixed every one outside the fixed set. */
static void evict_clean(spw_ctx *ctx, bool keep_fixed) {
    for (spw_buf *b = spw__pol_first(ctx); b; b = spw__pol_next(b)) {
        kbuf *kb = keep_fixed ? kb_of(b) : NULL;
        if ((!kb || !kb->fixed) && spw__pol_evictable(b) && !spw__pol_dirty(b) && spw__engine_evict(ctx, b))
            spw__error_clear();
    }
}

bool spw__plan_take_up_fixed(spw_policy *p, spw_ctx *ctx, bool compact) {
    bool missing = false;
    kbuf *k, *tmp;
    HASH_ITER(hh, p->by_key, k, tmp) missing |= k->fixed && !spw__pol_resident(k->buf);
    if (!missing && !compact) return false;
    /* the fixed set in (victims outside it), everything else out, then the room in one piece.
     * `compact` (a ring's first take-up): the fixed set is placed again from an empty device
     * first, so that it lies in one run and the ring's room in another. */
    spw_status st = SPW_OK;
    if (compact) {
        evict_clean(ctx, false);
        if (spw__engine_stream_room(ctx)) spw__error_clear();
    }
    p->taking_up = true;
    HASH_ITER(hh, p->by_key, k, tmp) {
        if (k->fixed && !spw__pol_resident(k->buf) && (st = spw__engine_prefetch(ctx, k->buf, 1))) break;
    }
    p->taking_up = false;
    if (st) {
        spw__error_clear();
        return true; /* the room stays as it is; the next step boundary tries again */
    }
    evict_clean(ctx, true);
    /* compacted: the fixed set took the start of the room made above, the rest is one piece */
    if (!compact && spw__engine_stream_room(ctx)) spw__error_clear();
    return true;
}
