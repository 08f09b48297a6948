/*
 * Which pipeline the plan policy runs (prefetch_early=auto): each is timed over whole steps that
 * follow their plan, the fastest is kept and rechecked, and the summary line says what runs and
 * why. The pipelines themselves, and what each keeps where, are policy_plan.c's and
 * policy_plan_layout.c's; the constants and their reasons are in policy_plan.h.
 */
#include <stdio.h>
#include <string.h>

#include "policy_plan.h"
#include "size.h"

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
bool spw__plan_fixed_pipeline(int mode) { return mode == PF_STATIC || mode == PF_SLOT; }

/* Mark the fixed set of the pipeline in force, or none. */
void spw__plan_fix_for_pipeline(spw_policy *p) {
    if (spw__plan_fixed_pipeline(p->early_max)) spw__plan_choose_fixed(p, p->early_max);
    else spw__plan_clear_fixed(p);
}

/* Whether the policy prefetches at all. prefetch=auto: a double buffer buys overlap only where a
 * transfer takes time; on the instant emulated device it would only cost a buffer of room. */
bool spw__plan_prefetching(const spw_ctx *ctx) {
    spw_tristate pf = ctx->cfg.prefetch;
    return pf == SPW_TRI_ON || (pf == SPW_TRI_AUTO && !ctx->dev.emulated);
}

/* prefetch_early=auto where prefetch runs and no pipeline is named: the pipeline is chosen by
 * timing steps. */
static bool auto_pipeline(const spw_ctx *ctx) {
    return !ctx->cfg.pipeline && ctx->cfg.prefetch_early < 0 && spw__plan_prefetching(ctx);
}

/* The pipeline option's names, by its value (0: auto, timed). */
static const int NAMED_PIPELINES[] = {0, PF_OFF, 0, PF_STATIC, PF_SLOT};

/* A pipeline was chosen by timing and is in force (then rechecked); false while timing. */
static bool chosen_by_timing(const spw_policy *p) {
    return p->trial < 0 && auto_pipeline(p->ctx) && !p->all_fit && !p->diverging;
}

/* Pipeline trials and rechecks compare step times, which must be the steps' device time. */
bool spw__plan_time_steps(spw_policy *p) {
    return p->trial >= 0 || (chosen_by_timing(p) && (p->since_tuned + 2) % RECHECK_EVERY < 2);
}

/* Uploads so far (what the simulation below counts; write-backs are the same in every pipeline). */
uint64_t spw__plan_bytes_moved(const spw_policy *p) { return (uint64_t)p->ctx->stats.bytes_h2d.total; }

/* The long-run bytes a step of pipeline `mode` moves, for the step just timed. Belady's cycle
 * moves a different number of buffers from step to step (a cyclic scan of N buffers with room for
 * C moves N(N-C)/(N-1) on average: some steps one more, some one less), so one timed step can be
 * a lucky one; its time is scaled to the average the cycle settles to (simulated over the plan,
 * for no prefetch with all the room, for the double buffer with a buffer of room less). STATIC
 * moves the same set every step. */
static double expected_bytes(spw_policy *p, int mode, uint64_t timed) {
    if (spw__plan_fixed_pipeline(mode) || !timed) return (double)timed;
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

/* Run trial i from its settle step. */
static void enter_trial(spw_policy *p, int i) {
    p->trial = i;
    p->trial_step = 0;
    p->early_max = EARLY_TRIALS[i];
    spw__plan_fix_for_pipeline(p);
}

/* Run the double buffer, no trial open (everything fits, or the steps leave their plan). */
static void untimed_double_buffer(spw_policy *p) {
    p->trial = -1;
    p->trial_step = 0;
    p->chosen = trial_of(0);
    p->early_max = 0;
    spw__plan_fix_for_pipeline(p);
}

/* Move the trials past the splits where the plan writes; a trial left out is not compared. */
static void skip_split_trials(spw_policy *p) {
    if (p->trial < 0 || p->trial >= N_TRIALS || !spw__plan_fixed_pipeline(EARLY_TRIALS[p->trial]) || !plan_writes(p)) return;
    while (p->trial < N_TRIALS - 1 && spw__plan_fixed_pipeline(EARLY_TRIALS[p->trial])) p->trials_left_out |= 1u << p->trial++;
    enter_trial(p, p->trial);
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

int64_t spw__plan_evictions(const spw_policy *p) {
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
    bool fit = spw__plan_evictions(p) == p->evictions0 && spw__plan_total(p) <= spw__plan_capacity(p);
    if (fit && !p->all_fit) {
        p->all_fit = true;
        untimed_double_buffer(p);
    } else if (!fit && p->all_fit) {
        p->all_fit = false;
        trials_start(p);
    }
    return fit;
}

/* DIVERGED_STEPS: the trials pause after that many steps in a row left their plan, and go on
 * from the pipeline they paused at (its settle step again: the double buffer ran meanwhile)
 * with the first step after that follows its plan; what was timed before stays. True while
 * they are paused. */
static bool diverged_steps(spw_policy *p) {
    if (p->diverging && p->last_exact) {
        p->diverging = false;
        enter_trial(p, p->paused_trial);
        return false;
    }
    if (p->diverging || p->trial < 0 || p->diverged < DIVERGED_STEPS) return p->diverging;
    p->diverging = true;
    p->paused_trial = p->trial;
    untimed_double_buffer(p);
    return true;
}

/* prefetch_early=auto: the steps of a trial that followed their plan to the end are timed, from
 * their step_begin to the next one, and end waiting for their device work (time_steps), so the
 * time is the device's even for a caller that never waits. A timed step is scaled to the bytes its
 * pipeline moves in the long run (expected_bytes). After the last trial the fastest pipeline
 * stays, rechecked every RECHECK_EVERY steps. A step that diverged says nothing and is retried. */
void spw__plan_tune(spw_policy *p, uint64_t now) {
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
        uint64_t b = spw__plan_bytes_moved(p) - p->step_bytes0;
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

/* SLOT's premise keeps breaking (SLOT_BROKEN_OF_8): take the fastest other pipeline of the
 * timing (the first listed when nothing was timed). */
void spw__plan_leave_slot(spw_policy *p) {
    int best = fastest_trial(p, N_TRIALS, trial_of(PF_SLOT));
    p->early_max = EARLY_TRIALS[best];
    p->chosen = best;
    p->slot_left = true;
    spw__plan_fix_for_pipeline(p);
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

void spw__plan_describe(spw_policy *p, char *buf, size_t len) {
    spw_tristate pf = p->ctx->cfg.prefetch;
    if (!p->nplan) {
        snprintf(buf, len, "policy plan: no plan yet (a step is recorded under LRU, then followed)");
        return;
    }
    int w = snprintf(buf, len, "policy plan: %zu acquisition%s a step; ", p->nplan, p->nplan == 1 ? "" : "s");
    if (w < 0 || (size_t)w >= len) return;
    char *b = buf + w;
    size_t n = len - (size_t)w;
    if (!spw__plan_prefetching(p->ctx)) {
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
    } else if (p->ctx->cfg.pipeline) {
        snprintf(b, n, "pipeline %s, as named (pipeline)%s", pipeline_name(p->early_max),
                 p->slot_left ? "; the split with one slot was left: its room did not hold" : "");
    } else {
        snprintf(b, n, "prefetch with %d early (prefetch_early)", p->early_max);
    }
}

void spw__plan_trials_init(spw_policy *p) {
    /* the trial runs only where prefetch is on; elsewhere (off, or auto on the instant emu)
     * the early depth has no effect beyond user hints, judged by the floor rule */
    bool tune = auto_pipeline(p->ctx);
    int named = spw__plan_prefetching(p->ctx) ? NAMED_PIPELINES[p->ctx->cfg.pipeline] : 0;
    p->trial = tune ? 0 : -1;
    p->early_max = tune ? EARLY_TRIALS[0] : named ? named : SPW_MAX(p->ctx->cfg.prefetch_early, 0);
}
