/*
 * The policy seam of the offload engine: which buffer to evict, whether a dirty one must be
 * written back, and what to prefetch. The engine (buffer.c, residency.c) owns every buffer's
 * state and does every transfer; a policy only observes events and answers questions. Policies:
 * policy_lru.c (least recently released first) and policy_plan.c (next use from a recorded
 * step), both written against the same table.
 *
 * Contracts for every callback:
 * - Called with the context lock held, from whichever thread made the API call. A callback must
 *   not block, must not call public spw_ functions (the lock is not recursive) and must not call
 *   the backend. It may call the spw__pol_* queries below, and (only from `prefetch`)
 *   spw__engine_prefetch, spw__engine_evict and, at a step boundary, spw__engine_stream_room
 *   (the one call that blocks).
 * - Notification callbacks (on_*) cannot fail; a policy that cannot record something (host
 *   allocation failure) must degrade (e.g. forget its plan) and keep answering correctly.
 * - Any callback may be NULL except choose_victim.
 *
 * Per-buffer storage: each buffer embeds an spw_policy_node that belongs to the policy (list
 * links, a stamp, a pointer). The engine sets node->buf and zeroes the rest at creation; it
 * never touches the node afterwards. Whatever node->data points to is the policy's to free in
 * on_destroy.
 *
 * Event order for one buffer: on_create, then any sequence of
 *   on_acquire .. on_release (nested, counted: on_release gets the remaining count),
 *   on_resident (a device copy appeared: upload, write-acquire, prefetch),
 *   on_evicted (the device copy is gone: eviction, or destroy of a resident buffer),
 * then on_destroy. on_acquire of a non-resident buffer comes after on_resident (the engine makes
 * it resident first). step_begin/step_end come from spw_step_begin/end, unrelated to buffers.
 */
#ifndef SPW_POLICY_H
#define SPW_POLICY_H

#include "ctx.h"
#include "internal.h"
#include "stats.h"

typedef struct spw_policy spw_policy; /* a policy's private state (one per context) */

typedef struct spw_policy_node {
    struct spw_policy_node *prev, *next; /* free for the policy (LRU: list links) */
    spw_buf *buf;                        /* owner; set by the engine, read-only for the policy */
    uint64_t stamp;                      /* free for the policy */
    void *data;                          /* free for the policy */
    int listed;                          /* free for the policy */
} spw_policy_node;

typedef struct spw_policy_ops {
    const char *name; /* the option value: "lru", "plan" */
    /* Make the per-context state. Host memory only; SPW_ERR_HOST_OUT_OF_MEMORY on failure. */
    spw_status (*create)(spw_ctx *ctx, spw_policy **out);
    void (*destroy)(spw_policy *p);

    void (*on_create)(spw_policy *p, spw_buf *b);
    void (*on_destroy)(spw_policy *p, spw_buf *b);
    /* A successful spw_acquire (after the buffer is resident). `count` is the acquire count
     * after this call (1 for the first). */
    void (*on_acquire)(spw_policy *p, spw_buf *b, spw_access mode, spw_stream s, unsigned count);
    /* A successful spw_release; `count` is the acquire count left (0: now evictable). */
    void (*on_release)(spw_policy *p, spw_buf *b, spw_stream s, unsigned count);
    void (*on_resident)(spw_policy *p, spw_buf *b);
    void (*on_evicted)(spw_policy *p, spw_buf *b);
    /* spw_buf_read of b (its contents are needed on the host): an access, for a policy that
     * learns the order of accesses. */
    void (*on_host_read)(spw_policy *p, spw_buf *b);
    void (*step_begin)(spw_policy *p);
    void (*step_end)(spw_policy *p);
    /* True while the policy times steps on the host: spw_step_end then first waits for the
     * device work of the buffers released in the step (step_wait.c). NULL: never. */
    bool (*time_steps)(spw_policy *p);

    /* Pick the next buffer to evict so that `need` more device bytes can be had. `incoming` is
     * the buffer being made resident (acquire or prefetch), or NULL for a plain spw_malloc.
     * `for_prefetch` is 1 when the room is for a prefetch: a policy should then refuse (return
     * NULL) rather than evict something needed sooner than `incoming`. Return a buffer for which
     * spw__pol_evictable() is true, or NULL for "nothing (more) to evict". The engine evicts the
     * answer and asks again until the allocation fits; it stops (out of memory) on NULL or on a
     * buffer that is not evictable, so a wrong answer can never loop. */
    spw_buf *(*choose_victim)(spw_policy *p, size_t need, spw_buf *incoming, int for_prefetch);

    /* How good a victim b is for the same room, as choose_victim weighs it: 0 when b must not be
     * evicted for it, else higher for a better victim (choose_victim's own answer ranks
     * highest). The engine asks it, after choose_victim gave an answer, to empty one run of
     * adjacent device blocks instead of scattered ones, so that an upload needs no trim (which
     * waits for the device on the host). NULL: the engine evicts choose_victim's answers only. */
    uint64_t (*rank_victim)(spw_policy *p, spw_buf *b, spw_buf *incoming, int for_prefetch);

    /* Called before a dirty buffer is evicted. Return 0 to drop its contents instead of writing
     * them back: the engine then treats the buffer exactly as after spw_discard (dead). Only a
     * policy that KNOWS the next access overwrites everything (mode WRITE) or that there is no
     * next access may return 0; a wrong 0 loses data. NULL means always write back. Never
     * called for evictions the user asked for (spw_evict) or for read-only buffers. */
    int (*need_writeback)(spw_policy *p, spw_buf *b);

    /* After successful acquires (after_acquire true: at the end of spw_acquire, or later on the
     * prefetch worker, prefetch_thread.c, once for any number of acquires since its last call),
     * and at spw_step_begin and after step_end at spw_step_end (after_acquire false): the policy
     * may start uploads of buffers it expects next with spw__engine_prefetch. */
    void (*prefetch)(spw_policy *p, spw_ctx *ctx, bool after_acquire);

    /* Device bytes to ask for b's block, at least b's own: a pipeline that streams buffers of
     * several sizes through room of a fixed number of buffers asks a slot's bytes for each, so
     * that any of them takes the block another one left. The engine asks where a block is a
     * whole segment of its own (vmm off), which serves only requests of its size; in pages any
     * free run serves any size. NULL: b's bytes. */
    size_t (*block_bytes)(spw_policy *p, spw_buf *b);

    /* A split streams the buffers outside its fixed set through the rest of the budget in their
     * order of use: each upload is placed at the first run of bytes after the one before it that
     * holds it (a ring over the device memory, stepping over what is not the ring's), its victims
     * the buffers in those bytes, the oldest uploads, whose work is long done. ring_member: whether
     * b's upload is placed so now. ring_victim: whether v, in bytes incoming's upload would take,
     * may go for it: 1 yes; 0 v is not the ring's (stepped over); -1 v is the ring's but not free
     * yet (acquired, or for a prefetch needed no later than incoming): the prefetch waits. NULL:
     * no ring. */
    bool (*ring_member)(spw_policy *p, spw_buf *b);
    int (*ring_victim)(spw_policy *p, spw_buf *v, spw_buf *incoming, int for_prefetch);

    /* One line for the summary on what the policy is doing (what it learned, what it chose),
     * written to buf (NUL-terminated, truncated to len); may write nothing. */
    void (*describe)(spw_policy *p, char *buf, size_t len);
} spw_policy_ops;

/* ---- queries for policies (context lock held) ---- */

spw_policy_node *spw__pol_node(spw_buf *b);
size_t spw__pol_bytes(const spw_buf *b);
uint64_t spw__pol_id(const spw_buf *b);      /* creation order within the context, from 1 */
/* Has a device copy (or managed residency) and could be evicted now: not acquired, alive. */
bool spw__pol_evictable(const spw_buf *b);
bool spw__pol_resident(const spw_buf *b);
/* Eviction now would copy to the host (device copy newer than the host's, contents alive). */
bool spw__pol_dirty(const spw_buf *b);
unsigned spw__pol_acquired(const spw_buf *b); /* current acquire count */
bool spw__pol_read_only(const spw_buf *b);
/* Device bytes that evicting b returns to the budget. */
size_t spw__pol_device_bytes(const spw_buf *b);
uint64_t spw__pol_step(const spw_ctx *ctx); /* spw_step_begin calls so far */
/* Uploads of ring members are placed in a ring (ring_member): pages, copy streams, option ring on. */
bool spw__pol_ring(const spw_ctx *ctx);
/* First / next live buffer of the context in creation order (walk all candidates). */
spw_buf *spw__pol_first(spw_ctx *ctx);
spw_buf *spw__pol_next(spw_buf *b);

/* Start making b resident, ordered before later acquires on any stream, without blocking.
 * No-op (SPW_OK) when b is resident, acquired, or not alive. With `may_evict` the engine asks
 * choose_victim(for_prefetch=1) for room; without it, it uses only free budget. Errors leave b
 * and every other buffer intact (as for spw_prefetch). */
spw_status spw__engine_prefetch(spw_ctx *ctx, spw_buf *b, int may_evict);
/* Evict b (evictable, by the policy's choice: a dirty one is written back unless need_writeback
 * says otherwise). On failure b is unchanged. */
spw_status spw__engine_evict(spw_ctx *ctx, spw_buf *b);
/* Make the device room the budget leaves one free block that uploads take from: the large
 * arena's cached memory is returned (synchronizing its streams: the host waits) and the room
 * left is mapped in one piece for the H2D stream, where the ring starts again. VMM arenas only;
 * elsewhere it does nothing. */
spw_status spw__engine_stream_room(spw_ctx *ctx);

/* The policies. The engine is handed one at creation (ctx_create.c picks it by option value). */
extern const spw_policy_ops spw__policy_lru;
extern const spw_policy_ops spw__policy_plan;

#endif /* SPW_POLICY_H */
