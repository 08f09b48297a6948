/*
 * Private declarations of the offload engine, shared by buffer.c (state machine and API),
 * residency.c (device copies, eviction, replica collapse), copy.c (transfers and their
 * ordering), pin_share.c, prefetch_thread.c, step_wait.c and trace_events.c. The pinned host pool they use
 * has its own header (hostmem.h).
 * Everything here runs under the context lock unless a comment says otherwise.
 *
 * Ordering model (why a buffer needs only two events):
 * - Device copy: `ev_dev` marks the last touch of the device copy (upload on the H2D stream,
 *   the last release on a caller's stream, ...), on stream `dev_s`. Every new touch on another
 *   stream first waits on it, so the touches form one chain and the latest event orders all
 *   earlier work. When `dev_rec` is false the only touches are plain stream order on `dev_s`
 *   (the stream the block was allocated on). Freeing the block on `dev_s` is therefore always
 *   stream-ordered after every use: the arena does the rest (invariant 3).
 * - Host copy: `ev_host` marks the last transfer that read or wrote it (an upload reads it, a
 *   write-back writes it), on `host_s`. Transfers on the other copy stream wait on it; host
 *   code (spw_buf_read/write, destroy) waits for it with the lock dropped. `untracked` flags a
 *   copy stream that may hold host-copy work whose event could not be recorded (a failed
 *   event_record after a successful enqueue); host code then synchronizes that stream.
 * Every record of ev_dev goes through spw__copy_record_dev, which forgets the one stream known to
 * wait on the previous record (a second wait on the same record would be a wasted call).
 * An upload marks both copies at one point of the H2D stream, so it records ev_dev alone and
 * sets `host_in_dev`; the next record of ev_dev swaps the two event handles first (no call), so
 * ev_host keeps the upload's record. One event record per transfer, as a hand-written loop.
 * Consequence: two streams using one buffer at once are chained at release (the second
 * release waits for the first's use). Correct, at the price of a false dependency in that case.
 * With the prefetch worker (prefetch_thread=on) a release may leave its record of ev_dev to the
 * worker (`marking`): until then the buffer is in the lazy state above with dev_s the caller's
 * stream, which every path that needs the record resolves by recording it itself.
 *
 * Read-only managed buffers (read-mostly replicas, residency.c): made resident with advice
 * "preferred location device" + "read-mostly" and a prefetch to the device, which makes a
 * device replica while the host copy stays valid. Eviction moves nothing: it refunds the
 * budget and puts the buffer on the engine's collapse list. Advice is not stream-ordered, so
 * the replica is dropped (advice "preferred location host" + "unset read-mostly": the copies
 * collapse onto the host's, no transfer) only once ev_dev reports the last device use
 * complete, checked by event_query on later engine calls (never a host-blocking wait).
 * State: adv_rm => (resident || collapsing), and collapsing => !resident && adv_rm.
 */
#ifndef SPW_ENGINE_H
#define SPW_ENGINE_H

#include <stdatomic.h>

#include "ctx.h"
#include "hostmem.h"
#include "internal.h"
#include "policy.h"
#include "stats.h"

/* ---- the engine's entry points for the context (ctx_create.c) ---- */
/* Create / destroy the engine of a context. create runs policy `pops` (the caller picks it),
 * makes no backend call (copy streams are created with the first buffer) and registers
 * spw__engine_alloc_evicting as the context's pressure callback; destroy releases every live
 * buffer (waiting for its work), then the copy streams, the host pool and the trace. Called
 * without the lock. */
spw_status spw__engine_create(struct spw_ctx *ctx, const spw_policy_ops *pops);
void spw__engine_destroy(struct spw_ctx *ctx);
/* The pressure callback (spw_ctx_pressure_fn): evict unpinned buffers through the policy and
 * retry the arena until the request fits. Lock held. Returns SPW_OK, or SPW_ERR_OUT_OF_MEMORY
 * without a message (the caller writes the OOM report), or another error from an eviction.
 * With on_exhaust=fail it returns SPW_ERR_OUT_OF_MEMORY at once. */
spw_status spw__engine_alloc_evicting(struct spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s,
                                      spw_block **out);
/* Fold counters kept outside the lock (stall time) into ctx->stats. Lock held. */
void spw__engine_stats_sync(struct spw_ctx *ctx);
/* The policy's one-line account of itself ("" when it has none). Context lock held. */
void spw__engine_describe(struct spw_ctx *ctx, char *buf, size_t len);

#define SPW_BUF_ALIVE 0x53505742u /* "SPWB" */
#define SPW_BUF_DYING 0x44594e47u /* destroy in progress: every call fails with SPW_ERR_STATE */
#define SPW_BUF_FREED 0xdeadb0f5u /* destroyed: the struct sits in the quarantine */

#define SPW_UNTRACKED_H2D 1u
#define SPW_UNTRACKED_D2H 2u

typedef struct spw_tsink spw_tsink;

struct spw_buf {
    _Atomic uint32_t magic;
    spw_ctx *ctx;
    size_t bytes;
    unsigned flags;
    uint64_t id;
    bool managed;    /* managed residency: `host` is the managed allocation */
    bool user_host;  /* host copy is the caller's memory (spw_buf_register_host) */
    bool registered; /* ... and this context page-locked it (unregister at destroy) */
    bool pageable;   /* ... and it is not page-locked: refused by the system or by pin_limit,
                      * or unlocked by pin_share.c (counted in host_pageable) */
    void *host;
    spw_hblock *hblock; /* host pool block, NULL for the caller's memory and managed */

    /* device copy: explicit = an arena block; managed = the budget charge + device prefetch */
    bool resident;
    spw_block *dblock;
    spw_arena *darena;
    void *dev;

    /* contents: hv = host copy valid (once ev_host completes), dv = device copy valid,
     * dead = nobody needs the contents. Invariant 2: dead || hv || dv. */
    bool hv, dv, dead;
    bool policy_dead; /* dead because the policy dropped dirty contents it predicted overwritten */
    bool prefetched;      /* made resident by a prefetch and not acquired since */
    bool xfer;            /* dev_s is a copy stream whose transfer may not be complete */
    unsigned acq;         /* acquire count */
    unsigned acq_writers; /* of which in WRITE or READ_WRITE mode */

    spw_event ev_dev, ev_host; /* created at buffer creation */
    spw_stream dev_s, host_s;
    bool dev_rec, host_rec;
    bool host_in_dev;      /* the host copy's last transfer is ev_dev's current record (an upload
                            * records ev_dev alone; the next record of ev_dev first swaps the two
                            * events, so ev_host then holds it) */
    bool dev_waited;       /* dev_waiter already waits on the current record of ev_dev */
    spw_stream dev_waiter; /* (an acquire's wait then serves the release on the same stream) */
    bool dev_done;         /* the current record of ev_dev is known complete: no stream need wait
                            * on it (set by an acquire's query or the prefetch worker's watch,
                            * cleared by every record) */
    bool watched;          /* on the prefetch worker's watch list (prefetch_thread.c) */
    bool dev_touched; /* dev_s holds a touch (explicit: always while resident) */
    bool marking;     /* released with its record left to the prefetch worker (dev_rec false) */
    uint64_t rel_step; /* engine step of its last release (step_wait.c) */
    uint64_t up_step;  /* engine step of its last upload (pin_share.c), 0 before the first */
    bool host_busy;   /* spw_buf_write is filling the host copy with the lock dropped, or the
                       * caller writes it between spw_buf_host_begin and _end (host_open) */
    bool host_open;   /* spw_buf_host_begin .. spw_buf_host_end */
    unsigned untracked;

    /* managed advice in effect (a refused advice leaves its flag false) */
    bool adv_dev;    /* preferred location: the device */
    bool adv_rm;     /* read-mostly (read-only buffers only): a device replica may exist */
    bool collapsing; /* on the engine's collapse list: evicted, replica not yet dropped */
    bool replica;    /* a replica made by a counted prefetch, not since collapsed or written on
                      * the host: prefetching again moves (and counts) nothing */
    spw_buf *cprev, *cnext; /* collapse list links */

    spw_policy_node node;
    spw_buf *prev, *next; /* engine list (creation order) or quarantine */
};

struct spw_engine {
    bool streams_ok;
    spw_stream h2d, d2h; /* copy streams, one per direction */
    spw_hostpool *hp;
    const spw_policy_ops *pops;
    spw_policy *pol;
    spw_buf *first, *last; /* live buffers, creation order */
    spw_buf *q_first, *q_last; /* destroyed structs kept to detect use after destroy */
    spw_buf *c_first, *c_last; /* read-only managed buffers whose replica awaits collapse */
    size_t q_count;
    uint64_t next_id;
    uint64_t step;
    spw_tsink *sink; /* stall timing and the optional trace */
    int64_t events_live; /* events created by the engine and not destroyed (tests: leaks) */
    bool owe_waits;      /* an upload is being given room: victims' blocks are freed owing waits */
    uintptr_t ring_at;   /* a split's next streamed upload is placed from here (residency.c) */
    struct spw_pf *pf;   /* the prefetch worker (prefetch_thread.c), NULL until first used */
    spw_stream wait_s;   /* step_wait.c: the engine's stream and event for waiting on a step */
    spw_event wait_ev;
    size_t pinned_user;  /* caller memory this context page-locked (pin_share.c, at most pin_limit) */
    uint64_t pin_look;   /* the step of pin_share.c's previous look, 0 before the first */
};

/* ---- buffer.c: entering a buffer call (for buffer_io.c) ---- */
/* Validate b's handle and take the context lock (held on SPW_OK; due replica collapses done);
 * fn names the call in the error. */
spw_status spw__buf_enter(spw_buf *b, const char *fn);
void spw__buf_leave(spw_buf *b); /* drop the lock spw__buf_enter took */
/* Lock held: the caller wrote the host copy, which now holds the live contents. */
void spw__buf_host_written(spw_buf *b);
/* Why a buffer with host_busy cannot be used now, for the error message. */
const char *spw__buf_busy_why(const spw_buf *b);
/* The error of fn on a buffer that is acquired or host_busy. */
spw_status spw__buf_in_use(const char *fn, const spw_buf *b);

/* ---- residency.c: device copies, eviction, replica collapse (context lock held) ----
 * Full contracts at the definitions. */
/* Make b resident (not acquired); `upload` brings the contents. On failure nothing about b
 * changed (other buffers may have been evicted, their contents intact). */
spw_status spw__res_make_resident(spw_ctx *ctx, spw_buf *b, bool upload, spw_stream s, int for_prefetch,
                                  bool may_evict);
/* Evict b (`user`: spw_evict, always write dirty data back). On failure b is unchanged. */
spw_status spw__res_evict_buf(spw_ctx *ctx, spw_buf *b, bool user);
/* Forget b's device copy (after a write-back, or when it is clean or dead). Cannot fail. */
void spw__res_drop_device(spw_ctx *ctx, spw_buf *b);
/* Take b off the collapse list, if on it (no advice). */
void spw__res_collapse_unlink(struct spw_engine *e, spw_buf *b);
/* Collapse every listed replica whose last device use is complete; called at every engine
 * entry, never blocks. */
void spw__res_collapse_poll(spw_ctx *ctx);

/* ---- pin_share.c: page-locking caller memory registered as host copies (context lock held) ----
 * Page-lock b's host copy (a registration of caller memory) within pin_limit; sets `registered`
 * or `pageable` and the counters. SPW_ERR_STATE: the memory was page-locked already (by the
 * caller), and b is neither. The failure's message is left for the caller to clear. */
spw_status spw__pin_register(spw_ctx *ctx, spw_buf *b);
/* Undo what spw__pin_register did for b (destroy): unlock it, or uncount it as pageable. */
void spw__pin_forget(spw_ctx *ctx, spw_buf *b);
/* At a step end: when some registered host copies are pageable, on the steps the schedule names,
 * move page-locked memory from host copies not uploaded since the previous look to those
 * uploaded in the step. */
void spw__pin_rebalance(spw_ctx *ctx);

/* ---- step_wait.c: while the policy times steps (pops->time_steps), spw_step_end waits on the
 * host for the last use of every buffer released in the step. Context lock held; released while
 * waiting. Best effort: any failure skips the wait. ---- */
void spw__step_wait(spw_ctx *ctx);
/* The engine's wait stream and event, if made (kept from the first timed step on): at teardown. */
void spw__step_wait_destroy(spw_ctx *ctx);

/* ---- prefetch_thread.c: the policy's after-acquire prefetches on a worker (option
 * prefetch_thread=on). The worker takes the context lock and calls pops->prefetch(after_acquire
 * true), exactly as spw_acquire would have; everything it does is ordered by the same lock. ----
 * Context lock held: true if the prefetch was handed to the worker (started on first use); false
 * if the caller must run it (the option is off, the worker could not be started, or it has not
 * yet taken the previous post). Takes no system call while a step is open, where the worker
 * polls. */
bool spw__pf_post(spw_ctx *ctx);
/* Context lock held: a step begins (the worker polls until it ends) or ends (a prefetch still
 * pending is dropped: the step boundary's own prefetch follows; marks still pending are
 * recorded). */
void spw__pf_step(spw_ctx *ctx, bool begin);
/* Context lock NOT held: stop and join the worker, if any (engine teardown). */
void spw__pf_stop(spw_ctx *ctx);
/* Prefetch calls the worker has made (tests). */
uint64_t spw__pf_runs(spw_ctx *ctx);
/* Context lock held, from spw_release after ordering b on s: true if recording b's last use on
 * s (ev_dev) is left to the worker, which does it before its next prefetch; b then has dev_rec
 * false and `marking` set until it is recorded. False (the caller records) without a worker,
 * for managed buffers, or when the worker's list is full. */
bool spw__pf_mark(spw_ctx *ctx, spw_buf *b);
/* Context lock held: record b's last use now if a mark is still pending (an eviction, a
 * teardown), so that every other path sees the state it would without the worker. */
void spw__pf_unmark(spw_ctx *ctx, spw_buf *b);
/* Marks the worker has recorded (tests). */
uint64_t spw__pf_marked(spw_ctx *ctx);
/* Context lock held, after an upload of b was enqueued and recorded on the H2D stream: the
 * worker, while a step is open, watches for its completion and then sets b->dev_done, so that
 * the acquire need neither ask the driver nor make its stream wait. Nothing is watched without
 * a running worker or with its list full. */
void spw__pf_watch(spw_ctx *ctx, spw_buf *b);
/* Context lock held: b leaves the watch list (teardown). */
void spw__pf_unwatch(spw_ctx *ctx, spw_buf *b);
/* Uploads the worker has seen complete (tests). */
uint64_t spw__pf_seen(spw_ctx *ctx);

/* ---- copy.c: copy streams, transfers, ordering (context lock held) ---- */
spw_status spw__copy_streams(spw_ctx *ctx);       /* create the copy streams once */
void spw__copy_streams_destroy(spw_ctx *ctx);
/* Make stream s ordered after every earlier touch of b's device copy. */
spw_status spw__copy_order_dev(spw_ctx *ctx, spw_buf *b, spw_stream s);
/* Record ev_dev on s (the device copy's latest touch). The only way ev_dev is recorded. */
spw_status spw__copy_record_dev(spw_ctx *ctx, spw_buf *b, spw_stream s);
/* Upload b's host copy into its (already allocated) device copy on the H2D stream, or prefetch
 * managed memory to the device. On failure b's device copy is as before the call (nothing
 * about it is recorded) and no host-copy work is left untracked. */
spw_status spw__copy_upload(spw_ctx *ctx, spw_buf *b);
/* spw__copy_upload, for a block that owes the waits w[0..nw) (spw__arena_alloc_ordered): the
 * bytes that owe nothing are copied first, then the H2D stream waits, then the rest. On failure
 * the waits may not all be enqueued: the caller owes them again. */
spw_status spw__copy_upload_ordered(spw_ctx *ctx, spw_buf *b, const spw_arena_wait *w, int nw);
/* Explicit only: upload [off, off+n) of the host copy into the resident device copy, after
 * every touch. On failure the device copy may be partly overwritten: the caller drops it. */
spw_status spw__copy_upload_range(spw_ctx *ctx, spw_buf *b, size_t off, size_t n);
/* Copy b's device copy into its host copy on the D2H stream, after every use; on success the
 * host copy is valid (pending ev_host). On failure b is unchanged. */
spw_status spw__copy_writeback(spw_ctx *ctx, spw_buf *b);
/* Managed, read-write (or read-only without read-mostly): migrate b to the host on the D2H
 * stream after every use. Read-mostly buffers are evicted without it (residency.c). */
spw_status spw__copy_managed_to_host(spw_ctx *ctx, spw_buf *b);
/* Events to wait for (lock dropped) before host code touches b's host copy, plus copy streams
 * to synchronize. */
typedef struct spw_host_wait {
    spw_event ev[2];
    int nev;
    spw_stream sync[3];
    int nsync;
} spw_host_wait;
void spw__copy_host_wait_collect(spw_ctx *ctx, spw_buf *b, bool include_dev, spw_host_wait *w);
/* Called WITHOUT the lock. */
spw_status spw__copy_host_wait(spw_ctx *ctx, const spw_host_wait *w);

/* ---- trace_events.c: stall timing sink and Chrome trace (thread-safe, refcounted) ---- */
spw_status spw__tsink_create(const char *path, spw_tsink **out);
void spw__tsink_put(spw_tsink *t); /* drop one reference; the last closes the file */
void spw__tsink_get(spw_tsink *t);
bool spw__tsink_tracing(const spw_tsink *t);
uint64_t spw__tsink_stall_ns(spw_tsink *t);
void spw__tsink_add_stall(spw_tsink *t, uint64_t ns);
/* Trace records; `stream` names the track. Safe from stream callbacks (no spillway calls). */
void spw__tsink_complete(spw_tsink *t, const char *name, const char *cat, spw_stream stream,
                         const char *track, uint64_t t0_ns, uint64_t t1_ns, uint64_t bytes, uint64_t buf_id);
void spw__tsink_instant(spw_tsink *t, const char *name, spw_stream stream, const char *track,
                        uint64_t bytes, uint64_t buf_id);
/* Enqueue host callbacks around work on stream s (a transfer, or a caller's wait on one) so
 * that its duration is measured on the stream, only while the trace is on: for the trace, and
 * with `stall` for stall_ns.
 * Best effort: failures only lose the record. NULL when there is nothing to record. Lock held
 * (for ctx->engine); the callbacks themselves take only the sink's mutex. */
void *spw__tsink_span_begin(spw_ctx *ctx, spw_stream s, const char *name, const char *track,
                            uint64_t bytes, uint64_t buf_id, int stall);
void spw__tsink_span_end(spw_ctx *ctx, spw_stream s, void *token);

#endif /* SPW_ENGINE_H */
