/*
 * The context (ctx.c: device memory and the allocator; ctx_create.c: creation, teardown and
 * reports).
 */
#ifndef SPW_CTX_H
#define SPW_CTX_H

#include <pthread.h>

#include "arena.h"
#include "backend.h"
#include "internal.h"
#include "options.h"

typedef struct spw_live spw_live; /* ptr -> block map entry */

/* Memory pressure: spw_malloc at the budget, after the caches of both arenas were given back,
 * asks the callback for a block of `bytes` from arena a for stream s. It returns SPW_OK with
 * *out set, SPW_ERR_OUT_OF_MEMORY without a message when it cannot make room (the caller writes
 * the report), or another error. Context lock held. */
typedef spw_status (*spw_ctx_pressure_fn)(struct spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s,
                                          spw_block **out);

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
    spw_ctx_pressure_fn pressure; /* registered by the engine; NULL: fail at the budget */
};

/* Take the context lock, counting a wait for another thread in lock_waits and lock_wait_ns
 * (no clock read when the lock is free). */
void spw__ctx_lock(struct spw_ctx *ctx);
/* Charge/refund held bytes against the budget. charge fails (changing nothing) past the budget. */
bool spw__ctx_can_hold(const struct spw_ctx *ctx, size_t more);
/* Allocate from arena a; at the budget, give back the other arena's cache (it counts against
 * the same budget) and try once more. SPW_ERR_OUT_OF_MEMORY without a message when it cannot.
 * Context lock held. */
spw_status spw__ctx_alloc_block(struct spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s, spw_block **out);
/* The same through spw__arena_alloc_ordered when w is not NULL (waits owed on the block are
 * passed on in w[0..*nw)). */
spw_status spw__ctx_alloc_block_ordered(struct spw_ctx *ctx, spw_arena *a, size_t bytes, spw_stream s,
                                        spw_block **out, spw_arena_wait *w, int *nw);
/* The policy's one-line account of itself ("" when it has none), taking the context lock
 * (ctx_create.c; for the summary and the tools). */
/* Room for the policy's account of itself: the plan's, with every trial's time and every note,
 * runs well past 256 characters. */
#define SPW__POLICY_DESCRIBE_MAX 1024
void spw__ctx_describe_policy(struct spw_ctx *ctx, char *buf, size_t len);
/* Free the pointer map (teardown; the memory it names goes with the arenas). */
void spw__ctx_live_clear(struct spw_ctx *ctx);
/* true if ptr is a live allocation of ctx; *requested (may be NULL) gets its requested size. */
bool spw__ctx_live_requested(struct spw_ctx *ctx, const void *ptr, size_t *requested);
/* Change the budget to bytes (1 .. budget_max). Lowering it below held bytes releases the cache
 * at once; live bytes above it stay until freed, and no allocation succeeds until held fits. */
spw_status spw__ctx_set_budget(struct spw_ctx *ctx, size_t bytes);
/* Fill the out-of-memory message for a request of `bytes`. */
spw_status spw__ctx_oom(struct spw_ctx *ctx, size_t bytes, spw_stream s);

#endif /* SPW_CTX_H */
