/*
 * The probe on a real GPU: spw_probe_ops over the CUDA runtime, and the device inventory.
 * Compiled only when SPW_HAVE_CUDA. The runtime API is used directly (not the library's cuda
 * backend) because the probe needs what the backend seam does not carry: event timing, mapped
 * host memory, device attributes. Every call is checked; nothing aborts.
 */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "probe.h"

struct spw_probe_dev {
    int device;
};

/* Record a CUDA failure as the thread's message. The runtime's "last error" is cleared so a
 * non-sticky failure (an allocation refused) does not leak into later calls' reports. */
static spw_status cu_fail(cudaError_t e, const char *what, size_t bytes) {
    (void)cudaGetLastError();
    spw_status st = e == cudaErrorMemoryAllocation ? SPW_ERR_OUT_OF_MEMORY : SPW_ERR_BACKEND;
    if (bytes)
        return spw__error(st, "%s(%zu B) failed: %s (%s)", what, bytes, cudaGetErrorString(e), cudaGetErrorName(e));
    return spw__error(st, "%s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}
#define CU(call, what, bytes)                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) return cu_fail(e_, what, bytes);                                \
    } while (0)

static spw_status c_mem_info(spw_probe_dev *d, size_t *f, size_t *t) {
    (void)d;
    CU(cudaMemGetInfo(f, t), "cudaMemGetInfo", 0);
    return SPW_OK;
}
static spw_status c_dev_alloc(spw_probe_dev *d, size_t bytes, void **out) {
    (void)d;
    void *p = NULL;
    CU(cudaMalloc(&p, bytes), "cudaMalloc", bytes);
    *out = p;
    return SPW_OK;
}
static spw_status c_dev_free(spw_probe_dev *d, void *p) {
    (void)d;
    CU(cudaFree(p), "cudaFree", 0);
    return SPW_OK;
}
static spw_status c_host_alloc(spw_probe_dev *d, size_t bytes, void **out) {
    (void)d;
    void *p = NULL;
    CU(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc", bytes);
    *out = p;
    return SPW_OK;
}
static spw_status c_host_free(spw_probe_dev *d, void *p) {
    (void)d;
    CU(cudaFreeHost(p), "cudaFreeHost", 0);
    return SPW_OK;
}
static spw_status c_mapped_alloc(spw_probe_dev *d, size_t bytes, void **host, void **dev) {
    (void)d;
    void *h = NULL, *p = NULL;
    CU(cudaHostAlloc(&h, bytes, cudaHostAllocMapped), "cudaHostAlloc(cudaHostAllocMapped)", bytes);
    cudaError_t e = cudaHostGetDevicePointer(&p, h, 0);
    if (e != cudaSuccess) {
        spw_status st = cu_fail(e, "cudaHostGetDevicePointer", 0);
        cudaFreeHost(h);
        return st;
    }
    *host = h;
    *dev = p;
    return SPW_OK;
}
static spw_status c_stream_create(spw_probe_dev *d, spw_stream *out) {
    (void)d;
    cudaStream_t s = NULL;
    /* non-blocking: never serialised with the legacy default stream */
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", 0);
    *out = s;
    return SPW_OK;
}
static spw_status c_stream_destroy(spw_probe_dev *d, spw_stream s) {
    (void)d;
    CU(cudaStreamDestroy(s), "cudaStreamDestroy", 0);
    return SPW_OK;
}
static spw_status c_stream_sync(spw_probe_dev *d, spw_stream s) {
    (void)d;
    CU(cudaStreamSynchronize(s), "cudaStreamSynchronize", 0);
    return SPW_OK;
}
static spw_status c_memset(spw_probe_dev *d, void *p, int byte, size_t bytes, spw_stream s) {
    (void)d;
    CU(cudaMemsetAsync(p, byte, bytes, s), "cudaMemsetAsync", bytes);
    return SPW_OK;
}
static spw_status c_copy(spw_probe_dev *d, void *dst, const void *src, size_t bytes, spw_copy_kind kind,
                         spw_stream s) {
    (void)d;
    enum cudaMemcpyKind k;
    switch (kind) {
    case SPW_COPY_H2D: k = cudaMemcpyHostToDevice; break;
    case SPW_COPY_D2H: k = cudaMemcpyDeviceToHost; break;
    case SPW_COPY_H2H: k = cudaMemcpyHostToHost; break;
    /* D2D also reads the self-test's mapped pointer: with unified addressing the driver infers
     * where each side lives, so a device-backed source is a device-to-device copy and a
     * host-backed one is read over the link, which is exactly what the scan must tell apart. */
    case SPW_COPY_D2D:
    default: k = cudaMemcpyDefault; break;
    }
    CU(cudaMemcpyAsync(dst, src, bytes, k, s), "cudaMemcpyAsync", bytes);
    return SPW_OK;
}
static spw_status c_event_create(spw_probe_dev *d, spw_event *out) {
    (void)d;
    cudaEvent_t e = NULL;
    CU(cudaEventCreate(&e), "cudaEventCreate", 0);
    *out = e;
    return SPW_OK;
}
static spw_status c_event_destroy(spw_probe_dev *d, spw_event e) {
    (void)d;
    CU(cudaEventDestroy(e), "cudaEventDestroy", 0);
    return SPW_OK;
}
static spw_status c_event_record(spw_probe_dev *d, spw_event e, spw_stream s) {
    (void)d;
    CU(cudaEventRecord(e, s), "cudaEventRecord", 0);
    return SPW_OK;
}
static spw_status c_stream_wait(spw_probe_dev *d, spw_stream s, spw_event e) {
    (void)d;
    CU(cudaStreamWaitEvent(s, e, 0), "cudaStreamWaitEvent", 0);
    return SPW_OK;
}
static spw_status c_elapsed(spw_probe_dev *d, spw_event a, spw_event b, double *ms) {
    (void)d;
    float f = 0;
    CU(cudaEventSynchronize(a), "cudaEventSynchronize", 0);
    CU(cudaEventSynchronize(b), "cudaEventSynchronize", 0);
    CU(cudaEventElapsedTime(&f, a, b), "cudaEventElapsedTime", 0);
    *ms = f;
    return SPW_OK;
}

static const spw_probe_ops cuda_ops = {
    .dev_alloc_api = "cudaMalloc+cudaFree",
    .host_alloc_api = "cudaHostAlloc+cudaFreeHost",
    .mem_info = c_mem_info,
    .dev_alloc = c_dev_alloc,
    .dev_free = c_dev_free,
    .host_alloc = c_host_alloc,
    .host_free = c_host_free,
    .mapped_alloc = c_mapped_alloc,
    .mapped_free = c_host_free,
    .stream_create = c_stream_create,
    .stream_destroy = c_stream_destroy,
    .stream_sync = c_stream_sync,
    .memset_async = c_memset,
    .copy_async = c_copy,
    .event_create = c_event_create,
    .event_destroy = c_event_destroy,
    .event_record = c_event_record,
    .stream_wait = c_stream_wait,
    .event_elapsed_ms = c_elapsed,
};

int spw_probe_cuda_count(char *why, size_t len) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(why, len, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        return 0;
    }
    if (n == 0) snprintf(why, len, "the CUDA runtime sees no device");
    return n;
}

/* A device attribute, or 0 when the runtime does not know it (attributes come and go between
 * CUDA versions; none of these is essential). */
static int attr(enum cudaDeviceAttr a, int dev) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, a, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return v;
}

spw_status spw_probe_cuda_open(spw_probe_result *r, const spw_probe_ops **ops, spw_probe_dev **out) {
    int n = 0, dev = r->device;
    CU(cudaGetDeviceCount(&n), "cudaGetDeviceCount", 0);
    if (dev < 0 || dev >= n)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "no device %d: the CUDA runtime sees %d device%s", dev, n,
                          n == 1 ? "" : "s");
    r->device_count = n;
    for (int i = 0; i < n && i < SPW_PROBE_MAX_DEVICES; i++) {
        struct cudaDeviceProp p;
        CU(cudaGetDeviceProperties(&p, i), "cudaGetDeviceProperties", 0);
        snprintf(r->devices[i].name, sizeof r->devices[i].name, "%s", p.name);
        r->devices[i].cc_major = p.major;
        r->devices[i].cc_minor = p.minor;
        r->devices[i].total_bytes = p.totalGlobalMem;
        if (i == dev) {
            snprintf(r->name, sizeof r->name, "%s", p.name);
            r->cc_major = p.major;
            r->cc_minor = p.minor;
            r->integrated = p.integrated;
        }
    }
    CU(cudaSetDevice(dev), "cudaSetDevice", 0);
    uint64_t t0 = spw__now_ns();
    CU(cudaFree(NULL), "cudaFree(NULL) (context creation)", 0);
    r->init_ms = (double)(spw__now_ns() - t0) / 1e6;
    CU(cudaDriverGetVersion(&r->driver_version), "cudaDriverGetVersion", 0);
    CU(cudaRuntimeGetVersion(&r->runtime_version), "cudaRuntimeGetVersion", 0);
    CU(cudaMemGetInfo(&r->free_bytes, &r->total_bytes), "cudaMemGetInfo", 0);
    r->concurrent_managed = attr(cudaDevAttrConcurrentManagedAccess, dev);
    r->pageable_access = attr(cudaDevAttrPageableMemoryAccess, dev);
    int clk_khz = attr(cudaDevAttrMemoryClockRate, dev), bus_bits = attr(cudaDevAttrGlobalMemoryBusWidth, dev);
    /* double data rate: two transfers per clock over bus_bits / 8 bytes */
    r->vram_theoretical_gbps = 2.0 * clk_khz * 1e3 * (bus_bits / 8.0) / 1e9;
    char bus[32] = "";
    if (cudaDeviceGetPCIBusId(bus, (int)sizeof bus, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        bus[0] = '\0';
    }
    snprintf(r->pci_bus_id, sizeof r->pci_bus_id, "%s", bus);
    r->wsl2 = spw_probe_is_wsl2();
    spw_probe_nvml_query(r, bus, dev);
    if (!r->link.known) spw_probe_sysfs_link(bus, &r->link);

    spw_probe_dev *d = calloc(1, sizeof *d);
    if (!d) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "out of host memory");
    d->device = dev;
    *ops = &cuda_ops;
    *out = d;
    return SPW_OK;
}

void spw_probe_cuda_close(spw_probe_dev *d) { free(d); }
