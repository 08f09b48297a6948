/*
 * spillway for PyTorch: the entry points of torch.cuda.memory.CUDAPluggableAllocator (C ABI, no
 * torch or CUDA header needed), in libspillway like the rest of the API (spillway.h).
 *
 * One context per device, created on the first allocation for that device from the defaults,
 * then SPILLWAY_CONF, then spw_torch_configure()'s list; the `device` option is the device
 * PyTorch names. `budget` may be per device in either list: "budget=0:4GiB;1:8GiB" (devices not
 * listed keep the default, 90%). grow_ahead defaults to 0 and vmm to off here: PyTorch caches
 * blocks of whole segments itself, and a plain segment is much cheaper to create.
 *
 * Every function may be called from any thread. The allocate path reads the device's context
 * without a lock once it exists, then takes only that context's lock (spw_malloc).
 * spillway.torch.use_allocator registers spw_torch_alloc/spw_torch_free through
 * torch._C._cuda_customAllocator; the other hooks are for C++ programs that set them with
 * CUDAPluggableAllocator::set_init_fn, set_reset_fn, set_memory_fraction_fn and
 * set_record_stream_fn (PyTorch has no Python binding for those).
 */
#ifndef SPILLWAY_TORCH_H
#define SPILLWAY_TORCH_H

#include "spillway.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Options for contexts not yet created: "key=value,..." applied after SPILLWAY_CONF. All or
 * nothing: the whole list is checked first (SPW_ERR_CONFIG names the key). NULL or "" clears it.
 * SPW_ERR_STATE once any device's context exists (options apply at creation only). */
SPW_API spw_status spw_torch_configure(const char *conf);
/* alloc_fn: size bytes on device for use on stream. NULL when it cannot be satisfied under the
 * device's budget (after releasing cache and evicting unpinned buffers), when size is 0, or on
 * a bad device; the reason is this thread's spw_last_error(), and for a refusal under the budget
 * also spw_torch_oom_message(device) (readable from any thread). The host waits for the device
 * only at the budget, when cached memory is released (the streams that used it are synchronized
 * first); otherwise never. */
SPW_API void *spw_torch_alloc(size_t size, int device, spw_stream stream);
/* A function that gives cached memory back to spillway: PyTorch keeps freed tensors' segments
 * cached in its own pool, where only PyTorch can release them, and it skips its own release and
 * retry while a pool is routed to. When set, an allocation refused under the budget calls
 * reclaim(device) and, if it returns nonzero, tries once more. It is called on the allocating
 * thread with no spillway lock held (so it may free spillway memory), never re-entered on a thread
 * already inside it (an allocation it makes itself is refused plainly). NULL unsets it. */
typedef int (*spw_torch_reclaim_fn)(int device);
SPW_API void spw_torch_set_reclaim(spw_torch_reclaim_fn reclaim);
/* free_fn: ptr from spw_torch_alloc(size, device, ...), whose last use is ordered on stream (the
 * allocation's stream, as PyTorch passes it). Streams named by spw_torch_record_stream are waited
 * for (stream-ordered: the device waits, the host does not) before the block can be reused.
 * A NULL ptr is ignored. A pointer not live on that device, or a size other than the one
 * allocated, changes nothing and sets spw_last_error(). */
SPW_API void spw_torch_free(void *ptr, size_t size, int device, spw_stream stream);
/* init_fn: PyTorch's device count; later device indices at or past it are refused. */
SPW_API void spw_torch_init(int device_count);
/* reset_fn (torch.cuda.empty_cache): return the cached memory of every device's context. */
SPW_API void spw_torch_reset(void);
/* memory_fraction_fn: budget = fraction (0 < f <= 1) of the device's memory. Before the context
 * exists it replaces the configured budget; after, it may lower the budget or raise it up to
 * the budget the context was created with (cached memory above a lowered budget is released;
 * live memory above it stays until freed). A bad fraction changes nothing. */
SPW_API void spw_torch_memory_fraction(double fraction, int device);
/* record_stream_fn: ptr (live, from spw_torch_alloc) is also used by work on stream; its block
 * is not reused until the work enqueued on stream before the free completes. */
SPW_API void spw_torch_record_stream(void *ptr, spw_stream stream);
/* The context of device (created now when create is nonzero). SPW_ERR_NOT_FOUND when it does
 * not exist and create is 0. The context belongs to these entry points: never destroy it. */
SPW_API spw_status spw_torch_context(int device, int create, spw_ctx **out);
/* Allocations refused under device's budget so far, and the message of the latest refusal
 * (written to buf, always NUL-terminated; "" when none). */
SPW_API uint64_t spw_torch_oom_count(int device);
/* 1 while the latest allocation on device was refused under its budget (a later success clears
 * it): PyTorch's out-of-memory observer uses it to tell spillway's refusals from other OOMs. */
SPW_API int spw_torch_oom_pending(int device);
SPW_API spw_status spw_torch_oom_message(int device, char *buf, size_t len);
/* What PyTorch asked of device since the process started (or the last shutdown): out[0] calls
 * of spw_torch_alloc (PyTorch's segment allocations: it caches blocks within them), out[1]
 * nanoseconds spent inside them (host clock, reclaim calls included), out[2] calls of
 * spw_torch_free, out[3] nanoseconds inside those. Counts every call, refused ones too. Zeros for
 * a bad device. */
SPW_API void spw_torch_call_stats(int device, uint64_t out[4]);
/* Destroy every device's context and forget the configuration (tests, process teardown).
 * SPW_ERR_STATE, changing nothing, while any context has live allocations. */
SPW_API spw_status spw_torch_shutdown(void);

#ifdef __cplusplus
}
#endif
#endif /* SPILLWAY_TORCH_H */
