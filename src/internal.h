/*
 * Internal declarations, grouped by the file that defines them. Nothing here is public API;
 * tests link the static library and may use these.
 */
#ifndef SPW_INTERNAL_H
#define SPW_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "size.h"
#include "spillway.h"

#define SPW_KiB ((size_t)1 << 10)
#define SPW_MiB ((size_t)1 << 20)
#define SPW_GiB ((size_t)1 << 30)
#define SPW_TiB ((size_t)1 << 40)

#define SPW_MIN(a, b) ((a) < (b) ? (a) : (b))
#define SPW_MAX(a, b) ((a) > (b) ? (a) : (b))
#define SPW_ALIGN_UP(x, a) (((x) + ((a)-1)) / (a) * (a))
#define SPW_ALIGN_DOWN(x, a) ((x) / (a) * (a))

#if defined(__GNUC__)
#define SPW_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define SPW_LIKELY(x) __builtin_expect(!!(x), 1)
#define SPW_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define SPW_PRINTF(f, a)
#define SPW_LIKELY(x) (x)
#define SPW_UNLIKELY(x) (x)
#endif

/* ---- error.c ---- */

/* Set the calling thread's message and return status (so callers write `return spw__error(...)`). */
spw_status spw__error(spw_status status, const char *fmt, ...) SPW_PRINTF(2, 3);
spw_status spw__verror(spw_status status, const char *fmt, va_list ap);
/* Prefix the current thread's message with "what: " (keeps the status). */
spw_status spw__error_prefix(spw_status status, const char *fmt, ...) SPW_PRINTF(2, 3);
void spw__error_clear(void);
/* SPW_ERR_PARSE with "PATH: line N: <what>" (trace and configuration file loaders). */
spw_status spw__parse_error(const char *path, size_t line, const char *fmt, ...) SPW_PRINTF(3, 4);
/* Format bytes as "1.50 GiB (1610612736 B)" into buf. */
const char *spw__fmt_bytes(char *buf, size_t len, uint64_t bytes);

/* ---- options.c ---- */

typedef enum spw_backend_kind { SPW_BACKEND_AUTO, SPW_BACKEND_CUDA, SPW_BACKEND_EMU } spw_backend_kind;
typedef enum spw_exhaust_mode { SPW_EXHAUST_EVICT, SPW_EXHAUST_FAIL } spw_exhaust_mode;
typedef enum spw_tristate { SPW_TRI_AUTO, SPW_TRI_ON, SPW_TRI_OFF } spw_tristate;
typedef enum spw_residency_kind { SPW_RES_EXPLICIT, SPW_RES_MANAGED } spw_residency_kind;
typedef enum spw_policy_kind { SPW_POLICY_LRU, SPW_POLICY_PLAN } spw_policy_kind;

/* A size that may be a percentage of the device (size.h). */
typedef spw_size_spec spw_size_opt;

/* Every option, by name. Adding an option = one X line + its field + parse kind. */
struct spw_config {
    spw_size_opt budget;        /* device budget */
    spw_backend_kind backend;
    int device;
    spw_exhaust_mode on_exhaust;
    spw_tristate vmm;
    size_t vmm_page;            /* emu: VMM granularity */
    size_t vmm_large_page;      /* VMM: mapping unit of the large-block arena (at least the granularity) */
    double frag_slack;
    spw_tristate prefetch;      /* policy=plan: prefetch ahead (auto = on) */
    int prefetch_early;         /* policy=plan: prefetches allowed ahead of the optimal schedule;
                                   -1: auto (tuned by measuring steps) */
    int prefetch_thread;        /* policy=plan: 1 = the prefetches after an acquire run on a worker */
    double grow_ahead;          /* on growth, map this fraction of held bytes beyond the request */          /* held may exceed live by this fraction before cache is trimmed */
    size_t emu_capacity;
    int emu_link_gbps;          /* emu: simulated copy rate, 0 = memcpy speed */
    size_t small_limit;         /* requests at most this go to the small-block arena */
    spw_residency_kind residency; /* offload engine: default residency of buffers */
    spw_policy_kind policy;     /* offload engine: eviction/prefetch policy */
    spw_size_opt host_budget;   /* pinned host pool limit (percent: of physical RAM) */
    char trace[256];            /* Chrome trace JSON of engine events ("" = off) */
};

/* size_api.c: resolve a size option against a device total; parse "N%" or a size. */
size_t spw__size_resolve(const spw_size_opt *o, size_t device_total);
spw_status spw__parse_size_opt(const char *text, spw_size_opt *out);

/* ---- arena.c: best-fit, split/coalesce, stream-ordered, budgeted, over VA with page maps ---- */

typedef struct spw_arena spw_arena;
typedef struct spw_block spw_block;
struct spw_ctx;

typedef struct spw_arena_params {
    spw_backend *backend;
    struct spw_ctx *ctx;     /* owner: budget and stats live there */
    size_t reserve_bytes;    /* VA to reserve (VMM mode) */
    size_t page;             /* mapping granularity (VMM) or segment rounding */
    size_t min_segment;      /* non-VMM: smallest segment to allocate */
    bool vmm;
    bool whole;              /* non-VMM: a block is its whole segment (see arena.c) */
    const char *name;        /* "small" / "large" */
} spw_arena_params;

spw_status spw__arena_create(const spw_arena_params *p, spw_arena **out);
void spw__arena_destroy(spw_arena *a);
/* The following are called with the context lock held. */
spw_status spw__arena_alloc(spw_arena *a, size_t bytes, spw_stream s, spw_block **out);
void spw__arena_free(spw_arena *a, spw_block *b, spw_stream s);
/* Owed waits. A block can be freed into stream s's pool while its bytes are still in use by
 * work that event `ev` (recorded on another stream) marks: s owes a wait on ev before touching
 * them. spw__arena_alloc, spw__arena_trim and spw__arena_retire_stream enqueue owed waits
 * before anything can reuse those bytes; spw__arena_alloc_ordered hands the ones covering the
 * block it returns to the caller instead, so that the caller can first use the bytes that owe
 * nothing (an upload that starts while the previous occupant's last reader still runs). The
 * event must stay valid until the wait is enqueued: callers settle before the event's owner can
 * destroy or re-record it. */
#define SPW_ARENA_OWED_MAX 8
typedef struct spw_arena_wait {
    uintptr_t lo, hi; /* the bytes that owe the wait */
    spw_event ev;
} spw_arena_wait;
/* Free b into s's pool owing a wait on ev. SPW_ERR_UNSUPPORTED, nothing done, when the table of
 * owed waits is full (the caller frees the plain way). */
spw_status spw__arena_free_after(spw_arena *a, spw_block *b, spw_stream s, spw_event ev);
/* spw__arena_alloc for stream s, except that waits owed by s's own pool on the returned block's
 * bytes are copied into w[0..*nw) (clipped to the block) rather than enqueued: the caller makes s
 * wait on each before touching its range (or gives them back with spw__arena_owe). Among the
 * places a cached block allows, it takes the one that owes the least, and it maps free pages
 * adjacent to a block that owes everything when the budget allows, so that a block freed after
 * an event and the room beside it become one, used from the end that owes nothing. */
spw_status spw__arena_alloc_ordered(spw_arena *a, size_t bytes, spw_stream s, spw_block **out,
                                    spw_arena_wait w[SPW_ARENA_OWED_MAX], int *nw);
/* Owe w again on stream s (a caller that could not enqueue waits it was handed). Cannot fail:
 * with the table full it waits for ev on the host. */
void spw__arena_owe(spw_arena *a, const spw_arena_wait *w, spw_stream s);
/* Enqueue every owed wait (on the host where a stream wait fails). On failure the wait stays
 * owed and the error is returned. */
spw_status spw__arena_settle(spw_arena *a);
/* Forget owed waits on ev, which the caller knows complete (waited on the host). */
void spw__arena_forget_event(spw_arena *a, spw_event ev);
/* Release cached memory until at least `want` bytes are released or nothing is left
 * (want == SIZE_MAX: everything). Synchronizes the streams of released blocks. */
spw_status spw__arena_trim(spw_arena *a, size_t want, size_t *released);
/* VMM: map up to `bytes` (whole pages, within the budget) as one free block of stream s's pool,
 * where one hole can take them. Other arenas: nothing. */
spw_status spw__arena_map_free(spw_arena *a, size_t bytes, spw_stream s);
size_t spw__arena_largest_free(const spw_arena *a);
/* Stream s (already synchronized) is about to be destroyed: its free blocks move to the default
 * stream's pool and nothing will wait on or synchronize it again. */
spw_status spw__arena_retire_stream(spw_arena *a, spw_stream s);
void *spw__block_ptr(const spw_block *b);
size_t spw__block_size(const spw_block *b);
/* Walk every block (tests, invariants): fn(addr, size, state) where state 0 hole, 1 free, 2 live. */
void spw__arena_walk(const spw_arena *a, void (*fn)(void *u, uintptr_t addr, size_t size, int state), void *u);
/* Check internal invariants; returns SPW_OK or SPW_ERR_STATE with a message. */
spw_status spw__arena_check(const spw_arena *a);
/* 1 if ptr lies in memory this arena holds (live or not). */
bool spw__arena_owns(const spw_arena *a, const void *ptr);
/* Bytes this arena holds from the backend. */
size_t spw__arena_held(const spw_arena *a);

/* ---- ctx.c ---- */

typedef struct spw_live spw_live; /* ptr -> block map entry */

struct spw_ctx {
    pthread_mutex_t lock;
    spw_config cfg;
    spw_backend *backend;
    spw_device_info dev;
    size_t budget;
    size_t budget_max;          /* the budget at creation: address space was reserved for it */
    size_t page;                /* the arenas map and hold whole pages of this size */
    spw_arena *small;
    spw_arena *large;
    spw_live *live_map;         /* uthash by pointer */
    spw_live *live_spare;       /* recycled map entries */
    spw_stats stats;            /* guarded by lock */
    struct spw_engine *engine;  /* offload engine (buffer.c); guarded by lock */
};

/* Take the context lock, counting a wait for another thread in lock_waits and lock_wait_ns
 * (no clock read when the lock is free). */
void spw__ctx_lock(struct spw_ctx *ctx);
/* Charge/refund held bytes against the budget. charge fails (changing nothing) past the budget. */
bool spw__ctx_can_hold(const struct spw_ctx *ctx, size_t more);
void spw__stat_add(spw_counter *c, int64_t delta);
void spw__stat_event(spw_counter *c);
/* Allocate from arena a; at the budget, give back the other arena's cache (it counts against
 * the same budget) and try once more. SPW_ERR_OUT_OF_MEMORY without a message when it cannot.
 * Context lock held. */
spw_status spw__ctx_alloc_block(struct spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s, spw_block **out);
/* The same through spw__arena_alloc_ordered when w is not NULL (waits owed on the block are
 * passed on in w[0..*nw)). */
spw_status spw__ctx_alloc_block_ordered(struct spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s,
                                        spw_block **out, spw_arena_wait *w, int *nw);
/* true if ptr is a live allocation of ctx; *requested (may be NULL) gets its requested size. */
bool spw__ctx_live_requested(struct spw_ctx *ctx, const void *ptr, size_t *requested);
/* Change the budget to bytes (1 .. budget_max). Lowering it below held bytes releases the cache
 * at once; live bytes above it stay until freed, and no allocation succeeds until held fits. */
spw_status spw__ctx_set_budget(struct spw_ctx *ctx, size_t bytes);
/* Fill the out-of-memory message for a request of `bytes`. */
spw_status spw__ctx_oom(struct spw_ctx *ctx, size_t bytes, spw_stream s);

/* ---- buffer.c, residency.c: the offload engine (details in engine.h, policy.h) ---- */

/* Create / destroy the engine of a context. create makes no backend call (copy streams are
 * created with the first buffer); destroy releases every live buffer (waiting for its work),
 * then the copy streams, the host pool and the trace. Called without the lock. */
spw_status spw__engine_create(struct spw_ctx *ctx);
void spw__engine_destroy(struct spw_ctx *ctx);
/* spw_malloc at the budget: evict unpinned buffers through the policy and retry the arena
 * until the request fits. Lock held. Returns SPW_OK, or SPW_ERR_OUT_OF_MEMORY without a
 * message (the caller writes the OOM report), or another error from an eviction. With
 * on_exhaust=fail it returns SPW_ERR_OUT_OF_MEMORY at once. */
spw_status spw__engine_alloc_evicting(struct spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s,
                                      spw_block **out);
/* Fold counters kept outside the lock (stall time) into ctx->stats. Lock held. */
void spw__engine_stats_sync(struct spw_ctx *ctx);
/* The policy's one-line account of itself ("" when it has none). Context lock held. */
void spw__engine_describe(struct spw_ctx *ctx, char *buf, size_t len);
/* The same, taking the context lock (ctx.c; for the summary and the tools). */
void spw__ctx_describe_policy(struct spw_ctx *ctx, char *buf, size_t len);

/* ---- stats.c ---- */
void spw__stats_print_table(const spw_stats *st, const char *backend, FILE *f);
void spw__stats_print_json(const spw_stats *st, const char *backend, FILE *f);

/* ---- trace.c: allocation traces (gzip or text) ---- */

typedef struct spw_trace_op {
    char kind;            /* 'a' or 'f' */
    uint64_t id;
    uint64_t bytes;       /* for 'f': those of its allocation (filled by the loader) */
    uint64_t stream;      /* likewise */
} spw_trace_op;

typedef struct spw_trace {
    spw_trace_op *ops;
    size_t count;
} spw_trace;

/* Load a whole trace; SPW_ERR_PARSE names the line on malformed input. */
spw_status spw__trace_load(const char *path, spw_trace *out);
void spw__trace_free(spw_trace *t);

/* ---- access.c: access traces for offload policies (shared/traces/README.md) ---- */

typedef struct spw_access_bufdef {
    uint64_t id;          /* the trace's id (reused ids give distinct buffers) */
    uint64_t bytes;       /* > 0 */
    bool read_only;       /* 'ro': no access writes it */
    size_t line;          /* line of its 'b' */
} spw_access_bufdef;

typedef struct spw_access_item {
    uint32_t buf;         /* index into bufs */
    spw_access mode;      /* SPW_ACCESS_READ (r), _WRITE (w), _READ_WRITE (rw) */
} spw_access_item;

typedef struct spw_access_op {
    char kind;            /* 'b' create, 's' step, 'a' access, 'f' destroy */
    uint32_t buf;         /* 'b', 'f': index into bufs */
    size_t first, count;  /* 'a': items[first .. first+count) (count >= 1, distinct buffers) */
    size_t step;          /* step this op belongs to (0-based; 's' carries the step it begins) */
    size_t line;          /* source line, for messages */
} spw_access_op;

typedef struct spw_access_trace {
    spw_access_bufdef *bufs;
    size_t nbufs;
    spw_access_op *ops;
    size_t nops;
    spw_access_item *items;
    size_t nitems;
    size_t nsteps;            /* 's' lines, plus one if accesses come before the first 's' */
    bool implicit_first_step; /* accesses before the first 's' form step 0 */
    uint64_t total_bytes;     /* sum of the bytes of every 'b' */
    uint64_t peak_live_bytes; /* peak of the bytes of buffers created and not destroyed */
} spw_access_trace;

/* Load a whole access trace; all or nothing. SPW_ERR_IO when it cannot be read, SPW_ERR_PARSE
 * naming file, line and problem for malformed input. The result is fully validated. */
spw_status spw__access_load(const char *path, spw_access_trace *out);
void spw__access_free(spw_access_trace *t);
/* Divide every buffer size by `divisor` (rounded up, so never 0) and recompute the totals. */
void spw__access_scale(spw_access_trace *t, uint64_t divisor);

/* ---- oracle.c: offline models of the bytes a policy moves (yardsticks for the engine) ---- */

typedef enum spw_model_kind {
    SPW_MODEL_ORACLE, /* Belady: evict the farthest next use; write back only if next use reads */
    SPW_MODEL_ORACLE_REPEAT, /* the oracle, with the last step assumed to run once more after
                              * the end (no end-of-trace drops of dirty data): see oracle.c */
    SPW_MODEL_LRU,    /* evict the least recently used; write back every dirty buffer */
} spw_model_kind;

typedef struct spw_model_result {
    size_t nsteps;
    uint64_t *h2d, *d2h;         /* per step, nsteps entries each */
    uint64_t bytes_h2d, bytes_d2h;
    uint64_t evictions_clean;    /* evictions that copied nothing back */
    uint64_t evictions_dirty;    /* evictions that wrote the buffer back to the host */
} spw_model_result;

/* Run the trace through the model with `budget` device bytes. Buffers start in host memory.
 * SPW_ERR_OUT_OF_MEMORY (naming the line) when one operation's buffers exceed the budget. */
spw_status spw__model_run(const spw_access_trace *t, uint64_t budget, spw_model_kind kind,
                          spw_model_result *out);
void spw__model_free(spw_model_result *r);
/* Sum of h2d + d2h over steps [from, nsteps). */
uint64_t spw__model_moved_from(const spw_model_result *r, size_t from);

/* ---- clock ---- */
static inline uint64_t spw__now_ns(void);
#include <time.h>
static inline uint64_t spw__now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif /* SPW_INTERNAL_H */
