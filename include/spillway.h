/*
 * spillway: use more GPU memory than the card has, on purpose and at the speed of the link.
 *
 * The public API; the PyTorch allocator's entry points are in spillway_torch.h (the same
 * library). It needs no CUDA header: streams are `struct CUstream_st *`, the same
 * type as `cudaStream_t` and `CUstream`, so CUDA programs pass their streams unchanged.
 *
 * Thread safety: every function may be called from any thread at any time. Calls on one context
 * are serialised internally where they touch shared state; the allocator's hot path takes one
 * uncontended lock and makes no system call. Destroying a context while another thread uses it
 * is the caller's error.
 *
 * Errors: every function that can fail returns an spw_status. On failure, spw_last_error() gives
 * a message for the calling thread naming the numbers involved (requested bytes, budget, held,
 * ...). A failed call changes nothing unless its documentation says otherwise.
 */
#ifndef SPILLWAY_H
#define SPILLWAY_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SPW_VERSION_MAJOR 0
#define SPW_VERSION_MINOR 1
#define SPW_VERSION_PATCH 0
#define SPW_VERSION_STRING "0.1.0"

#if defined(__GNUC__)
#define SPW_API __attribute__((visibility("default")))
#else
#define SPW_API
#endif

typedef enum spw_status {
    SPW_OK = 0,
    SPW_ERR_INVALID_ARGUMENT, /* NULL handle, zero or absurd size, bad flag */
    SPW_ERR_OUT_OF_MEMORY,    /* the device budget (or the device) cannot satisfy the request */
    SPW_ERR_HOST_OUT_OF_MEMORY, /* the pinned host budget or host memory is exhausted */
    SPW_ERR_CONFIG,           /* unknown option or bad option value */
    SPW_ERR_BACKEND,          /* the backend (CUDA or emu) reported a failure */
    SPW_ERR_UNSUPPORTED,      /* the backend or device cannot do this */
    SPW_ERR_NOT_FOUND,        /* pointer or handle not owned by this context */
    SPW_ERR_STATE,            /* call not valid in the object's current state (double free, ...) */
    SPW_ERR_NOT_READY,        /* asynchronous work still pending (queries only) */
    SPW_ERR_IO,               /* file could not be read or written */
    SPW_ERR_PARSE,            /* malformed input file; the message names the line */
    SPW_ERR_NO_DEVICE,        /* no usable GPU */
    SPW_STATUS_COUNT_
} spw_status;

/* Static name of a status code ("SPW_ERR_OUT_OF_MEMORY"); never NULL. */
SPW_API const char *spw_status_str(spw_status status);

/* Message describing the last failure on the calling thread; "" if none. The text stays valid
 * until the next failing spillway call on the same thread. */
SPW_API const char *spw_last_error(void);

/* Library version string, e.g. "0.1.0". */
SPW_API const char *spw_version(void);

typedef struct CUstream_st *spw_stream; /* NULL is the default stream */
typedef struct spw_ctx spw_ctx;
typedef struct spw_config spw_config;

/* ---------------------------------------------------------------------------------------------
 * Configuration. One options table; `spillway --help-options` lists it. Values are strings;
 * sizes are written in the size grammar below.
 * Options: budget, backend (auto|cuda|emu), device, on_exhaust (fail|evict), vmm (auto|on|off),
 * emu_capacity, ... An unknown key or bad value fails with SPW_ERR_CONFIG naming the key.
 * ------------------------------------------------------------------------------------------- */

/* New configuration holding every option's default. */
SPW_API spw_status spw_config_create(spw_config **out);
SPW_API void spw_config_destroy(spw_config *cfg);
/* Set one option. On error the configuration is unchanged. */
SPW_API spw_status spw_config_set(spw_config *cfg, const char *key, const char *value);
/* Apply a list "key=value,key=value". All or nothing: on error nothing is applied. */
SPW_API spw_status spw_config_parse(spw_config *cfg, const char *list);
/* Apply the SPILLWAY_CONF environment variable, if set (all or nothing). */
SPW_API spw_status spw_config_from_env(spw_config *cfg);
/* Current value of an option as text, written to buf (always NUL-terminated). */
SPW_API spw_status spw_config_get(const spw_config *cfg, const char *key, char *buf, size_t len);
/* Print the options table (name, default, help) to f. */
SPW_API void spw_config_print_help(FILE *f);

/* ---------------------------------------------------------------------------------------------
 * Sizes: one grammar for every surface (options, SPILLWAY_CONF, the CLI, Python, the
 * interposer; docs/sizes.md). A number, integer or decimal (no sign, no exponent), then an
 * optional unit B, K, KB, KiB, M, MB, MiB, G, GB, GiB, T, TB or TiB, in any case, with or without
 * blanks between; leading and trailing blanks are ignored. EVERY UNIT IS BINARY: "6GB", "6 G"
 * and "6GiB" are all 6 x 2^30 bytes. Without a unit (or in B) the number is a whole number of
 * bytes; with a larger unit a decimal is rounded down to a whole byte. At most 2^63 - 1 bytes.
 * Where a budget is asked for, "N%" (0 < N <= 100, blanks allowed before '%') is N percent of
 * the device. Errors are SPW_ERR_CONFIG with a message that quotes the text and says why.
 * Sizes print as "512 B" below 1 KiB, else with two decimals in KiB, MiB, GiB or TiB ("1.50 GiB").
 * ------------------------------------------------------------------------------------------- */

/* Parse a size ("6GiB", "6 GB", "512M", "1048576"); 0 is accepted. Percentages are refused. */
SPW_API spw_status spw_parse_size(const char *text, size_t *out);
/* Parse a budget: a size of at least 1 byte, or "N%" of the device. *bytes (when not NULL)
 * gets the size, or N% of device_total rounded down (0 when device_total is 0); *percent (when
 * not NULL) gets N, or 0 for a size. Nothing is written on error. */
SPW_API spw_status spw_parse_budget(const char *text, uint64_t device_total, uint64_t *bytes, double *percent);
/* Print bytes as the library does ("1.50 GiB", "512 B") into buf (24 bytes are enough); returns
 * buf (always NUL-terminated), or "" when buf is NULL or len is 0. */
SPW_API const char *spw_format_size(uint64_t bytes, char *buf, size_t len);

/* ---------------------------------------------------------------------------------------------
 * Context: one device, one backend, one budget.
 * ------------------------------------------------------------------------------------------- */

/* Create a context. cfg may be NULL: defaults, then SPILLWAY_CONF. A non-NULL cfg is used as
 * given (call spw_config_from_env on it to honour the environment). */
SPW_API spw_status spw_ctx_create(const spw_config *cfg, spw_ctx **out);
/* Destroy a context: waits for its streams' work, returns all memory. Live allocations are
 * released (and counted as leaked in the summary). NULL is accepted and ignored. */
SPW_API spw_status spw_ctx_destroy(spw_ctx *ctx);
/* "cuda" or "emu". */
SPW_API const char *spw_ctx_backend(const spw_ctx *ctx);
/* The resolved device budget in bytes. */
SPW_API size_t spw_ctx_budget(const spw_ctx *ctx);

/* Streams of the context's backend (on cuda these are ordinary CUDA streams). */
SPW_API spw_status spw_stream_create(spw_ctx *ctx, spw_stream *out);
SPW_API spw_status spw_stream_destroy(spw_ctx *ctx, spw_stream stream);
SPW_API spw_status spw_stream_synchronize(spw_ctx *ctx, spw_stream stream);
/* Enqueue fn(arg) on stream, ordered like a kernel. On emu this is how "kernels" run. fn must
 * not call spillway or the backend. */
SPW_API spw_status spw_launch_host(spw_ctx *ctx, spw_stream stream, void (*fn)(void *), void *arg);

/* ---------------------------------------------------------------------------------------------
 * Caching device allocator.
 * ------------------------------------------------------------------------------------------- */

/* Allocate bytes of device memory for use on stream. The memory may be used by work enqueued on
 * stream after this call (and on other streams only after the caller orders them after it).
 * Never exceeds the budget: on exhaustion it reuses cached blocks, then releases cached memory,
 * then fails with SPW_ERR_OUT_OF_MEMORY. *out is untouched on failure. Alignment: 512 bytes. */
SPW_API spw_status spw_malloc(spw_ctx *ctx, size_t bytes, spw_stream stream, void **out);
/* Free ptr. Work already enqueued on `stream` that uses ptr may still run: the block is reused
 * by later allocations on the same stream at once, by other streams only after that work. The
 * stream must be one on which the last use of ptr was enqueued. */
SPW_API spw_status spw_free(spw_ctx *ctx, void *ptr, spw_stream stream);
/* Return all cached (free) device memory to the backend. Waits for pending frees. */
SPW_API spw_status spw_empty_cache(spw_ctx *ctx);

/* ---------------------------------------------------------------------------------------------
 * Statistics: one list, from which the struct, the JSON and the summary are generated.
 * ------------------------------------------------------------------------------------------- */

typedef struct spw_counter {
    int64_t current; /* for levels: now; for events: same as total */
    int64_t peak;
    int64_t total;   /* for levels: sum of increases; for events: count */
} spw_counter;

/* X(name, is_bytes, description) */
#define SPW_STAT_LIST(X)                                                                      \
    X(held, 1, "device bytes held from the backend")                                          \
    X(live, 1, "device bytes in live allocations")                                            \
    X(cached, 1, "held device bytes not in live allocations")                                 \
    X(requested, 1, "device bytes asked for by live allocations (before rounding)")           \
    X(segments, 0, "mapped segments (chunks) held from the backend")                          \
    X(allocs, 0, "spw_malloc calls that succeeded")                                           \
    X(frees, 0, "spw_free calls that succeeded")                                              \
    X(backend_allocs, 0, "calls that obtained device memory from the backend")               \
    X(backend_frees, 0, "calls that returned device memory to the backend")                  \
    X(cross_stream_waits, 0, "reuses of a block on another stream, ordered by an event")      \
    X(trim_syncs, 0, "host waits for the device to return cached memory (trims)")             \
    X(window_evictions, 0, "uploads given room by evicting adjacent buffers instead of a trim") \
    X(ring_uploads, 0, "uploads placed in a split's room after the one before (its ring)")       \
    X(ooms, 0, "allocations refused for lack of memory")                                      \
    X(bytes_h2d, 1, "buffer bytes copied host to device (uploads, managed prefetches)")        \
    X(bytes_d2h, 1, "buffer bytes copied device to host (write-backs, managed evictions)")     \
    X(evictions_clean, 0, "evictions that dropped a clean or dead device copy (no copy)")      \
    X(evictions_dirty, 0, "evictions that wrote a dirty device copy back to the host")         \
    X(managed_collapses, 0, "device replicas of evicted read-only managed buffers dropped")   \
    X(prefetch_hits, 0, "acquires of a buffer made resident by a prefetch")                    \
    X(stalls, 0, "acquires whose stream had to wait on a transfer not yet known complete")     \
    X(stall_ns, 0, "nanoseconds streams waited on transfers at acquires (with the trace on)") \
    X(buffers_resident, 0, "buffers with a device copy")                                       \
    X(buffers_host, 0, "buffers with only a host copy (or dead)")                              \
    X(resident_bytes, 1, "bytes of buffers with a device copy (offloaded weights on the device)") \
    X(host_held, 1, "pinned host bytes held by the buffer host pool")                          \
    X(host_pageable, 1, "registered host copies the system would not page-lock (slower copies)") \
    X(h2d_pageable, 1, "buffer bytes uploaded from host copies that are not page-locked")      \
    X(repins, 0, "host copies page-locked or unlocked to give page-locked memory to what moves") \
    X(pinned, 1, "device bytes of acquired (pinned) buffers")                                 \
    X(plan_hits, 0, "policy=plan: acquisitions that matched the learned plan")                \
    X(plan_divergences, 0, "policy=plan: steps that left the plan (then LRU for the step)")   \
    X(plan_prefetch_bytes, 1, "policy=plan: bytes prefetched ahead of the caller")            \
    X(plan_prefetch_used, 1, "policy=plan: prefetched bytes that were then acquired")         \
    X(plan_prefetch_wasted, 1, "policy=plan: prefetched bytes evicted before any use")         \
    X(lock_waits, 0, "buffer calls that found the context lock held by another thread")         \
    X(lock_wait_ns, 0, "nanoseconds those calls waited for the context lock")

typedef struct spw_stats {
#define SPW_STAT_FIELD_(name, is_bytes, desc) spw_counter name;
    SPW_STAT_LIST(SPW_STAT_FIELD_)
#undef SPW_STAT_FIELD_
    uint64_t budget;
    uint64_t largest_free_block;
    /* The arenas map and hold whole pages of `page` bytes, so of the budget they can hold
     * budget_usable: the budget rounded down to a multiple of page. The summary says so when
     * the two differ, and warns when more than 1% of the budget is lost. */
    uint64_t page;
    uint64_t budget_usable;
} spw_stats;

SPW_API spw_status spw_stats_get(spw_ctx *ctx, spw_stats *out);
/* Start every counter's peak again from its current value (torch.cuda.reset_peak_memory_stats). */
SPW_API spw_status spw_stats_reset_peaks(spw_ctx *ctx);
/* Readable table of the statistics. */
SPW_API spw_status spw_summary(spw_ctx *ctx, FILE *f);
/* The same as one JSON object (no trailing newline). */
SPW_API spw_status spw_summary_json(spw_ctx *ctx, FILE *f);

/* ---------------------------------------------------------------------------------------------
 * Movable buffers (offload engine). A buffer has a host copy (pinned, from the context's host
 * pool, or the caller's memory via spw_buf_register_host) and, while resident, a device copy
 * taken from the same budget as spw_malloc. Under budget pressure unpinned buffers are evicted
 * by the policy (option policy=lru|plan); clean and dead data are dropped, never written back.
 * Options: residency=explicit|managed, policy=lru|plan, host_budget=SIZE (pinned
 * host pool; default 50% of RAM), trace=FILE (Chrome trace JSON of copies, evictions, stalls).
 * Threads: any call from any thread; engine state is guarded by the context lock, which is
 * never held while waiting for a transfer (spw_buf_read/write/destroy wait without it).
 * Concurrent calls on ONE buffer are safe, but their order is the caller's: e.g. a host write
 * racing a device acquire of the same buffer gives either order. A buffer acquired on two
 * streams at once is allowed; the second release then waits (on its stream) for the first use.
 * Use of a destroyed buffer is reported (SPW_ERR_STATE) for the last 1024 destroyed buffers of
 * a context; beyond that, and after the context is destroyed, it is undefined.
 * ------------------------------------------------------------------------------------------- */

typedef struct spw_buf spw_buf;

enum {
    SPW_BUF_READ_ONLY = 1u << 0,  /* never written on the device: eviction never copies back */
    SPW_BUF_MANAGED = 1u << 1,    /* this buffer uses managed residency whatever the context's */
    SPW_BUF_EXPLICIT = 1u << 2,   /* this buffer uses explicit residency whatever the context's */
};

typedef enum spw_access {
    SPW_ACCESS_READ = 1,       /* contents are read; uploaded if not resident */
    SPW_ACCESS_WRITE = 2,      /* contents will be overwritten entirely: no upload */
    SPW_ACCESS_READ_WRITE = 3, /* read and modified */
} spw_access;

/* Create a buffer of `bytes` whose contents start as zeros in host memory. */
SPW_API spw_status spw_buf_create(spw_ctx *ctx, size_t bytes, unsigned flags, spw_buf **out);
/* Create a buffer whose host copy is the caller's memory [host, host+bytes) (weights already
 * loaded or memory-mapped): no copy is made; it is registered as pinned where possible. The
 * memory must outlive the buffer. */
SPW_API spw_status spw_buf_register_host(spw_ctx *ctx, void *host, size_t bytes, unsigned flags,
                                         spw_buf **out);
/* Destroy; waits for pending work on the buffer. Acquired buffers cannot be destroyed. */
SPW_API spw_status spw_buf_destroy(spw_buf *buf);
/* Copy host data in or out at an offset. Blocking: returns when the data has arrived. */
SPW_API spw_status spw_buf_write(spw_buf *buf, size_t offset, const void *src, size_t bytes);
SPW_API spw_status spw_buf_read(spw_buf *buf, size_t offset, void *dst, size_t bytes);
SPW_API size_t spw_buf_size(const spw_buf *buf);
/* The caller writes buf's host copy in place (an optimizer stepping master weights that a
 * framework uploads) from spw_buf_host_begin to spw_buf_host_end, on any thread. The begin drops
 * the device copy (written back first if dirty) and returns once no transfer into the host copy
 * is in flight; until the end no upload reads the host copy: prefetches of buf move nothing,
 * and spw_acquire, spw_evict, spw_buf_write, spw_buf_read, spw_discard and spw_buf_destroy
 * return SPW_ERR_STATE. The end makes the host copy the contents; the next acquire uploads it.
 * Begin on an acquired buffer, or twice, and an end without a begin, are SPW_ERR_STATE. Blocks
 * only in the begin, for a write-back in flight. */
SPW_API spw_status spw_buf_host_begin(spw_buf *buf);
SPW_API spw_status spw_buf_host_end(spw_buf *buf);

/* Make buf resident for work on `stream` and pin it there until spw_release. *devptr is valid
 * for work enqueued on stream after this call. Does not block the host on the transfer.
 * Managed residency: the transfer is cudaMemPrefetchAsync, and the CUDA driver may do the
 * migration's page work inside that call, so an acquire or prefetch of a managed buffer can
 * hold the calling thread for a time that grows with the buffer's size. */
SPW_API spw_status spw_acquire(spw_buf *buf, spw_stream stream, spw_access mode, void **devptr);
/* End the use begun by spw_acquire: records the last use on stream, without blocking. With
 * prefetch_thread=on the library's worker may enqueue that record a little later (never before
 * the use): stream must then stay valid until the next spw_step_end, the buffer's eviction or
 * destruction, or spw_ctx_destroy. */
SPW_API spw_status spw_release(spw_buf *buf, spw_stream stream);
/* spw_release(done, done_stream), then spw_acquire(buf, stream, mode, devptr), under one take of
 * the context lock: for a framework's hooks, which end one block's use and begin the next one's
 * back to back. done NULL: a plain spw_acquire. A failed release acquires nothing (its status);
 * a failed acquire leaves the release done. */
SPW_API spw_status spw_release_acquire(spw_buf *done, spw_stream done_stream, spw_buf *buf, spw_stream stream,
                                       spw_access mode, void **devptr);
/* Hints: start moving buf to the device (ordered before later work on stream) / off it.
 * spw_prefetch returns SPW_OK and moves nothing when the budget has no room that the policy
 * is willing to make (LRU displaces the least recently used; plan never displaces a buffer
 * needed sooner). */
SPW_API spw_status spw_prefetch(spw_buf *buf, spw_stream stream);
/* spw_prefetch into room the budget has free now, displacing nothing: for a caller that renews
 * buffers in the order the next step reads them (an optimizer's updated weights), where a
 * displacing prefetch would push out the ones renewed just before, needed sooner. */
SPW_API spw_status spw_prefetch_free(spw_buf *buf, spw_stream stream);
SPW_API spw_status spw_evict(spw_buf *buf);
/* The contents are dead: no copy of them needs to survive (next acquire should be WRITE). */
SPW_API spw_status spw_discard(spw_buf *buf);
/* Mark a repeating step (the plan policy learns one step and predicts the next). */
SPW_API spw_status spw_step_begin(spw_ctx *ctx);
SPW_API spw_status spw_step_end(spw_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif /* SPILLWAY_H */
