/*
 * policy_plan.h: private to the plan policy (policy_plan.c: recording, following, victims,
 * prefetch and the timed choice of pipeline; policy_plan_layout.c: where buffers should be, the
 * start state of a new plan and STATIC's fixed set). Not a public or engine-wide header.
 */
#ifndef SPW_POLICY_PLAN_H
#define SPW_POLICY_PLAN_H

#include <stdbool.h>
#include <stdint.h>
/* uthash must never exit: a failed table allocation only sets this flag (checked after adds) */
extern _Thread_local int spw__plan_hash_oom;
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) ((void)(obj), spw__plan_hash_oom = 1)
#include <uthash.h>

#include "policy.h"

#define IN_STEP_KEY (1ull << 63)
#define FAR UINT64_MAX
#define LOOKAHEAD_MAX 64 /* plan entries examined for prefetch after one acquisition */
/* Pipelines tried by prefetch_early=auto, each for TRIAL_STEPS steps: the first settles the change
 * of resident set, the second is timed. The settle step pays the change of resident set on top of
 * a step, so a timed step slower than it met a hiccup of the host or the link (which can be as
 * large as the differences between pipelines): it is timed once more and the faster of the two
 * counts. Every trial step of a loser is paid in the first steps of a run that is often short (a
 * sampler's 20-50 steps), so a trial takes no more steps than that; the fastest is kept.
 * OFF: no prefetch at all, user hints declined: the fewest bytes (Belady's schedule), each
 * transfer serialised with the work that frees its room; worth it where work hides less than a
 * transfer (small batches).
 * 0: Belady with a double buffer: the next buffer moves during the current work.
 * STATIC: the expert's split, found from the plan: a fixed set stays resident, spread over the
 * step so that work runs between the others, which stream through two buffers of room, each
 * prefetched as soon as the one it replaces is released, back to back on the link; the same
 * bytes as the double buffer but no idle link during runs of resident buffers (large batches).
 * In whole segments each streamed buffer takes a block of the largest one's size (slot_bytes,
 * asked through block_bytes), so that an upload reuses the block its predecessor left.
 * SLOT: STATIC with one buffer of room and a quarter more instead of two, so one more buffer
 * is fixed: each upload evicts the buffer streamed before it and starts on the bytes that buffer
 * never occupied while its work still runs (arena owed waits), then fills the rest. It hides a
 * transfer behind work as long as a quarter buffer of transfer covers that work, with fewer bytes
 * moved than STATIC. The room is made one piece when its fixed set is taken up.
 * Deeper early prefetch than the double buffer is not tried: it moves the bytes STATIC moves or
 * more, with less of the link's idle time filled, and every trial step pays its extra bytes
 * (figures: bench/RESULTS.md). */
#define PF_OFF (-1)
#define PF_STATIC (-2)
#define PF_SLOT (-3)
#define N_TRIALS 4
#define TRIAL_STEPS 2
/* A settle step slower than SETTLE_CUT times the fastest pipeline timed so far ends its trial
 * there, untimed: to win, the pipeline would have to run a third faster once settled, more than
 * the change of resident set a settle step pays has been seen to cost, and its timed step (and a
 * retimed one) would be paid in the first steps of a short run. */
#define SETTLE_CUT 1.5
/* After the choice, two steps in every RECHECK_EVERY end waiting for their device work, and the
 * second is timed as a trial step was. A time off the chosen pipeline's trial time by more than
 * RETUNE_RATIO either way (the work of a step changed: another batch size, another sequence
 * length) starts the trials again, and their best replaces the pipeline in force only if it beats
 * that pipeline's own new time by RETIME_MARGIN (trial steps that wait are noisier than steps that
 * run ahead: pipelines whose trial times lie close together can swap places between a trial and
 * the steady state, so a narrow winner need not be faster than the incumbent). On a caller that
 * waits for every step anyway the waits cost nothing; on one that runs ahead, two host waits in
 * RECHECK_EVERY steps. */
#define RECHECK_EVERY 32
/* Steps that leave their plan (routed experts, dynamic control flow) time nothing: a trial waits
 * for a step that follows its plan to the end. After DIVERGED_STEPS such steps in a row the
 * trials pause, so that a program whose every step diverges does not end every step waiting for
 * its device work; the double buffer runs (the default depth: it prefetches only while a step
 * still follows its plan), and the first step that follows its plan again resumes the trials. */
#define DIVERGED_STEPS 3
#define RETUNE_RATIO 1.25
#define RETIME_MARGIN 0.9
/* SLOT is left for the best other pipeline when, after the timing chose it, this many of the last
 * eight steps found its premise broken: the fixed set displaced (taken up again at a step
 * boundary) or the device memory trimmed during the step (the room no longer one piece: an
 * upload of another size found no place). Each take-up and each trim synchronizes the streams; a
 * rare one costs less than the pipeline saves, one every step does not (a workload whose buffers
 * of several sizes trim the memory every step loses more to the synchronizations than SLOT
 * gains; figures: bench/RESULTS.md). */
#define SLOT_BROKEN_OF_8 4

#ifndef FREE_VICTIM_SLACK
#define FREE_VICTIM_SLACK 2
#endif


typedef struct plan_entry {
    uint64_t key;
    size_t bytes;
    spw_access mode;
} plan_entry;

/* Per buffer (node->data): its key and whether the plan prefetched it (not yet acquired). */
typedef struct kbuf {
    uint64_t key;
    spw_buf *buf;
    bool prefetched;
    bool early;        /* prefetched against the floor rule, not yet used */
    bool target;       /* during a rebase: in the resident set the plan starts from */
    bool fixed;        /* STATIC: stays resident (never a victim while another will do) */
    UT_hash_handle hh; /* key -> the newest live buffer with that key */
} kbuf;

/* Positions of a key in the plan, ascending. */
typedef struct kpos {
    uint64_t key;
    uint32_t *pos;
    uint32_t n, cap;
    size_t sim_bytes; /* start-state simulation: device bytes the buffer takes */
    bool sim_in;      /* start-state simulation: resident at the step boundary */
    UT_hash_handle hh;
} kpos;

struct spw_policy {
    spw_ctx *ctx;
    spw_policy *lru; /* recency order, kept up to date always; the fallback */
    kbuf *by_key;
    plan_entry *plan, *rec;
    size_t nplan, nrec, cap_plan, cap_rec;
    kpos *index;     /* over plan */
    size_t cursor;   /* next expected plan entry */
    bool in_step;
    bool following;  /* in a step, with a plan, no divergence yet */
    bool confirmed;  /* the plan was recorded by a step that followed its own plan exactly */
    bool rec_ok;     /* the recording is complete (no host allocation failure) */
    uint64_t pf_floor; /* during the policy's own prefetch: a victim must be needed later */
    bool pf_own;       /* pf_floor is set (else choose_victim computes it for a user hint) */
    bool pf_early;     /* the current prefetch may ignore the floor (an early slot is free) */
    int early;         /* buffers prefetched early and not used or evicted since */
    /* prefetch_early=auto: the early depth is tuned by timing steps that follow the plan */
    int early_max;         /* the depth in force */
    int trial;             /* index into EARLY_TRIALS of the step being timed; -1: tuned */
    int trial_step;        /* steps run of the current trial */
    uint64_t trial_ns[N_TRIALS];    /* each trial's step as timed (the faster if timed twice) */
    uint64_t settle_ns;             /* the current trial's settle step */
    double trial_t[N_TRIALS];       /* each trial's time as compared (scaled to its long-run bytes) */
    unsigned trials_left_out;       /* bit i: EARLY_TRIALS[i] is not tried (a step that writes: no split) */
    unsigned trials_cut;            /* bit i: EARLY_TRIALS[i]'s trial ended at its settle step (SETTLE_CUT) */
    int chosen;                     /* the pipeline chosen by timing: index into EARLY_TRIALS */
    int ring_prev;                  /* the pipeline in force at the previous step boundary (PF_OFF
                                       after a new plan: its fixed set is placed again) */
    uint32_t since_tuned;           /* steps begun since the choice */
    uint32_t retunes;               /* trials started again by a recheck */
    uint8_t slot_broken;            /* SLOT's last eight steps since the timing chose it, 1 = broken */
    bool slot_step_broken;          /* SLOT: a take-up since the current step began */
    int64_t trims_seen;             /* the context's trim_syncs when the current step began */
    bool slot_left;                 /* SLOT was chosen, then left (its room did not hold) */
    bool all_fit;                   /* the plan's buffers fit the capacity: no pipeline timed */
    uint32_t diverged;              /* steps in a row that left their plan (reset by the trials) */
    bool diverging;                 /* DIVERGED_STEPS did: the trials paused, no pipeline timed */
    int paused_trial;               /* while diverging: the trial to go on from */
    size_t slot_bytes;              /* STATIC in force: the block of every streamed buffer (the
                                     * largest of the plan's), 0 otherwise */
    int64_t evictions0;             /* the context's evictions when the current step began */
    uint64_t step_bytes0;  /* bytes moved before the current step began */
    uint64_t step_t0;      /* when the current step began (0: none yet) */
    bool last_exact;       /* the step that just ended followed its plan to the end */
    uint64_t created_in_step;
    bool rebase_due;       /* a new plan was learned from a step that did not follow one */
    bool rebasing;         /* choose_victim: only buffers outside the target set */
    bool taking_up;        /* choose_victim: only buffers outside the fixed set (SLOT) */
    bool ahead;            /* prefetching for the next step between steps: clean victims only */
    /* rank_victim's figures for one room of a prefetch, kept while its inputs stay */
    const spw_buf *rk_in;
    size_t rk_cursor;
    uint64_t rk_pf_floor, rk_din, rk_floor;
    bool rk_pf_own, rk_pf_early, rk_set;
};

static inline kbuf *kb_of(spw_buf *b) { return spw__pol_node(b)->data; }

/* ---- policy_plan_layout.c ---- */

/* Device bytes the plan's buffers may use: the budget less what other allocations hold live. */
size_t spw__plan_capacity(spw_policy *p);
/* Largest buffer the plan reads. */
size_t spw__plan_largest(const spw_policy *p);
/* The bytes of the distinct buffers of the plan (each rounded as the arena rounds it). */
size_t spw__plan_total(spw_policy *p);
/* The mean upload bytes of a pass in the cycle Belady settles to within `cap`; 0 when it
 * cannot say. */
double spw__plan_belady_bytes(spw_policy *p, size_t cap, size_t periods);
/* Move to the start state of a newly learned plan (from the policy's prefetch callback). */
void spw__plan_rebase(spw_policy *p, spw_ctx *ctx);
/* STATIC and SLOT (`mode`): mark the fixed set for the current plan, leaving room beside it for
 * the streamed buffers (two of the largest, three where they stream through a ring; SLOT: one
 * and a quarter) / unmark every buffer. */
void spw__plan_choose_fixed(spw_policy *p, int mode);
/* SLOT, and STATIC in a ring: when a fixed buffer is not resident, make the fixed set resident and
 * the room left one piece of free device memory (the engine trims and maps it; the streams are
 * synchronized once). `compact`: every buffer out first, so that the fixed set is placed in one
 * run (a ring's room is then the other). */
bool spw__plan_take_up_fixed(spw_policy *p, spw_ctx *ctx, bool compact); /* true when it had to */
void spw__plan_clear_fixed(spw_policy *p);

/* ---- policy_plan_trials.c ---- */

/* The pipeline in force at creation: the first trial where prefetch_early=auto times them. */
void spw__plan_trials_init(spw_policy *p);
/* At a step's begin: time the step that ended and move the trials on (prefetch_early=auto). */
void spw__plan_tune(spw_policy *p, uint64_t now);
/* Whether the policy prefetches at all (prefetch=on, or auto on a device whose transfers take time). */
bool spw__plan_prefetching(const spw_ctx *ctx);
/* Pipelines with a fixed set (STATIC, SLOT). */
bool spw__plan_fixed_pipeline(int mode);
/* Mark the fixed set of the pipeline in force, or none. */
void spw__plan_fix_for_pipeline(spw_policy *p);
/* SLOT's premise keeps breaking: the fastest other pipeline of the timing. */
void spw__plan_leave_slot(spw_policy *p);
/* The context's evictions and uploads so far (a step's own are the difference). */
int64_t spw__plan_evictions(const spw_policy *p);
uint64_t spw__plan_bytes_moved(const spw_policy *p);
/* The policy's time_steps and describe callbacks. */
bool spw__plan_time_steps(spw_policy *p);
void spw__plan_describe(spw_policy *p, char *buf, size_t len);

#endif /* SPW_POLICY_PLAN_H */
