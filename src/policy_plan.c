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
 * SLOT. Which pipeline runs (no prefetch, the double buffer, STATIC, SLOT) is chosen here by
 * timing steps, and SLOT is left here when its room does not hold.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy_plan.h"
#include "size.h"

_Thread_local int spw__plan_hash_oom;

/* Pipelines tried by prefetch_early=auto, in order (see PF_OFF, PF_STATIC, PF_SLOT). The splits
 * go first: they place their room from the start (a fixed set, the rest in one piece), which the
 * layout left by the others (runs of victims anywhere) would spoil, so that they would time
 * trims rather than themselves; the others take any layout. */
static const int EARLY_TRIALS[N_TRIALS] = {PF_STATIC, PF_SLOT, PF_OFF, 0};

/* The trial index of pipeline mode. */
static int trial_of(int mode) {
    for (int i = 0; i < N_TRIALS; i++)
        if (EARLY_TRIALS[i] == mode) return i;
    return 0;
}

/* Pipelines with a fixed set. */
static bool fixed_pipeline(int mode) { return mode == PF_STATIC || mode == PF_SLOT; }

/* Mark the fixed set of the pipeline in force, or none. */
static void fix_for_pipeline(spw_policy *p) {
    if (fixed_pipeline(p->early_max)) spw__plan_choose_fixed(p, p->early_max);
    else spw__plan_clear_fixed(p);
}


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

/* Whether the policy prefetches at all. prefetch=auto: a double buffer buys overlap only where a
 * transfer takes time; on the instant emulated device it would only cost a buffer of room. */
static bool prefetching(const spw_ctx *ctx) {
    spw_tristate pf = ctx->cfg.prefetch;
    return pf == SPW_TRI_ON || (pf == SPW_TRI_AUTO && !ctx->dev.emulated);
}

/* prefetch_early=auto where prefetch runs: the pipeline is chosen by timing steps. */
static bool auto_pipeline(const spw_ctx *ctx) { return ctx->cfg.prefetch_early < 0 && prefetching(ctx); }

/* A pipeline was chosen by timing and is in force (then rechecked); false while timing. */
static bool chosen_by_timing(const spw_policy *p) {
    return p->trial < 0 && auto_pipeline(p->ctx) && !p->all_fit && !p->diverging;
}

static spw_status plan_create(spw_ctx *ctx, spw_policy **out) {
    spw_policy *p = calloc(1, sizeof *p);
    if (!p) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "policy plan: out of host memory");
    spw_status st = spw__policy_lru.create(ctx, &p->lru);
    if (st) {
        free(p);
        return st;
    }
    p->ctx = ctx;
    /* the trial runs only where prefetch is on; elsewhere (off, or auto on the instant emu)
     * the early depth has no effect beyond user hints, judged by the floor rule */
    bool tune = auto_pipeline(ctx);
    p->trial = tune ? 0 : -1;
    p->early_max = tune ? EARLY_TRIALS[0] : SPW_MAX(ctx->cfg.prefetch_early, 0);
    *out = p;
    return SPW_OK;
}

/* Pipeline trials and rechecks compare step times, which must be the steps' device time. */
static bool plan_time_steps(spw_policy *p) {
    return p->trial >= 0 || (chosen_by_timing(p) && (p->since_tuned + 2) % RECHECK_EVERY < 2);
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

/* Uploads so far (what the simulation below counts; write-backs are the same in every pipeline). */
static uint64_t bytes_moved(const spw_policy *p) { return (uint64_t)p->ctx->stats.bytes_h2d.total; }

/* The long-run bytes a step of pipeline `mode` moves, for the step just timed. Belady's cycle
 * moves a different number of buffers from step to step (a cyclic scan of N buffers with room for
 * C moves N(N-C)/(N-1) on average: some steps one more, some one less), so one timed step can be
 * a lucky one; its time is scaled to the average the cycle settles to (simulated over the plan,
 * for no prefetch with all the room, for the double buffer with a buffer of room less). STATIC
 * moves the same set every step. */
static double expected_bytes(spw_policy *p, int mode, uint64_t timed) {
    if (fixed_pipeline(mode) || !timed) return (double)timed;
    size_t cap = spw__plan_capacity(p), largest = spw__plan_largest(p);
    double e = spw__plan_belady_bytes(p, mode == PF_OFF ? cap : cap > largest ? cap - largest : 0, 16);
    return e > 0 ? e : (double)timed;
}

/* The step writes buffers (activations kept for backward, written in the forward and read in
 * the backward): a split's premise, one fixed cycle of reads whose room it places itself, does
 * not hold, and with the windows it turns off every write-back there would wait on a trim. */
static bool plan_writes(const spw_policy *p) {
    for (size_t i = 0; i < p->nplan; i++)
        if (p->plan[i].mode == SPW_ACCESS_WRITE) return true;
    return false;
}

/* Move the trials past the splits where the plan writes; a trial left out is not compared. */
static void skip_split_trials(spw_policy *p) {
    if (p->trial < 0 || p->trial >= N_TRIALS || !fixed_pipeline(EARLY_TRIALS[p->trial]) || !plan_writes(p)) return;
    while (p->trial < N_TRIALS - 1 && fixed_pipeline(EARLY_TRIALS[p->trial])) p->trials_left_out |= 1u << p->trial++;
    p->trial_step = 0;
    p->early_max = EARLY_TRIALS[p->trial];
    fix_for_pipeline(p);
}

static void trials_start(spw_policy *p) {
    p->trial = 0;
    p->trials_left_out = 0;
    p->trials_cut = 0;
    p->trial_step = 0;
    memset(p->trial_ns, 0, sizeof p->trial_ns);
    memset(p->trial_t, 0, sizeof p->trial_t);
    p->early_max = EARLY_TRIALS[0];
    p->slot_left = false;
    p->diverged = 0;
    p->diverging = false;
}

/* The step that just ended, when it began right after a step that ended waiting (RECHECK_EVERY):
 * timed as a trial step, against the chosen pipeline's trial time. */
static void recheck(spw_policy *p, uint64_t now) {
    uint32_t n = ++p->since_tuned;
    if (n % RECHECK_EVERY || !p->last_exact || !p->step_t0) return;
    double step = (double)(now - p->step_t0);
    double chosen = (double)p->trial_ns[p->chosen];
    if (step > chosen * RETUNE_RATIO || step * RETUNE_RATIO < chosen) {
        p->retunes++;
        trials_start(p);
    }
}

/* The fastest of the first n trials as compared (trial_t), leaving out those not tried and
 * trial `skip` (-1: none); -1 if none is left. */
static int fastest_trial(const spw_policy *p, int n, int skip) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (i != skip && !(p->trials_left_out >> i & 1) && (best < 0 || p->trial_t[i] < p->trial_t[best])) best = i;
    return best;
}

static int64_t evictions(const spw_policy *p) {
    return p->ctx->stats.evictions_clean.total + p->ctx->stats.evictions_dirty.total;
}

/* prefetch_early=auto with a plan whose buffers all fit the capacity and a step that evicted
 * nothing: nothing streams, whichever pipeline runs, so none is timed (a split's trial steps
 * would pay for its layout, and every trial step ends waiting, for nothing); the double buffer
 * stays. The capacity is measured between steps: allocations made during a step (PyTorch's,
 * under use_allocator) that push the plan's buffers out show as evictions. A plan that stops
 * fitting (the capacity shrank, the plan grew, something evicted) starts the trials. True while
 * everything fits. */
static bool trials_skipped(spw_policy *p) {
    if (!auto_pipeline(p->ctx) || !p->nplan || !p->index) return false;
    bool fit = evictions(p) == p->evictions0 && spw__plan_total(p) <= spw__plan_capacity(p);
    if (fit && !p->all_fit) {
        p->all_fit = true;
        p->trial = -1;
        p->chosen = trial_of(0);
        p->early_max = 0;
        fix_for_pipeline(p);
    } else if (!fit && p->all_fit) {
        p->all_fit = false;
        trials_start(p);
    }
    return fit;
}

/* DIVERGED_STEPS: the trials stop after that many steps in a row left their plan, and start
 * again with the first step after that follows its plan. True while they are stopped. */
static bool diverged_steps(spw_policy *p) {
    if (p->diverging && p->last_exact) trials_start(p); /* clears diverging */
    if (p->diverging || p->trial < 0 || p->diverged < DIVERGED_STEPS) return p->diverging;
    p->diverging = true;
    p->trial = -1;
    p->trial_step = 0;
    p->early_max = 0;
    p->chosen = trial_of(0);
    fix_for_pipeline(p);
    return true;
}

/* prefetch_early=auto: the steps of a trial that followed their plan to the end are timed, from
 * their step_begin to the next one, and end waiting for their device work (time_steps), so the
 * time is the device's even for a caller that never waits. A timed step is scaled to the bytes its
 * pipeline moves in the long run (expected_bytes). After the last trial the fastest pipeline
 * stays, rechecked every RECHECK_EVERY steps. A step that diverged says nothing and is retried. */
static void tune_early(spw_policy *p, uint64_t now) {
    if (trials_skipped(p)) return;
    if (diverged_steps(p)) return;
    if (chosen_by_timing(p)) recheck(p, now);
    skip_split_trials(p);
    if (p->trial < 0 || !p->step_t0 || !p->last_exact) return;
    uint64_t ns = now - p->step_t0;
    int k = p->trial_step++;
    if (k < TRIAL_STEPS - 1) { /* the settle step */
        p->settle_ns = ns;
        int f = fastest_trial(p, p->trial, -1); /* every trial before this one was timed */
        if (f < 0 || (double)ns <= SETTLE_CUT * p->trial_t[f]) return;
        p->trial_t[p->trial] = (double)ns; /* cut: slower than that, it cannot be chosen */
        p->trial_ns[p->trial] = ns;
        p->trials_cut |= 1u << p->trial;
    } else {
        uint64_t b = bytes_moved(p) - p->step_bytes0;
        double e = expected_bytes(p, EARLY_TRIALS[p->trial], b);
        double t = (double)ns * (b > 0 ? e / (double)b : 1.0);
        if (k == TRIAL_STEPS - 1 || t < p->trial_t[p->trial]) {
            p->trial_t[p->trial] = t;
            p->trial_ns[p->trial] = ns;
        }
        if (k == TRIAL_STEPS - 1 && t > (double)p->settle_ns) return; /* a hiccup: timed once more */
    }
    p->trial_step = 0;
    if (++p->trial < N_TRIALS) {
        p->early_max = EARLY_TRIALS[p->trial];
        return;
    }
    int best = fastest_trial(p, N_TRIALS, -1); /* no prefetch and the double buffer are always tried */
    double best_t = p->trial_t[best];
    /* timed again: the pipeline in force stays unless clearly beaten */
    if (p->retunes && best != p->chosen && !(best_t < RETIME_MARGIN * p->trial_t[p->chosen])) best = p->chosen;
    p->early_max = EARLY_TRIALS[best];
    p->trial = -1;
    p->slot_broken = 0;
    p->chosen = best;
    p->since_tuned = 0;
}

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
    tune_early(p, now);
    p->evictions0 = evictions(p);
    p->last_exact = false;
    p->step_t0 = now;
    p->step_bytes0 = bytes_moved(p);
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
    bool split = fixed_pipeline(p->early_max); /* the fixed set only as a last resort */
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
    if (p->taking_up || fixed_pipeline(p->early_max)) return 0;
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

static int plan_need_writeback(spw_policy *p, spw_buf *b) {
    if (!predicting(p)) return 1;
    spw_access mode;
    uint64_t d = distance(p, b, &mode);
    return !(d != FAR && mode == SPW_ACCESS_WRITE);
}

/* SLOT's premise keeps breaking (SLOT_BROKEN_OF_8): take the fastest other pipeline of the
 * timing (the first listed when nothing was timed). */
static void leave_slot(spw_policy *p) {
    int best = fastest_trial(p, N_TRIALS, trial_of(PF_SLOT));
    p->early_max = EARLY_TRIALS[best];
    p->chosen = best;
    p->slot_left = true;
    fix_for_pipeline(p);
}

/* Prefetch the next missing buffers of the plan while that keeps the schedule optimal. A victim
 * must be needed later than every buffer used between now and the prefetched one's use (each
 * of those will be a candidate when it is released). The buffers the caller holds right now
 * are exempt: that one exemption is the double buffer that lets the transfer of the next
 * buffer overlap the work on the current one. */
static void prefetch_window(spw_policy *p, spw_ctx *ctx, bool after_acquire) {
    if (!after_acquire) { /* a step begins or ends: the fixed set follows the plan and the pipeline in force */
        fix_for_pipeline(p);
        if (p->early_max == PF_SLOT) {
            p->slot_step_broken |= spw__plan_take_up_fixed(p, ctx);
            if (p->in_step) { /* a step begins: judge the one that ended */
                bool broken = p->slot_step_broken || ctx->stats.trim_syncs.total > p->trims_seen;
                p->slot_step_broken = false;
                if (p->trial < 0) {
                    p->slot_broken = (uint8_t)(p->slot_broken << 1 | broken);
                    if (__builtin_popcount(p->slot_broken) >= SLOT_BROKEN_OF_8) leave_slot(p);
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
    if (!prefetching(p->ctx) || p->early_max == PF_OFF) return;
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

/* ---- the summary line ---- */

static const char *pipeline_name(int mode) {
    return mode == PF_OFF      ? "no prefetch"
           : mode == PF_STATIC ? "static split"
           : mode == PF_SLOT   ? "split with one slot"
           : mode == 0         ? "double buffer"
                               : "early prefetch";
}

/* Pipeline `mode`'s trial step as timed, in ms. */
static double trial_ms(const spw_policy *p, int mode) { return (double)p->trial_ns[trial_of(mode)] / 1e6; }

static void plan_describe(spw_policy *p, char *buf, size_t len) {
    spw_tristate pf = p->ctx->cfg.prefetch;
    if (!p->nplan) {
        snprintf(buf, len, "policy plan: no plan yet (a step is recorded under LRU, then followed)");
        return;
    }
    int w = snprintf(buf, len, "policy plan: %zu acquisition%s a step; ", p->nplan, p->nplan == 1 ? "" : "s");
    if (w < 0 || (size_t)w >= len) return;
    char *b = buf + w;
    size_t n = len - (size_t)w;
    if (!prefetching(p->ctx)) {
        snprintf(b, n, "no prefetch (%s)", pf == SPW_TRI_OFF ? "prefetch=off" : "emu: no transfer time to hide");
    } else if (p->all_fit) {
        char tot[SPW_SIZE_FMT_MAX], cap[SPW_SIZE_FMT_MAX];
        snprintf(b, n, "pipeline double buffer; everything fits (%s of %s): no pipeline timed",
                 spw__size_format(tot, sizeof tot, spw__plan_total(p)),
                 spw__size_format(cap, sizeof cap, spw__plan_capacity(p)));
    } else if (p->diverging) {
        snprintf(b, n, "pipeline double buffer; the steps leave their plan (%u in a row): no pipeline timed",
                 p->diverged);
    } else if (p->trial >= 0) {
        snprintf(b, n, "timing pipelines: %s now (%d of %d)%s", pipeline_name(p->early_max), p->trial + 1, N_TRIALS,
                 p->retunes ? ", again: the step time moved" : "");
    } else if (chosen_by_timing(p) && p->trials_left_out) {
        snprintf(b, n, "pipeline %s, chosen by timing (a step: no prefetch %.1f ms, double buffer %.1f ms; "
                       "the splits not tried: the step writes buffers)", pipeline_name(p->early_max),
                 trial_ms(p, PF_OFF), trial_ms(p, 0));
    } else if (chosen_by_timing(p)) {
        snprintf(b, n, "pipeline %s, chosen by timing (a step: no prefetch %.1f ms, double buffer %.1f ms, "
                       "static split %.1f ms, split with one slot %.1f ms)%s", pipeline_name(p->early_max),
                 trial_ms(p, PF_OFF), trial_ms(p, 0), trial_ms(p, PF_STATIC), trial_ms(p, PF_SLOT),
                 p->slot_left ? "; the split with one slot was left: its room did not hold" : "");
        for (int i = 0, first = 1; i < N_TRIALS; i++) {
            if (!(p->trials_cut >> i & 1)) continue;
            size_t used = strlen(b);
            snprintf(b + used, n - used, "%s%s", first ? "; timed by its settle step alone: " : ", ",
                     pipeline_name(EARLY_TRIALS[i]));
            first = 0;
        }
        if (p->retunes) {
            size_t used = strlen(b);
            snprintf(b + used, n - used, "; timed again after the step time moved (%u so far)", p->retunes);
        }
    } else {
        snprintf(b, n, "prefetch with %d early (prefetch_early)", p->early_max);
    }
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
    .time_steps = plan_time_steps,
    .choose_victim = plan_choose_victim,
    .rank_victim = plan_rank_victim,
    .need_writeback = plan_need_writeback,
    .prefetch = plan_prefetch,
    .block_bytes = plan_block_bytes,
    .describe = plan_describe,
};
