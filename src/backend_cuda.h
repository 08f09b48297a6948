/*
 * Private to the cuda backend (backend_cuda.c: runtime calls, streams, events, memory;
 * backend_cuda_vmm.c: virtual memory through driver entry points resolved at run time). Types
 * only from <cuda.h>: nothing may call a cu* symbol directly (see backend_cuda.c).
 */
#ifndef SPW_BACKEND_CUDA_H
#define SPW_BACKEND_CUDA_H

#include <cuda.h> /* types and enums only: never call a cu* symbol directly */
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <pthread.h>

#include "backend.h"
#include "internal.h"

/* The ABI version of the driver entry points requested; the PFN_*_v* typedefs below match it. */
#define SPW_CUDA_ENTRY_VERSION 12000

_Static_assert(sizeof(void *) == sizeof(PFN_cuMemCreate_v10020),
               "function pointers must be the size of void* to come from the entry-point query");

/* Driver entry points, resolved at create. vmm_ok is 1 only if all VMM ones resolved. */
typedef struct cu_fns {
    PFN_cuGetErrorString_v6000 get_error_string; /* optional: messages only */
    PFN_cuDeviceGet_v2000 device_get;
    PFN_cuDeviceGetAttribute_v2000 device_get_attribute;
    PFN_cuMemGetAllocationGranularity_v10020 get_granularity;
    PFN_cuMemAddressReserve_v10020 address_reserve;
    PFN_cuMemAddressFree_v10020 address_free;
    PFN_cuMemCreate_v10020 create;
    PFN_cuMemRelease_v10020 release;
    PFN_cuMemMap_v10020 map;
    PFN_cuMemUnmap_v10020 unmap;
    PFN_cuMemSetAccess_v10020 set_access;
    int vmm_ok;
} cu_fns;

/* One va_reserve: [base, base + bytes), bytes a multiple of its page (a power-of-two multiple of
 * the granularity). mapped[i] says whether page i is mapped, and handles[i] is then its physical
 * allocation. */
typedef struct cuda_resv {
    uintptr_t base;
    size_t bytes;
    size_t page;
    size_t pages;
    size_t mapped_count;
    CUmemGenericAllocationHandle *handles;
    unsigned char *mapped;
    struct cuda_resv *next;
} cuda_resv;

typedef struct cuda_backend {
    spw_backend base; /* first: spw_backend * and cuda_backend * convert both ways */
    spw_backend_ops ops; /* per instance: VMM entries are NULL when VMM is unavailable */
    cu_fns cu;
    CUdevice cudev;
    size_t granularity; /* 0 when VMM is unavailable */
    int vmm_supported;
    int concurrent_managed;
    int pageable_access;
    pthread_mutex_t lock; /* guards resv: map/unmap may come from several threads */
    cuda_resv *resv;
} cuda_backend;

static inline cuda_backend *as_cuda(spw_backend *b) { return (cuda_backend *)b; }

/* ---- errors and device binding (backend_cuda.c) ---- */

/* Runtime failure: record the message, clear the runtime's last error, return `status`. */
SPW_PRINTF(3, 4)
spw_status spw__cuda_rt_fail(spw_status status, cudaError_t e, const char *fmt, ...);
/* Default mapping for runtime errors: device exhaustion is SPW_ERR_OUT_OF_MEMORY. */
spw_status spw__cuda_rt_status(cudaError_t e);
/* Driver failure, from an entry point. */
SPW_PRINTF(4, 5)
spw_status spw__cuda_cu_fail(const cuda_backend *c, spw_status status, CUresult r, const char *fmt,
                             ...);
spw_status spw__cuda_cu_status(CUresult r);
/* Make the backend's device current on the calling thread (cheap when it already is). */
spw_status spw__cuda_bind(const cuda_backend *c);

#define RT_CHECK(call, ...)                                                                        \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (SPW_UNLIKELY(e_ != cudaSuccess))                                                       \
            return spw__cuda_rt_fail(spw__cuda_rt_status(e_), e_, __VA_ARGS__);                    \
    } while (0)

#define BIND(c)                                                                                    \
    do {                                                                                           \
        spw_status s_ = spw__cuda_bind(c);                                                         \
        if (s_ != SPW_OK) return s_;                                                               \
    } while (0)

/* ---- virtual memory (backend_cuda_vmm.c) ---- */

/* Decide whether VMM is usable; any failure just turns it off (vmm_supported 0). */
void spw__cuda_probe_vmm(cuda_backend *c);
spw_status spw__cuda_va_reserve(spw_backend *b, size_t bytes, size_t page, void **va);
spw_status spw__cuda_va_release(spw_backend *b, void *va, size_t bytes);
spw_status spw__cuda_map(spw_backend *b, void *va, size_t bytes);
spw_status spw__cuda_unmap(spw_backend *b, void *va, size_t bytes);
/* Unmap and free every reservation (backend destroy; device work using them drained). */
void spw__cuda_vmm_release_all(cuda_backend *c);

#endif
