/*
 * The device arena (arena.c, arena_trim.c, arena_inspect.c): best-fit, split/coalesce,
 * stream-ordered, budgeted, over address space with page maps. It knows its backend and the
 * account it is handed (counters and budget), nothing above.
 */
#ifndef SPW_ARENA_H
#define SPW_ARENA_H

#include "backend.h"
#include "internal.h"

typedef struct spw_arena spw_arena;
typedef struct spw_block spw_block;

/* What an arena charges and what bounds it: counters and a budget, owned by the caller and
 * outliving the arena. The arena never lets held->current pass *budget; arenas handed the same
 * account share its budget. Guarded by the caller's lock, like every arena call. */
typedef struct spw_arena_acct {
    spw_counter *held;               /* device bytes mapped or allocated from the backend */
    spw_counter *cached;             /* held bytes not in live blocks */
    spw_counter *segments;           /* segments held from the backend (VMM: the reservation) */
    spw_counter *backend_allocs;     /* calls that obtained device memory from the backend */
    spw_counter *backend_frees;      /* calls that returned device memory to the backend */
    spw_counter *cross_stream_waits; /* reuses of a block on another stream, ordered by an event */
    spw_counter *trim_syncs;         /* host waits for the device before returning cached memory */
    const spw_counter *live;         /* read only: bytes in live blocks (fragmentation slack) */
    const size_t *budget;
} spw_arena_acct;

typedef struct spw_arena_params {
    spw_backend *backend;
    spw_arena_acct acct;     /* counters and budget, the owner's */
    double grow_ahead;       /* VMM growth maps this fraction of held bytes beyond the request */
    double frag_slack;       /* held may exceed live by this fraction before cache is trimmed */
    size_t reserve_bytes;    /* VA to reserve (VMM mode) */
    size_t page;             /* mapping granularity (VMM) or segment rounding */
    size_t min_segment;      /* non-VMM: smallest segment to allocate */
    bool vmm;
    bool whole;              /* non-VMM: a block is its whole segment (see arena.c) */
    const char *name;        /* "small" / "large" */
} spw_arena_params;

spw_status spw__arena_create(const spw_arena_params *p, spw_arena **out);
/* A block is its whole segment (p.whole): cached blocks serve only requests of their size. */
bool spw__arena_whole(const spw_arena *a);
/* The arena maps pages in one reservation (VMM). */
bool spw__arena_pages(const spw_arena *a);
void spw__arena_destroy(spw_arena *a);
/* The following are called with the owner's lock held (the context's). */
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
/* VMM: [addr, addr + bytes) (addr a multiple of 512) as a live block for stream s, where it lies
 * within one cached block of s's pool (the bytes around it stay cached); waits s owes on it are
 * handed out as by spw__arena_alloc_ordered. SPW_ERR_OUT_OF_MEMORY (no message) where it does not
 * lie so. For placement chosen by the caller (a ring: spw__arena_next_run). */
spw_status spw__arena_alloc_at(spw_arena *a, uintptr_t addr, size_t bytes, spw_stream s, spw_block **out,
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
/* While trims are refused (allowed false), spw__arena_trim releases nothing and returns SPW_OK
 * without waiting, so an allocation that needs one fails with SPW_ERR_OUT_OF_MEMORY instead:
 * for work that must not make the host wait (a prefetch, a hint). */
void spw__arena_allow_trim(spw_arena *a, bool allowed);
/* VMM: map up to `bytes` (whole pages, within the budget) as one free block of stream s's pool,
 * where one hole can take them. Other arenas: nothing. */
spw_status spw__arena_map_free(spw_arena *a, size_t bytes, spw_stream s);
size_t spw__arena_largest_free(const spw_arena *a);
/* Whether spw__arena_alloc could serve `bytes` on stream s without returning cached memory to
 * the backend: from a cached block, or (VMM) by mapping pages within the budget. */
bool spw__arena_fits(spw_arena *a, size_t bytes, spw_stream s);
/* A live block's worth as room (arena_window.c): 0 when it must stay, else higher for a block
 * that is better given up. `owner` is what spw__block_set_owner recorded. */
typedef uint64_t (*spw_arena_rank)(void *u, void *owner);
/* VMM: the owners (at most max) of the live blocks to give up so that one run of adjacent blocks,
 * each cached in s's pool or live with an owner that rank() puts above 0, holds `bytes`: of all
 * such runs, the one whose lowest-ranked block ranks highest, then the one with the fewest live
 * bytes. Returns how many were written to owners; 0 when no run exists (and on other arenas).
 * Nothing changes: the caller frees the blocks into s's pool, where they coalesce. */
size_t spw__arena_window(spw_arena *a, size_t bytes, spw_stream s, spw_arena_rank rank, void *u, void **owners,
                         size_t max);
/* VMM: the next place for a ring's `bytes` on stream s. Scanning the blocks from address `from`
 * (to the end, then from the first block back to `from`), the first run of adjacent blocks holding
 * bytes from its start (at `from` within the first block) in which every block is cached in s's
 * pool or live with an owner that accept() takes (1). A block accept() refuses (0), a hole,
 * another pool's cached block or a live block with no owner ends the run; the scan goes on after
 * it. 1: found, *at its start, the owners of its live blocks in owners (*n, at most max). 0: no
 * such run. -1: accept() answered -1 (stop: the scan ends there). -2: a run needed more than max
 * owners. Nothing changes. */
int spw__arena_next_run(const spw_arena *a, uintptr_t from, size_t bytes, spw_stream s, int (*accept)(void *u, void *owner),
                        void *u, void **owners, size_t max, size_t *n, uintptr_t *at);
/* Record what holds live block b (NULL: nothing a window may give up); cleared when b is freed. */
void spw__block_set_owner(spw_block *b, void *owner);
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

#endif /* SPW_ARENA_H */
