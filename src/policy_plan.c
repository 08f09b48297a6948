/*
 * Plan: learn the access order of one step, then evict by next use and prefetch ahead.
 *
 * Inference and training repeat the same sequence of acquisitions every step. During a step
 * (spw_step_begin .. spw_step_end) the policy records each acquisition as (key, mode, bytes).
 * From the next step on, that recording is the plan: a cursor follows it, and
 * - the victim is the evictable buffer whose next use in the plan is farthest away (Belady's
 *   rule; a buffer the plan never uses goes first);
 * - a dirty buffer whose next access in a confirmed plan overwrites it (WRITE) is dropped, not
 *   written back;
 * - after each acquisition the next buffers of the plan are prefetched, as far as the budget
 *   allows without evicting anything needed sooner than what comes in.
 * Every acquisition is checked against the plan. On a mismatch (dynamic control flow, expert
 * routing) the policy counts a divergence and behaves exactly as LRU for the rest of the step:
 * no prediction, no prefetch, no dropped write-back; the step's own recording becomes the next
 * plan. Outside steps, and before a plan exists, it is LRU.
 *
 * Keys identify buffers across steps: a buffer created outside a step keeps its creation id;
 * one created inside a step is identified by its position among the step's creations (the k-th
 * buffer created in every step is "the same" buffer), so plans survive per-step temporaries.
 *
 * Dropping a dirty buffer on a predicted overwrite is a bet on the plan. It is taken only when
 * the plan was confirmed (the step that recorded it followed its predecessor exactly) and the
 * current step has followed it so far: the program has overwritten that buffer before reading
 * it at this point in at least two consecutive steps.
 *
 * Where buffers should be is worked out in policy_plan_layout.c: the start state of the first
 * plan (Belady's cycle from an empty device, moved to once) and the fixed set of STATIC and
 * SLOT. Which pipeline runs (no prefetch, the double buffer, STATIC, SLOT) is chosen by timing
 * steps in policy_plan_trials.c, which also writes the summary line.
 */
#include <stdlib.h>
#include <string.h>

#include "policy_plan.h"
#include "size.h"

_Thread_local int spw__plan_hash_oom;

/* ---- plan index ---- */

static void index_free(spw_policy *p) {
    kpos *e, *tmp;
    HASH_ITER(hh, p->index, e, tmp) {
        HASH_DEL(p->index, e);
        free(e->pos);
        free(e);
    }
}

/* Build key -> positions for the plan; false (and no index) on host allocation failure. */
static bool index_build(spw_policy *p) {
    for (size_t i = 0; i < p->nplan; i++) {
        kpos *e = NULL;
        HASH_FIND(hh, p->index, &p->plan[i].key, sizeof(uint64_t), e);
        if (!e) {
            e = calloc(1, sizeof *e);
            if (!e) goto fail;
            e->key = p->plan[i].key;
            spw__plan_hash_oom = 0;
            HASH_ADD(hh, p->index, key, sizeof(uint64_t), e);
            if (spw__plan_hash_oom) {
                kpos *in = NULL;
                HASH_FIND(hh, p->index, &e->key, sizeof(uint64_t), in);
                if (!in) free(e);
                goto fail;
            }
        }
        if (e->n == e->cap) {
            uint32_t cap = e->cap ? 2 * e->cap : 4;
            uint32_t *np = realloc(e->pos, cap * sizeof *np);
            if (!np) goto fail;
            e->pos = np;
            e->cap = cap;
        }
        e->pos[e->n++] = (uint32_t)i;
    }
    return true;
fail:
    index_free(p);
    return false;
}

/* Plan entries from the cursor to the next use of key (wrapping into the next step), or FAR.
 * *mode receives that use's mode. */
static uint64_t next_use(const spw_policy *p, uint64_t key, spw_access *mode) {
    kpos *e = NULL;
    HASH_FIND(hh, p->index, &key, sizeof(uint64_t), e);
    if (!e || !e->n) return FAR;
    uint32_t lo = 0, hi = e->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (e->pos[mid] < p->cursor) lo = mid + 1;
        else hi = mid;
    }
    size_t at = lo < e->n ? e->pos[lo] : e->pos[0] + p->nplan;
    if (mode) *mode = p->plan[at % p->nplan].mode;
    return at - p->cursor;
}

/* Distance from the cursor to the use of key that follows plan position `after`. */
static uint64_t use_after(const spw_policy *p, uint64_t key, size_t after) {
    kpos *e = NULL;
    HASH_FIND(hh, p->index, &key, sizeof(uint64_t), e);
    if (!e || !e->n) return FAR;
    for (uint32_t i = 0; i < e->n; i++)
        if (e->pos[i] > after) return e->pos[i] - p->cursor;
    return e->pos[0] + p->nplan - p->cursor;
}

/* The largest next-use-after-use over the plan entries from the cursor up to `upto` entries
 * ahead: a buffer used in that window becomes a victim candidate with that distance once it is
 * released, before the entry `upto` is reached. */
/* For the plan entry `at` entries from the start of this step (at >= nplan: in the next step),
 * the distance from the cursor to its buffer's use after that one. */
static uint64_t reuse_after_entry(const spw_policy *p, size_t at) {
    uint64_t after = use_after(p, p->plan[at % p->nplan].key, at % p->nplan);
    return at >= p->nplan && after != FAR ? after + p->nplan : after;
}

static uint64_t window_floor(const spw_policy *p, uint64_t upto) {
    uint64_t floor = 0;
    size_t n = (size_t)SPW_MIN(upto, (uint64_t)LOOKAHEAD_MAX);
    for (size_t i = 0; i < n && p->nplan; i++) floor = SPW_MAX(floor, reuse_after_entry(p, p->cursor + i));
    return floor;
}

static bool predicting(const spw_policy *p) { return p->following && p->index && p->nplan; }

/* ---- lifecycle ---- */

static spw_status plan_create(spw_ctx *ctx, spw_policy **out) {
    spw_policy *p = calloc(1, sizeof *p);
    if (!p) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "policy plan: out of host memory");
    spw_status st = spw__policy_lru.create(ctx, &p->lru);
    if (st) {
        free(p);
        return st;
    }
    p->ctx = ctx;
    spw__plan_trials_init(p);
    *out = p;
    return SPW_OK;
}

static void plan_destroy(spw_policy *p) {
    kbuf *e, *tmp;
    HASH_ITER(hh, p->by_key, e, tmp) HASH_DEL(p->by_key, e);
    index_free(p);
    free(p->plan);
    free(p->rec);
    spw__policy_lru.destroy(p->lru);
    free(p);
}

static void plan_on_create(spw_policy *p, spw_buf *b) {
    kbuf *k = calloc(1, sizeof *k);
    if (!k) return; /* this buffer stays unknown to the plan: evicted first, never prefetched */
    k->buf = b;
    k->key = p->in_step ? (IN_STEP_KEY | p->created_in_step++) : spw__pol_id(b);
    kbuf *old = NULL;
    spw__plan_hash_oom = 0;
    HASH_REPLACE(hh, p->by_key, key, sizeof(uint64_t), k, old);
    (void)old; /* an older live buffer with that key is simply no longer found by key */
    if (spw__plan_hash_oom) {
        kbuf *in = NULL;
        HASH_FIND(hh, p->by_key, &k->key, sizeof(uint64_t), in);
        if (in == k) HASH_DEL(p->by_key, k);
        free(k); /* unknown to the plan: evicted first, never prefetched */
        return;
    }
    spw__pol_node(b)->data = k;
}

static void plan_on_destroy(spw_policy *p, spw_buf *b) {
    spw__policy_lru.on_destroy(p->lru, b);
    p->rk_set = false;
    kbuf *k = kb_of(b);
    if (!k) return;
    if (k->early) p->early--;
    kbuf *cur = NULL;
    HASH_FIND(hh, p->by_key, &k->key, sizeof(uint64_t), cur);
    if (cur == k) HASH_DEL(p->by_key, k);
    spw__pol_node(b)->data = NULL;
    free(k);
}

/* ---- steps ---- */

static void plan_step_end(spw_policy *p) {
    p->rk_set = false;
    if (!p->in_step) return;
    p->in_step = false;
    bool exact = p->following && p->cursor == p->nplan && p->nrec == p->nplan;
    bool cold = !p->nplan; /* this step ran without any plan: what it left resident is LRU's */
    p->last_exact = exact;
    if (exact) p->diverged = 0;
    else if (p->nplan) p->diverged++;
    index_free(p);
    if (!p->rec_ok) { /* incomplete recording: forget everything, relearn next step */
        p->nplan = 0;
        p->confirmed = false;
    } else {
        plan_entry *t = p->plan;
        size_t tc = p->cap_plan;
        p->plan = p->rec;
        p->cap_plan = p->cap_rec;
        p->nplan = p->nrec;
        p->rec = t;
        p->cap_rec = tc;
        p->confirmed = exact;
        if (!index_build(p)) {
            p->nplan = 0;
            p->confirmed = false;
        }
    }
    p->rebase_due = cold && p->nplan > 0;
    p->nrec = 0;
    p->following = false;
}

static void plan_step_begin(spw_policy *p) {
    plan_step_end(p);
    p->in_step = true;
    p->rec_ok = true;
    p->nrec = 0;
    p->cursor = 0;
    p->created_in_step = 0;
    p->following = p->nplan > 0 && p->index;
    uint64_t now = spw__now_ns();
    spw__plan_tune(p, now);
    p->evictions0 = spw__plan_evictions(p);
    p->last_exact = false;
    p->step_t0 = now;
    p->step_bytes0 = spw__plan_bytes_moved(p);
}

/* ---- accesses ---- */

static void record(spw_policy *p, uint64_t key, spw_access mode, size_t bytes) {
    if (!p->rec_ok) return;
    if (p->nrec == p->cap_rec) {
        size_t cap = p->cap_rec ? 2 * p->cap_rec : 64;
        plan_entry *n = realloc(p->rec, cap * sizeof *n);
        if (!n) {
            p->rec_ok = false;
            return;
        }
        p->rec = n;
        p->cap_rec = cap;
    }
    p->rec[p->nrec++] = (plan_entry){key, bytes, mode};
}

/* One access of the step (an acquisition, or a host read as READ): recorded, and checked
 * against the plan's next entry. */
static void note_access(spw_policy *p, kbuf *k, spw_access mode, size_t bytes) {
    if (!p->in_step) return;
    uint64_t key = k ? k->key : FAR;
    record(p, key, mode, bytes);
    if (!p->following) return;
    const plan_entry *e = p->cursor < p->nplan ? &p->plan[p->cursor] : NULL;
    if (k && e && e->key == key && e->mode == mode && e->bytes == bytes) {
        p->cursor++;
        spw__stat_event(&p->ctx->stats.plan_hits);
    } else {
        p->following = false;
        spw__stat_event(&p->ctx->stats.plan_divergences);
    }
}

static void plan_on_acquire(spw_policy *p, spw_buf *b, spw_access mode, spw_stream s, unsigned count) {
    spw__policy_lru.on_acquire(p->lru, b, mode, s, count);
    kbuf *k = kb_of(b);
    if (k && k->prefetched) {
        k->prefetched = false;
        spw__stat_add(&p->ctx->stats.plan_prefetch_used, (int64_t)spw__pol_bytes(b));
    }
    if (k && k->early) {
        k->early = false;
        p->early--;
    }
    note_access(p, k, mode, spw__pol_bytes(b));
}

/* A host read is an access like an acquisition (READ): so that data the host reads between
 * steps is never taken for dead. */
static void plan_on_host_read(spw_policy *p, spw_buf *b) {
    note_access(p, kb_of(b), SPW_ACCESS_READ, spw__pol_bytes(b));
}

static void plan_on_release(spw_policy *p, spw_buf *b, spw_stream s, unsigned count) {
    spw__policy_lru.on_release(p->lru, b, s, count);
}

static void plan_on_resident(spw_policy *p, spw_buf *b) { spw__policy_lru.on_resident(p->lru, b); }

static void plan_on_evicted(spw_policy *p, spw_buf *b) {
    spw__policy_lru.on_evicted(p->lru, b);
    kbuf *k = kb_of(b);
    if (k && k->prefetched) {
        k->prefetched = false;
        spw__stat_add(&p->ctx->stats.plan_prefetch_wasted, (int64_t)spw__pol_bytes(b));
    }
    if (k && k->early) {
        k->early = false;
        p->early--;
    }
}

/* ---- decisions ---- */

static uint64_t distance(const spw_policy *p, spw_buf *b, spw_access *mode) {
    kbuf *k = kb_of(b);
    return k ? next_use(p, k->key, mode) : FAR;
}

/* A demand load of a buffer that is not the plan's next entry: the program left the plan. Seen
 * here, before room is made, so no eviction is decided by a plan already proven wrong. */
static void check_incoming(spw_policy *p, spw_buf *incoming) {
    if (!predicting(p) || !incoming || p->cursor >= p->nplan) return;
    kbuf *k = kb_of(incoming);
    if (k && k->key == p->plan[p->cursor].key) return;
    p->following = false;
    spw__stat_event(&p->ctx->stats.plan_divergences);
}

/* Buffers a victim choice leaves out: none, the target set (a rebase), the fixed set (STATIC). */
enum { SKIP_NONE, SKIP_TARGET, SKIP_FIXED };

/* b may be a victim at all: not incoming, evictable, and clean while prefetching between steps. */
static bool candidate(const spw_policy *p, spw_buf *b, const spw_buf *incoming) {
    return b != incoming && spw__pol_evictable(b) && !(p->ahead && spw__pol_dirty(b));
}

/* Free to evict: nothing to write back, or the next access (at distance d, mode) overwrites it. */
static bool free_to_evict(spw_buf *b, uint64_t d, spw_access mode) {
    return !spw__pol_dirty(b) || (d != FAR && mode == SPW_ACCESS_WRITE);
}

/* The distance below which a prefetch for a buffer used din ahead may not take a victim (see
 * plan_choose_victim): 0 where an early slot is free or a split is in force. */
static uint64_t prefetch_floor(const spw_policy *p, uint64_t din, bool split) {
    return p->pf_early || split ? 0 : p->pf_own ? p->pf_floor : window_floor(p, din);
}

/* The evictable buffer used farthest ahead (Belady), leaving out `skip`; with `prefer_free`,
 * among nearly as distant ones, one that costs no write-back. *dist: its distance. */
static spw_buf *farthest(spw_policy *p, spw_buf *incoming, int skip, bool prefer_free, uint64_t *dist) {
    spw_buf *best = NULL, *free_best = NULL;
    uint64_t best_d = 0, free_d = 0;
    for (spw_buf *b = spw__pol_first(p->ctx); b; b = spw__pol_next(b)) {
        kbuf *k = kb_of(b);
        if (!candidate(p, b, incoming)) continue;
        if (k && ((skip == SKIP_TARGET && k->target) || (skip == SKIP_FIXED && k->fixed))) continue;
        spw_access mode = SPW_ACCESS_READ;
        uint64_t d = distance(p, b, &mode);
        bool free_evict = free_to_evict(b, d, mode);
        if (!best || d > best_d) {
            best = b;
            best_d = d;
        }
        if (free_evict && (!free_best || d > free_d)) {
            free_best = b;
            free_d = d;
        }
    }
    /* Belady counts every eviction alike; a write-back costs a transfer too. A victim that
     * costs nothing and is needed not much sooner than the farthest one is the better buy. */
    if (prefer_free && free_best && free_best != best && free_d >= best_d - best_d / FREE_VICTIM_SLACK) {
        best = free_best;
        best_d = free_d;
    }
    *dist = best_d;
    return best;
}

static spw_buf *plan_choose_victim(spw_policy *p, size_t need, spw_buf *incoming, int for_prefetch) {
    uint64_t best_d;
    if (p->rebasing) return farthest(p, incoming, SKIP_TARGET, false, &best_d);
    if (p->taking_up) return farthest(p, incoming, SKIP_FIXED, false, &best_d);
    if (!for_prefetch) check_incoming(p, incoming);
    if (!predicting(p)) return spw__policy_lru.choose_victim(p->lru, need, incoming, for_prefetch);
    /* decline hints where room for one transfer is all there is: a hint for a buffer beyond the
     * next would displace the next */
    if (for_prefetch && !p->pf_own && (p->early_max == PF_OFF || p->early_max == PF_SLOT)) return NULL;
    bool split = spw__plan_fixed_pipeline(p->early_max); /* the fixed set only as a last resort */
    spw_buf *best = farthest(p, incoming, split ? SKIP_FIXED : SKIP_NONE, true, &best_d);
    if (!best && split && !for_prefetch) /* a demand load must not fail for the split */
        best = farthest(p, incoming, SKIP_NONE, true, &best_d);
    if (for_prefetch && best) {
        /* never push out something needed no later than what the prefetch brings in, nor
         * something that a buffer used before then will outlast (that one is the better
         * victim, once it has been used: prefetching now would only displace it) */
        uint64_t din = incoming ? distance(p, incoming, NULL) : FAR;
        if (best_d <= din || best_d < prefetch_floor(p, din, split)) return NULL;
    }
    return best;
}

static uint64_t plan_rank_victim(spw_policy *p, spw_buf *b, spw_buf *incoming, int for_prefetch) {
    /* The splits place their room themselves (a fixed set, the rest in one piece, an upload
     * beside the buffer it replaces): a run of other victims would break what they time. */
    if (p->taking_up || spw__plan_fixed_pipeline(p->early_max)) return 0;
    if (!predicting(p) && !p->rebasing)
        return spw__policy_lru.rank_victim(p->lru, b, incoming, for_prefetch);
    if (!candidate(p, b, incoming)) return 0;
    kbuf *k = kb_of(b);
    spw_access mode = SPW_ACCESS_READ;
    uint64_t d = distance(p, b, &mode);
    uint64_t r = d >= FAR - 1 ? FAR : d + 1;
    /* as farthest(): a victim that costs a write-back is worth one nearly as distant that does not */
    if (!free_to_evict(b, d, mode)) r = SPW_MAX(r - r / FREE_VICTIM_SLACK - 1, 2);
    if (p->rebasing) return k && k->target ? 0 : r;
    if (for_prefetch && !p->pf_own && p->early_max == PF_OFF) return 0; /* as choose_victim (SLOT left above) */
    if (for_prefetch) {
        /* choose_victim's test, its figures computed once for every block of a window search */
        if (!p->rk_set || p->rk_in != incoming || p->rk_cursor != p->cursor || p->rk_pf_own != p->pf_own ||
            p->rk_pf_floor != p->pf_floor || p->rk_pf_early != p->pf_early) {
            p->rk_din = incoming ? distance(p, incoming, NULL) : FAR;
            p->rk_floor = prefetch_floor(p, p->rk_din, false);
            p->rk_in = incoming, p->rk_cursor = p->cursor, p->rk_pf_own = p->pf_own, p->rk_pf_floor = p->pf_floor;
            p->rk_pf_early = p->pf_early;
            p->rk_set = true;
        }
        if (d <= p->rk_din || d < p->rk_floor) return 0;
    }
    return r;
}

static bool plan_ring_member(spw_policy *p, spw_buf *b) {
    if (p->taking_up || p->rebasing || !predicting(p) || p->early_max != PF_STATIC) return false;
    kbuf *k = kb_of(b);
    return k && !k->fixed;
}

static int plan_ring_victim(spw_policy *p, spw_buf *v, spw_buf *incoming, int for_prefetch) {
    kbuf *k = kb_of(v);
    if (!k || k->fixed || v == incoming) return 0;
    if (!candidate(p, v, incoming)) return for_prefetch ? -1 : 0;
    if (for_prefetch && incoming && distance(p, v, NULL) <= distance(p, incoming, NULL)) return -1;
    return 1;
}

static int plan_need_writeback(spw_policy *p, spw_buf *b) {
    if (!predicting(p)) return 1;
    spw_access mode;
    uint64_t d = distance(p, b, &mode);
    return !(d != FAR && mode == SPW_ACCESS_WRITE);
}

/* Prefetch the next missing buffers of the plan while that keeps the schedule optimal. A victim
 * must be needed later than every buffer used between now and the prefetched one's use (each
 * of those will be a candidate when it is released). The buffers the caller holds right now
 * are exempt: that one exemption is the double buffer that lets the transfer of the next
 * buffer overlap the work on the current one. */
static void prefetch_window(spw_policy *p, spw_ctx *ctx, bool after_acquire) {
    if (!after_acquire) { /* a step begins or ends: the fixed set follows the plan and the pipeline in force */
        spw__plan_fix_for_pipeline(p);
        /* a ring's fixed set is placed in one run when its pipeline comes into force; later its
         * displaced buffers only come back (wherever there is room: the ring steps over them) */
        if (p->early_max == PF_STATIC && spw__pol_ring(ctx)) spw__plan_take_up_fixed(p, ctx, p->ring_prev != PF_STATIC);
        p->ring_prev = p->early_max;
        if (p->early_max == PF_SLOT) {
            p->slot_step_broken |= spw__plan_take_up_fixed(p, ctx, false);
            if (p->in_step) { /* a step begins: judge the one that ended */
                bool broken = p->slot_step_broken || ctx->stats.trim_syncs.total > p->trims_seen;
                p->slot_step_broken = false;
                if (p->trial < 0) {
                    p->slot_broken = (uint8_t)(p->slot_broken << 1 | broken);
                    if (__builtin_popcount(p->slot_broken) >= SLOT_BROKEN_OF_8) spw__plan_leave_slot(p);
                }
            }
        }
        if (p->in_step) p->trims_seen = ctx->stats.trim_syncs.total;
    }
    size_t n = SPW_MIN(p->nplan, (size_t)LOOKAHEAD_MAX);
    uint64_t floor = 0; /* max over the window so far of the next use after that use */
    for (size_t i = 0; i < n; i++) {
        size_t at = p->cursor + i;
        const plan_entry *e = &p->plan[at % p->nplan];
        kbuf *k = NULL;
        HASH_FIND(hh, p->by_key, &e->key, sizeof(uint64_t), k);
        if (k && e->mode != SPW_ACCESS_WRITE && !spw__pol_resident(k->buf) && !spw__pol_acquired(k->buf)) {
            p->pf_floor = floor;
            p->pf_own = true;
            spw_status st = spw__engine_prefetch(ctx, k->buf, 1);
            if (st == SPW_ERR_OUT_OF_MEMORY && p->early < p->early_max) {
                p->pf_early = true; /* the floor refused: spend an early slot */
                st = spw__engine_prefetch(ctx, k->buf, 1);
                p->pf_early = false;
                if (st == SPW_OK && spw__pol_resident(k->buf)) {
                    k->early = true;
                    p->early++;
                }
            }
            p->pf_own = false;
            if (st == SPW_ERR_OUT_OF_MEMORY) spw__error_clear();
            if (st != SPW_OK || !spw__pol_resident(k->buf)) break; /* wait for a better moment */
            k->prefetched = true;
            spw__stat_add(&p->ctx->stats.plan_prefetch_bytes, (int64_t)spw__pol_bytes(k->buf));
        }
        floor = SPW_MAX(floor, reuse_after_entry(p, at));
    }
}

static void plan_prefetch(spw_policy *p, spw_ctx *ctx, bool after_acquire) {
    if (p->rebase_due && !after_acquire) spw__plan_rebase(p, ctx); /* at the first plan's step_end or step_begin */
    if (!spw__plan_prefetching(p->ctx) || p->early_max == PF_OFF) return;
    /* Between steps (after step_end) a confirmed plan is taken to start over: the transfers that
     * open the next step are issued now, while the caller waits for this one, as a hand-written
     * loop keeps its copies in flight across the step boundary. Only clean victims then (the
     * caller may still read what the step wrote). */
    p->ahead = !after_acquire && !p->in_step && p->confirmed && p->nplan && p->index;
    if (p->ahead) {
        p->cursor = 0;
        p->following = true;
    }
    if (predicting(p)) prefetch_window(p, ctx, after_acquire);
    if (p->ahead) p->following = false;
    p->ahead = false;
}

/* STATIC streams through room for two of the plan's largest buffers: each streamed buffer asks
 * for a block of that size, so that in whole segments every upload takes the block the one it
 * replaces left, where a block of its own size would first need a trim (every cached segment
 * returned, the device drained) whenever the streamed sizes differ. The room holds the same two
 * buffers either way; the fixed set keeps blocks of its own sizes. */
static size_t plan_block_bytes(spw_policy *p, spw_buf *b) {
    size_t n = spw__pol_bytes(b);
    kbuf *k = kb_of(b);
    if (!p->slot_bytes || p->early_max != PF_STATIC || !k || k->fixed || n >= p->slot_bytes) return n;
    kpos *e = NULL;
    HASH_FIND(hh, p->index, &k->key, sizeof(uint64_t), e);
    return e ? p->slot_bytes : n;
}

const spw_policy_ops spw__policy_plan = {
    .name = "plan",
    .create = plan_create,
    .destroy = plan_destroy,
    .on_create = plan_on_create,
    .on_destroy = plan_on_destroy,
    .on_acquire = plan_on_acquire,
    .on_release = plan_on_release,
    .on_resident = plan_on_resident,
    .on_evicted = plan_on_evicted,
    .on_host_read = plan_on_host_read,
    .step_begin = plan_step_begin,
    .step_end = plan_step_end,
    .time_steps = spw__plan_time_steps,
    .choose_victim = plan_choose_victim,
    .rank_victim = plan_rank_victim,
    .need_writeback = plan_need_writeback,
    .prefetch = plan_prefetch,
    .block_bytes = plan_block_bytes,
    .ring_member = plan_ring_member,
    .ring_victim = plan_ring_victim,
    .describe = spw__plan_describe,
};
