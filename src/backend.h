/*
 * The backend seam: everything spillway asks of a device goes through this vtable.
 * Two implementations: backend_cuda.c (CUDA runtime, driver VMM entry points resolved at run
 * time) and backend_emu.c (a device emulated in host memory, with asynchrony and fault injection).
 *
 * Contracts shared by both:
 * - Every function returns SPW_OK or an error status and sets the thread-local message
 *   (spw__error) naming the call and the numbers; it never prints or aborts.
 * - A failed call leaves no resource behind (a failed map maps nothing, ...).
 * - Stream NULL is the default stream. Events and streams are opaque pointers; on cuda they are
 *   the CUDA objects themselves.
 * - Device pointers returned by emu are host addresses: host callbacks ("kernels") may use them.
 */
#ifndef SPW_BACKEND_H
#define SPW_BACKEND_H

#include "spillway.h"

typedef struct CUevent_st *spw_event;
typedef struct spw_backend spw_backend;

/* Kinds of backend calls, for fault injection and counting. */
#define SPW_BACKEND_CALLS(X)                                                                  \
    X(DEV_ALLOC, "dev_alloc")                                                                 \
    X(DEV_FREE, "dev_free")                                                                   \
    X(VA_RESERVE, "va_reserve")                                                               \
    X(VA_RELEASE, "va_release")                                                               \
    X(MAP, "map")                                                                             \
    X(UNMAP, "unmap")                                                                         \
    X(HOST_ALLOC, "host_alloc")                                                               \
    X(HOST_FREE, "host_free")                                                                 \
    X(HOST_REGISTER, "host_register")                                                         \
    X(HOST_UNREGISTER, "host_unregister")                                                     \
    X(MANAGED_ALLOC, "managed_alloc")                                                         \
    X(MANAGED_ADVISE, "managed_advise")                                                       \
    X(PREFETCH, "prefetch")                                                                   \
    X(STREAM_CREATE, "stream_create")                                                         \
    X(STREAM_DESTROY, "stream_destroy")                                                       \
    X(STREAM_SYNC, "stream_sync")                                                             \
    X(EVENT_CREATE, "event_create")                                                           \
    X(EVENT_DESTROY, "event_destroy")                                                         \
    X(EVENT_RECORD, "event_record")                                                           \
    X(EVENT_QUERY, "event_query")                                                             \
    X(EVENT_SYNC, "event_sync")                                                               \
    X(STREAM_WAIT, "stream_wait")                                                             \
    X(MEMCPY, "memcpy")                                                                       \
    X(LAUNCH_HOST, "launch_host")                                                             \
    X(MEM_INFO, "mem_info")

typedef enum spw_call {
#define SPW_CALL_ENUM_(id, name) SPW_CALL_##id,
    SPW_BACKEND_CALLS(SPW_CALL_ENUM_)
#undef SPW_CALL_ENUM_
    SPW_CALL_COUNT_
} spw_call;

const char *spw__call_name(spw_call call);

typedef enum spw_copy_kind {
    SPW_COPY_H2D,
    SPW_COPY_D2H,
    SPW_COPY_D2D,
    SPW_COPY_H2H,
} spw_copy_kind;

typedef enum spw_managed_advice {
    SPW_ADVISE_PREFERRED_DEVICE, /* preferred location: the device */
    SPW_ADVISE_PREFERRED_HOST,
    SPW_ADVISE_READ_MOSTLY,
    SPW_ADVISE_UNSET_READ_MOSTLY,
} spw_managed_advice;

typedef struct spw_device_info {
    char name[128];
    size_t total_bytes;
    size_t free_bytes;
    int cc_major, cc_minor;
    int vmm_supported;             /* virtual memory management (map/unmap in place) */
    size_t vmm_granularity;        /* physical mapping granularity, bytes */
    int concurrent_managed_access; /* managed memory usable with prefetch and concurrent access */
    int pageable_memory_access;
    int emulated;                  /* 1 on emu */
} spw_device_info;

typedef struct spw_backend_ops {
    const char *name;
    void (*destroy)(spw_backend *b);
    spw_status (*device_info)(spw_backend *b, spw_device_info *out);
    spw_status (*mem_info)(spw_backend *b, size_t *free_bytes, size_t *total_bytes);

    /* Plain device allocation (cudaMalloc). */
    spw_status (*dev_alloc)(spw_backend *b, size_t bytes, void **out);
    spw_status (*dev_free)(spw_backend *b, void *ptr);

    /* Virtual memory: reserve address space with a page size (0: vmm_granularity; else a
     * power-of-two multiple of it), then map physical memory into it in multiples of that page.
     * map creates one physical allocation per page, maps it at va and grants the device
     * read/write access; unmap releases any page-aligned subrange of mapped memory (parts of one
     * map or several). Larger pages mean fewer physical allocations under a buffer, and a copy
     * is split at each one, so that enqueuing a copy costs host time per page under it.
     * Callers finish all device work on a range before unmapping it.
     * NULL when unsupported (device_info.vmm_supported == 0). */
    spw_status (*va_reserve)(spw_backend *b, size_t bytes, size_t page, void **va);
    spw_status (*va_release)(spw_backend *b, void *va, size_t bytes);
    spw_status (*map)(spw_backend *b, void *va, size_t bytes);
    spw_status (*unmap)(spw_backend *b, void *va, size_t bytes);

    /* Pinned host memory. */
    spw_status (*host_alloc)(spw_backend *b, size_t bytes, void **out);
    spw_status (*host_free)(spw_backend *b, void *ptr);
    spw_status (*host_register)(spw_backend *b, void *ptr, size_t bytes);
    spw_status (*host_unregister)(spw_backend *b, void *ptr);

    /* Managed (Unified) memory. */
    spw_status (*managed_alloc)(spw_backend *b, size_t bytes, void **out);
    spw_status (*managed_free)(spw_backend *b, void *ptr);
    spw_status (*managed_advise)(spw_backend *b, void *ptr, size_t bytes, spw_managed_advice a);
    /* Migrate [ptr, ptr+bytes) to the device (to_device=1) or host, ordered on stream. */
    spw_status (*prefetch)(spw_backend *b, void *ptr, size_t bytes, int to_device,
                           spw_stream stream);

    /* Streams and events. event_query returns SPW_OK when complete, SPW_ERR_NOT_READY if not. */
    spw_status (*stream_create)(spw_backend *b, spw_stream *out);
    spw_status (*stream_destroy)(spw_backend *b, spw_stream s);
    spw_status (*stream_sync)(spw_backend *b, spw_stream s);
    spw_status (*event_create)(spw_backend *b, spw_event *out);
    spw_status (*event_destroy)(spw_backend *b, spw_event e);
    spw_status (*event_record)(spw_backend *b, spw_event e, spw_stream s);
    spw_status (*event_query)(spw_backend *b, spw_event e);
    spw_status (*event_sync)(spw_backend *b, spw_event e);
    /* Work enqueued on s after this call waits for e's recorded work. */
    spw_status (*stream_wait)(spw_backend *b, spw_stream s, spw_event e);

    spw_status (*memcpy_async)(spw_backend *b, void *dst, const void *src, size_t bytes,
                               spw_copy_kind kind, spw_stream s);
    spw_status (*launch_host)(spw_backend *b, spw_stream s, void (*fn)(void *), void *arg);
} spw_backend_ops;

struct spw_backend {
    const spw_backend_ops *ops;
    int device;
};

/* Constructors. opts may carry backend-specific settings; see options.h. */
typedef struct spw_backend_params {
    int device;
    size_t emu_capacity;    /* emu: device bytes */
    size_t emu_granularity; /* emu: VMM granularity (default 2 MiB) */
    int emu_vmm;            /* emu: offer VMM (default 1) */
    int emu_managed;        /* emu: offer concurrent managed access (default 1) */
    double emu_h2d_gbps;    /* emu: simulated copy bandwidth, 0 = as fast as memcpy */
    size_t emu_pin_limit;   /* emu: host bytes host_alloc and host_register page-lock, 0 = no limit */
} spw_backend_params;

spw_status spw__backend_emu_create(const spw_backend_params *p, spw_backend **out);
/* SPW_ERR_NO_DEVICE when the CUDA runtime finds no device (or is not built in). */
spw_status spw__backend_cuda_create(const spw_backend_params *p, spw_backend **out);
/* 1 if a CUDA device is usable; never fails loudly. */
int spw__backend_cuda_available(void);

/* Order stream s after event e: s waits on it, or, where that cannot be enqueued, the host
 * waits for it. */
spw_status spw__backend_order_after(spw_backend *b, spw_stream s, spw_event e);

/* ---- emu only: fault injection and inspection (tests) ---- */

/* Fail the nth call (1-based, counted from now) of kind `call`; persistent: that call and every
 * later one of that kind fail. n == 0 clears the fault for that kind. */
void spw__emu_inject(spw_backend *b, spw_call call, unsigned long n, int persistent);
void spw__emu_clear_faults(spw_backend *b);
/* Calls of each kind made so far. */
unsigned long spw__emu_calls(spw_backend *b, spw_call call);
/* Device bytes currently allocated (dev_alloc + mapped). */
size_t spw__emu_used(spw_backend *b);
int spw__backend_is_emu(const spw_backend *b);

#endif /* SPW_BACKEND_H */
