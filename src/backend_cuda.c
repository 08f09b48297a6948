/*
 * The cuda backend: the CUDA runtime API (shared libcudart) behind the spw_backend vtable.
 *
 * Nothing here links libcuda. The driver entry points the runtime does not wrap (virtual memory
 * management) are resolved at run time with cudaGetDriverEntryPointByVersion; <cuda.h> and
 * <cudaTypedefs.h> are included for types only. So a binary built with this file starts on a
 * machine without a driver, where spw__backend_cuda_available() simply returns 0.
 *
 * Errors: every failing CUDA call becomes an spw_status plus a thread-local message naming the
 * call, its numbers and the CUDA error. The runtime's last-error slot is cleared after each
 * failure (cudaGetLastError) so that an application checking cudaGetLastError after its own
 * launches does not see spillway's failures.
 *
 * Device binding: the runtime allocates, creates streams, resolves the default stream and
 * initialises a thread's context on the calling thread's current device. Every call makes the
 * backend's device current on the calling thread first (bind_device: as cudaSetDevice, and only a
 * thread-local read when it already is), so a thread that never chose a device does not
 * initialise device 0, and the application's current device may change after a spillway call.
 *
 * VMM: backend_cuda_vmm.c.
 */#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cuda.h"

/* ---- errors ---- */

/* Runtime failure: record the message, clear the runtime's last error, return `status`. */
SPW_PRINTF(3, 4)
spw_status spw__cuda_rt_fail(spw_status status, cudaError_t e, const char *fmt, ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    (void)cudaGetLastError();
    return spw__error(status, "cuda: %s failed: %s (%d)", what, cudaGetErrorString(e), (int)e);
}

/* Default mapping for runtime errors: device exhaustion is SPW_ERR_OUT_OF_MEMORY. */
spw_status spw__cuda_rt_status(cudaError_t e) {
    return e == cudaErrorMemoryAllocation ? SPW_ERR_OUT_OF_MEMORY : SPW_ERR_BACKEND;
}

/* Driver failure, from an entry point. */
SPW_PRINTF(4, 5)
spw_status spw__cuda_cu_fail(const cuda_backend *c, spw_status status, CUresult r, const char *fmt,
                             ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    const char *s = NULL;
    if (!c->cu.get_error_string || c->cu.get_error_string(r, &s) != CUDA_SUCCESS || !s)
        s = "driver error";
    return spw__error(status, "cuda: %s failed: %s (CUresult %d)", what, s, (int)r);
}

spw_status spw__cuda_cu_status(CUresult r) {
    return r == CUDA_ERROR_OUT_OF_MEMORY ? SPW_ERR_OUT_OF_MEMORY : SPW_ERR_BACKEND;
}

/* Make the backend's device current on the calling thread (cheap when it already is). */
spw_status spw__cuda_bind(const cuda_backend *c) {
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e == cudaSuccess && cur == c->base.device) return SPW_OK;
    if (e != cudaSuccess) (void)cudaGetLastError();
    RT_CHECK(cudaSetDevice(c->base.device), "cudaSetDevice(%d)", c->base.device);
    return SPW_OK;
}

/* ---- availability and driver entry points ---- */

int spw__backend_cuda_available(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver / no device: not an error for the caller */
        return 0;
    }
    return n > 0;
}

/* Resolve one driver symbol into *dst (a function pointer of `size` bytes); 1 on success.
 * The entry point arrives as void *; memcpy into the typed pointer keeps -Wpedantic quiet. */
static int resolve(const char *symbol, void *dst, size_t size) {
    void *p = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e =
        cudaGetDriverEntryPointByVersion(symbol, &p, SPW_CUDA_ENTRY_VERSION, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p || size != sizeof p) {
        (void)cudaGetLastError();
        return 0;
    }
    memcpy(dst, &p, sizeof p);
    return 1;
}

#define RESOLVE(name, field) resolve(name, &fns->field, sizeof fns->field)

static void resolve_all(cu_fns *fns) {
    memset(fns, 0, sizeof *fns);
    (void)RESOLVE("cuGetErrorString", get_error_string);
    int ok = 1;
    ok &= RESOLVE("cuDeviceGet", device_get);
    ok &= RESOLVE("cuDeviceGetAttribute", device_get_attribute);
    ok &= RESOLVE("cuMemGetAllocationGranularity", get_granularity);
    ok &= RESOLVE("cuMemAddressReserve", address_reserve);
    ok &= RESOLVE("cuMemAddressFree", address_free);
    ok &= RESOLVE("cuMemCreate", create);
    ok &= RESOLVE("cuMemRelease", release);
    ok &= RESOLVE("cuMemMap", map);
    ok &= RESOLVE("cuMemUnmap", unmap);
    ok &= RESOLVE("cuMemSetAccess", set_access);
    fns->vmm_ok = ok;
}

/* ---- device info ---- */

static spw_status cuda_mem_info(spw_backend *b, size_t *free_bytes, size_t *total_bytes) {
    cuda_backend *c = as_cuda(b);
    BIND(c);
    size_t f = 0, t = 0;
    RT_CHECK(cudaMemGetInfo(&f, &t), "cudaMemGetInfo(device %d)", b->device);
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
    return SPW_OK;
}

static spw_status cuda_device_info(spw_backend *b, spw_device_info *out) {
    cuda_backend *c = as_cuda(b);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: device_info: out is NULL");
    BIND(c);
    spw_device_info d;
    memset(&d, 0, sizeof d);
    struct cudaDeviceProp prop;
    RT_CHECK(cudaGetDeviceProperties(&prop, b->device), "cudaGetDeviceProperties(%d)", b->device);
    size_t len = strnlen(prop.name, sizeof prop.name);
    if (len >= sizeof d.name) len = sizeof d.name - 1; /* d is zeroed: stays terminated */
    memcpy(d.name, prop.name, len);
    d.cc_major = prop.major;
    d.cc_minor = prop.minor;
    spw_status st = cuda_mem_info(b, &d.free_bytes, &d.total_bytes);
    if (st != SPW_OK) return st;
    d.vmm_supported = c->vmm_supported;
    d.vmm_granularity = c->granularity;
    d.concurrent_managed_access = c->concurrent_managed;
    d.pageable_memory_access = c->pageable_access;
    d.emulated = 0;
    *out = d;
    return SPW_OK;
}

/* ---- plain device memory ---- */

static spw_status cuda_dev_alloc(spw_backend *b, size_t bytes, void **out) {
    cuda_backend *c = as_cuda(b);
    if (!out || bytes == 0)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: dev_alloc(%zu B): %s", bytes,
                          out ? "zero size" : "out is NULL");
    BIND(c);
    void *p = NULL;
    RT_CHECK(cudaMalloc(&p, bytes), "cudaMalloc(%zu B) on device %d", bytes, b->device);
    *out = p;
    return SPW_OK;
}

static spw_status cuda_dev_free(spw_backend *b, void *ptr) {
    if (!ptr) return SPW_OK;
    BIND(as_cuda(b));
    RT_CHECK(cudaFree(ptr), "cudaFree(%p)", ptr);
    return SPW_OK;
}

/* ---- pinned host memory ---- */

static spw_status cuda_host_alloc(spw_backend *b, size_t bytes, void **out) {
    cuda_backend *c = as_cuda(b);
    if (!out || bytes == 0)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: host_alloc(%zu B): %s", bytes,
                          out ? "zero size" : "out is NULL");
    BIND(c);
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess)
        return spw__cuda_rt_fail(SPW_ERR_HOST_OUT_OF_MEMORY, e, "cudaHostAlloc(%zu B)", bytes);
    *out = p;
    return SPW_OK;
}

static spw_status cuda_host_free(spw_backend *b, void *ptr) {
    if (!ptr) return SPW_OK;
    BIND(as_cuda(b));
    RT_CHECK(cudaFreeHost(ptr), "cudaFreeHost(%p)", ptr);
    return SPW_OK;
}

static spw_status cuda_host_register(spw_backend *b, void *ptr, size_t bytes) {
    cuda_backend *c = as_cuda(b);
    if (!ptr || bytes == 0)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: host_register(%p, %zu B): %s", ptr,
                          bytes, ptr ? "zero size" : "NULL pointer");
    BIND(c);
    cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
        spw_status st = e == cudaErrorMemoryAllocation              ? SPW_ERR_HOST_OUT_OF_MEMORY
                        : e == cudaErrorHostMemoryAlreadyRegistered ? SPW_ERR_STATE
                                                                    : SPW_ERR_BACKEND;
        return spw__cuda_rt_fail(st, e, "cudaHostRegister(%p, %zu B)", ptr, bytes);
    }
    return SPW_OK;
}

static spw_status cuda_host_unregister(spw_backend *b, void *ptr) {
    if (!ptr) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: host_unregister(NULL)");
    BIND(as_cuda(b));
    cudaError_t e = cudaHostUnregister(ptr);
    if (e != cudaSuccess)
        return spw__cuda_rt_fail(e == cudaErrorHostMemoryNotRegistered ? SPW_ERR_STATE
                                                                       : SPW_ERR_BACKEND,
                                 e, "cudaHostUnregister(%p)", ptr);
    return SPW_OK;
}

/* ---- managed memory ---- */

static spw_status cuda_managed_alloc(spw_backend *b, size_t bytes, void **out) {
    cuda_backend *c = as_cuda(b);
    if (!out || bytes == 0)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: managed_alloc(%zu B): %s", bytes,
                          out ? "zero size" : "out is NULL");
    BIND(c);
    void *p = NULL;
    RT_CHECK(cudaMallocManaged(&p, bytes, cudaMemAttachGlobal), "cudaMallocManaged(%zu B)", bytes);
    *out = p;
    return SPW_OK;
}

static spw_status cuda_managed_free(spw_backend *b, void *ptr) {
    if (!ptr) return SPW_OK;
    BIND(as_cuda(b));
    RT_CHECK(cudaFree(ptr), "cudaFree(managed %p)", ptr);
    return SPW_OK;
}

static struct cudaMemLocation loc_device(const spw_backend *b) {
    struct cudaMemLocation l;
    l.type = cudaMemLocationTypeDevice;
    l.id = b->device;
    return l;
}

static struct cudaMemLocation loc_host(void) {
    struct cudaMemLocation l;
    l.type = cudaMemLocationTypeHost;
    l.id = 0; /* ignored for the host */
    return l;
}

static spw_status cuda_managed_advise(spw_backend *b, void *ptr, size_t bytes,
                                      spw_managed_advice a) {
    static const struct {
        enum cudaMemoryAdvise advice;
        int host; /* location: the host, else the device (ignored by read-mostly) */
        const char *name;
    } table[] = {
        [SPW_ADVISE_PREFERRED_DEVICE] = {cudaMemAdviseSetPreferredLocation, 0, "preferred device"},
        [SPW_ADVISE_PREFERRED_HOST] = {cudaMemAdviseSetPreferredLocation, 1, "preferred host"},
        [SPW_ADVISE_READ_MOSTLY] = {cudaMemAdviseSetReadMostly, 0, "read mostly"},
        [SPW_ADVISE_UNSET_READ_MOSTLY] = {cudaMemAdviseUnsetReadMostly, 0, "unset read mostly"},
    };
    if ((unsigned)a >= sizeof table / sizeof *table)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: managed_advise: unknown advice %d",
                          (int)a);
    if (!ptr || bytes == 0)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: managed_advise(%p, %zu B): empty range",
                          ptr, bytes);
    BIND(as_cuda(b));
    struct cudaMemLocation l = table[a].host ? loc_host() : loc_device(b);
    RT_CHECK(cudaMemAdvise(ptr, bytes, table[a].advice, l), "cudaMemAdvise(%p, %zu B, %s)", ptr,
             bytes, table[a].name);
    return SPW_OK;
}

static spw_status cuda_prefetch(spw_backend *b, void *ptr, size_t bytes, int to_device,
                                spw_stream stream) {
    cuda_backend *c = as_cuda(b);
    if (!c->concurrent_managed)
        return spw__error(SPW_ERR_UNSUPPORTED,
                          "cuda: prefetch: device %d lacks concurrent managed access "
                          "(cudaDevAttrConcurrentManagedAccess = 0)",
                          b->device);
    if (!ptr || bytes == 0)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: prefetch(%p, %zu B): empty range", ptr,
                          bytes);
    BIND(c);
    struct cudaMemLocation l = to_device ? loc_device(b) : loc_host();
    RT_CHECK(cudaMemPrefetchAsync(ptr, bytes, l, 0, (cudaStream_t)stream),
             "cudaMemPrefetchAsync(%p, %zu B, to %s, stream %p)", ptr, bytes,
             to_device ? "device" : "host", (void *)stream);
    return SPW_OK;
}

/* ---- streams and events ---- */

static spw_status cuda_stream_create(spw_backend *b, spw_stream *out) {
    cuda_backend *c = as_cuda(b);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: stream_create: out is NULL");
    BIND(c);
    cudaStream_t s = NULL;
    RT_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags(non-blocking) on device %d", b->device);
    *out = (spw_stream)s;
    return SPW_OK;
}

static spw_status cuda_stream_destroy(spw_backend *b, spw_stream s) {
    if (!s) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: stream_destroy: the default stream");
    BIND(as_cuda(b));
    RT_CHECK(cudaStreamDestroy((cudaStream_t)s), "cudaStreamDestroy(%p)", (void *)s);
    return SPW_OK;
}

static spw_status cuda_stream_sync(spw_backend *b, spw_stream s) {
    cuda_backend *c = as_cuda(b);
    BIND(c);
    RT_CHECK(cudaStreamSynchronize((cudaStream_t)s), "cudaStreamSynchronize(%p)", (void *)s);
    return SPW_OK;
}

static spw_status cuda_event_create(spw_backend *b, spw_event *out) {
    cuda_backend *c = as_cuda(b);
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: event_create: out is NULL");
    BIND(c);
    cudaEvent_t e = NULL;
    RT_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
             "cudaEventCreateWithFlags(disable timing) on device %d", b->device);
    *out = (spw_event)e;
    return SPW_OK;
}

static spw_status cuda_event_destroy(spw_backend *b, spw_event e) {
    if (!e) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: event_destroy(NULL)");
    BIND(as_cuda(b));
    RT_CHECK(cudaEventDestroy((cudaEvent_t)e), "cudaEventDestroy(%p)", (void *)e);
    return SPW_OK;
}

static spw_status cuda_event_record(spw_backend *b, spw_event e, spw_stream s) {
    cuda_backend *c = as_cuda(b);
    if (!e) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: event_record(NULL event)");
    BIND(c);
    RT_CHECK(cudaEventRecord((cudaEvent_t)e, (cudaStream_t)s), "cudaEventRecord(%p, stream %p)",
             (void *)e, (void *)s);
    return SPW_OK;
}

/* Polled on the allocator's reuse path: never blocks. */
static spw_status cuda_event_query(spw_backend *b, spw_event e) {
    if (!e) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: event_query(NULL)");
    BIND(as_cuda(b));
    cudaError_t r = cudaEventQuery((cudaEvent_t)e);
    if (SPW_LIKELY(r == cudaSuccess)) return SPW_OK;
    if (r == cudaErrorNotReady) {
        (void)cudaGetLastError(); /* not sticky, but keep the application's slot clean */
        return spw__error(SPW_ERR_NOT_READY, "cuda: event %p not complete", (void *)e);
    }
    return spw__cuda_rt_fail(SPW_ERR_BACKEND, r, "cudaEventQuery(%p)", (void *)e);
}

static spw_status cuda_event_sync(spw_backend *b, spw_event e) {
    if (!e) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: event_sync(NULL)");
    BIND(as_cuda(b));
    RT_CHECK(cudaEventSynchronize((cudaEvent_t)e), "cudaEventSynchronize(%p)", (void *)e);
    return SPW_OK;
}

static spw_status cuda_stream_wait(spw_backend *b, spw_stream s, spw_event e) {
    cuda_backend *c = as_cuda(b);
    if (!e) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: stream_wait(NULL event)");
    BIND(c);
    RT_CHECK(cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)e, 0),
             "cudaStreamWaitEvent(stream %p, event %p)", (void *)s, (void *)e);
    return SPW_OK;
}

static spw_status cuda_memcpy_async(spw_backend *b, void *dst, const void *src, size_t bytes,
                                    spw_copy_kind kind, spw_stream s) {
    cuda_backend *c = as_cuda(b);
    static const enum cudaMemcpyKind kinds[] = {
        [SPW_COPY_H2D] = cudaMemcpyHostToDevice,
        [SPW_COPY_D2H] = cudaMemcpyDeviceToHost,
        [SPW_COPY_D2D] = cudaMemcpyDeviceToDevice,
        [SPW_COPY_H2H] = cudaMemcpyHostToHost,
    };
    static const char *const names[] = {"H2D", "D2H", "D2D", "H2H"};
    if ((unsigned)kind > (unsigned)SPW_COPY_H2H)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: memcpy_async: unknown kind %d",
                          (int)kind);
    if (bytes == 0) return SPW_OK;
    if (!dst || !src)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: memcpy_async(%p <- %p, %zu B): NULL",
                          dst, src, bytes);
    BIND(c);
    RT_CHECK(cudaMemcpyAsync(dst, src, bytes, kinds[kind], (cudaStream_t)s),
             "cudaMemcpyAsync(%p <- %p, %zu B, %s, stream %p)", dst, src, bytes, names[kind],
             (void *)s);
    return SPW_OK;
}

static spw_status cuda_launch_host(spw_backend *b, spw_stream s, void (*fn)(void *), void *arg) {
    cuda_backend *c = as_cuda(b);
    if (!fn) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: launch_host: fn is NULL");
    BIND(c);
    RT_CHECK(cudaLaunchHostFunc((cudaStream_t)s, fn, arg), "cudaLaunchHostFunc(stream %p)",
             (void *)s);
    return SPW_OK;
}

/* ---- lifetime ---- */

/* Returns every reservation (unmapping what is still mapped). The caller must have drained the
 * device work that uses them. Streams, events and allocations are owned by the layers above. */
static void cuda_destroy(spw_backend *b) {
    if (!b) return;
    cuda_backend *c = as_cuda(b);
    (void)spw__cuda_bind(c);
    spw__cuda_vmm_release_all(c);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

static const spw_backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .device_info = cuda_device_info,
    .mem_info = cuda_mem_info,
    .dev_alloc = cuda_dev_alloc,
    .dev_free = cuda_dev_free,
    .va_reserve = spw__cuda_va_reserve,
    .va_release = spw__cuda_va_release,
    .map = spw__cuda_map,
    .unmap = spw__cuda_unmap,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .managed_alloc = cuda_managed_alloc,
    .managed_free = cuda_managed_free,
    .managed_advise = cuda_managed_advise,
    .prefetch = cuda_prefetch,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_sync = cuda_event_sync,
    .stream_wait = cuda_stream_wait,
    .memcpy_async = cuda_memcpy_async,
    .launch_host = cuda_launch_host,
};

/* p may be NULL (device 0). SPW_ERR_NO_DEVICE when the runtime finds no device (no driver, no
 * GPU); SPW_ERR_INVALID_ARGUMENT for a device index that does not exist. *out is set only on
 * success. */
spw_status spw__backend_cuda_create(const spw_backend_params *p, spw_backend **out) {
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "cuda: backend create: out is NULL");
    int dev = p ? p->device : 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        return spw__cuda_rt_fail(SPW_ERR_NO_DEVICE, e, "no usable CUDA device: cudaGetDeviceCount");
    if (n <= 0)
        return spw__error(SPW_ERR_NO_DEVICE,
                          "cuda: no CUDA device present (cudaGetDeviceCount = 0)");
    if (dev < 0 || dev >= n)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "cuda: device %d does not exist (%d device(s) present: 0..%d)", dev, n,
                          n - 1);
    RT_CHECK(cudaSetDevice(dev), "cudaSetDevice(%d)", dev);
    int managed = 0, pageable = 0;
    RT_CHECK(cudaDeviceGetAttribute(&managed, cudaDevAttrConcurrentManagedAccess, dev),
             "cudaDeviceGetAttribute(ConcurrentManagedAccess, device %d)", dev);
    RT_CHECK(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, dev),
             "cudaDeviceGetAttribute(PageableMemoryAccess, device %d)", dev);

    cuda_backend *c = calloc(1, sizeof *c);
    if (!c)
        return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "cuda: backend create: out of host memory");
    if (pthread_mutex_init(&c->lock, NULL) != 0) {
        free(c);
        return spw__error(SPW_ERR_BACKEND, "cuda: backend create: pthread_mutex_init failed");
    }
    c->base.device = dev;
    c->cudev = (CUdevice)dev;
    c->concurrent_managed = managed != 0;
    c->pageable_access = pageable != 0;

    resolve_all(&c->cu);
    spw__cuda_probe_vmm(c);
    c->ops = cuda_ops;
    if (!c->vmm_supported) {
        c->ops.va_reserve = NULL;
        c->ops.va_release = NULL;
        c->ops.map = NULL;
        c->ops.unmap = NULL;
    }
    c->base.ops = &c->ops;
    *out = &c->base;
    return SPW_OK;
}
