/*
 * libspillway-preload.so: caps the device memory of an unmodified CUDA program.
 *
 * Loaded with LD_PRELOAD (by `spillway run`). It exports the driver's allocation, free and
 * memory-query entry points, NVML's memory query, dlsym, and cuGetProcAddress(_v2):
 *   - programs linked against libcuda bind to these exports directly;
 *   - cudart (static or shared) and loaders such as XLA or ctypes dlopen libcuda and resolve it
 *     through dlsym and cuGetProcAddress: both are interposed, and any pointer they would return
 *     that is the real address of a wrapped function is replaced by its wrapper. Routing by
 *     pointer keeps versions (_v2) and per-thread-stream variants (_ptsz) apart, since each
 *     real pointer has its own wrapper.
 * It links neither libcuda nor libcudart: cuda.h is used for types only, and the real functions
 * are found with the real dlsym on a handle of libcuda.so.1, once, on first use.
 *
 * Rules kept everywhere: nothing is allocated or printed before the first intercepted call; no
 * lock is held across a driver call; a free of a pointer the shim did not charge goes to the
 * driver unchanged; the only error the shim makes up is CUDA_ERROR_OUT_OF_MEMORY past the
 * budget. It never aborts. Configuration: see ledger.h (spwp_config_load) and preload/README.md.
 */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>

#include "ledger.h"

/* cuda.h maps the plain names to their latest versions; the shim exports every version, so
 * it needs the plain names back. */
#undef cuMemAlloc
#undef cuMemAllocPitch
#undef cuMemFree
#undef cuMemGetInfo
#undef cuDeviceTotalMem
#undef cuArrayCreate
#undef cuArray3DCreate
#undef cuGetProcAddress

#define SPWP_EXPORT __attribute__((visibility("default")))

/* Legacy (pre-3.2) types, declared by cuda.h only for the driver's own build. */
typedef unsigned int spwp_deviceptr_v1;
typedef struct {
    unsigned int Width, Height;
    CUarray_format Format;
    unsigned int NumChannels;
} spwp_array_desc_v1;
typedef struct {
    unsigned int Width, Height, Depth;
    CUarray_format Format;
    unsigned int NumChannels, Flags;
} spwp_array3d_desc_v1;

/* NVML, declared here so that nvml.h is not needed (its ABI is stable). */
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} spwp_nvml_pci_t;

/* Prototypes of the exports cuda.h does not declare (legacy versions, _ptsz variants). */
SPWP_EXPORT CUresult cuMemAlloc(spwp_deviceptr_v1 *dptr, unsigned int bytesize);
SPWP_EXPORT CUresult cuMemAllocPitch(spwp_deviceptr_v1 *dptr, unsigned int *pitch, unsigned int width,
                                     unsigned int height, unsigned int elem);
SPWP_EXPORT CUresult cuMemFree(spwp_deviceptr_v1 dptr);
SPWP_EXPORT CUresult cuMemGetInfo(unsigned int *free, unsigned int *total);
SPWP_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
SPWP_EXPORT CUresult cuArrayCreate(CUarray *h, const spwp_array_desc_v1 *d);
SPWP_EXPORT CUresult cuArray3DCreate(CUarray *h, const spwp_array3d_desc_v1 *d);
SPWP_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s);
SPWP_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                  CUstream s);
SPWP_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s);
SPWP_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
SPWP_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem);
SPWP_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem);
SPWP_EXPORT void *dlsym(void *handle, const char *symbol);

typedef void (*spwp_fn)(void);

/* Every wrapped entry point: X(name, library) with library 'c' (libcuda) or 'n' (NVML). */
#define SPWP_WRAPS(X)                                                                          \
    X(cuMemAlloc, 'c') X(cuMemAlloc_v2, 'c') X(cuMemAllocPitch, 'c') X(cuMemAllocPitch_v2, 'c') \
    X(cuMemAllocManaged, 'c') X(cuMemFree, 'c') X(cuMemFree_v2, 'c') X(cuMemCreate, 'c')       \
    X(cuMemRelease, 'c') X(cuMemAllocAsync, 'c') X(cuMemAllocAsync_ptsz, 'c')                  \
    X(cuMemAllocFromPoolAsync, 'c') X(cuMemAllocFromPoolAsync_ptsz, 'c')                       \
    X(cuMemFreeAsync, 'c') X(cuMemFreeAsync_ptsz, 'c') X(cuArrayCreate, 'c')                   \
    X(cuArrayCreate_v2, 'c') X(cuArray3DCreate, 'c') X(cuArray3DCreate_v2, 'c')                \
    X(cuMipmappedArrayCreate, 'c') X(cuArrayDestroy, 'c') X(cuMipmappedArrayDestroy, 'c')      \
    X(cuMemGetInfo, 'c') X(cuMemGetInfo_v2, 'c') X(cuDeviceTotalMem, 'c')                      \
    X(cuDeviceTotalMem_v2, 'c') X(cuGetProcAddress, 'c') X(cuGetProcAddress_v2, 'c')           \
    X(nvmlDeviceGetMemoryInfo, 'n') X(nvmlDeviceGetMemoryInfo_v2, 'n')

/* Real functions the shim calls but does not wrap. */
#define SPWP_HELPERS(X)                                                                        \
    X(cuCtxGetDevice, 'c') X(cuStreamGetDevice, 'c') X(cuDeviceGetByPCIBusId, 'c')             \
    X(cuPointerGetAttribute, 'c') X(nvmlDeviceGetPciInfo_v3, 'n') X(nvmlDeviceGetIndex, 'n')

enum {
#define X(n, lib) W_##n,
    SPWP_WRAPS(X) SPWP_HELPERS(X)
#undef X
        W_COUNT
};

typedef struct {
    const char *name;
    char lib;
    spwp_fn wrap; /* NULL for helpers */
    spwp_fn real; /* written once by fill_cuda/fill_nvml, read after their pthread_once */
} spwp_wrap;

static spwp_wrap wraps[W_COUNT];

/* ---- state ---- */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;
static atomic_bool initialised, cuda_filled;
static bool disabled; /* bad configuration: pass everything through (said once on stderr) */
static spwp_ledger L;
static spwp_routes routes;
static pthread_mutex_t routes_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local bool in_fill; /* this thread is resolving the real functions */

static const char *progname(void) {
    return program_invocation_short_name && *program_invocation_short_name
               ? program_invocation_short_name
               : "?";
}

/* One line to stderr with write(2): no stdio buffers, no allocation. */
__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "spillway: %s: ", progname());
    if (n < 0) return;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m > 0 ? (size_t)m : 0);
    if (len >= sizeof buf) len = sizeof buf - 1;
    buf[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w;
}

static void *fn2ptr(spwp_fn f) {
    void *p;
    memcpy(&p, &f, sizeof p);
    return p;
}
static spwp_fn ptr2fn(void *p) {
    spwp_fn f;
    memcpy(&f, &p, sizeof f);
    return f;
}

static void init_config(void) {
    char err[512];
    spwp_config cfg;
    if (spwp_config_load(&cfg, getenv("SPILLWAY_CONF"), getenv("SPILLWAY_BUDGET"),
                         getenv("SPILLWAY_REPORT"), getenv("SPILLWAY_CHARGE_MANAGED"), err,
                         sizeof err)) {
        disabled = true;
        say("%s; device memory is NOT capped", err);
    }
    const char *dbg = getenv("SPILLWAY_DEBUG");
    if (dbg && *dbg && strcmp(dbg, "0")) cfg.debug = true;
    spwp_ledger_init(&L, &cfg);
    atomic_store(&initialised, true);
}

/* ---- the real dlsym ---- */

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) real_dlsym_p;

static dlsym_fn real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&real_dlsym_p, memory_order_acquire);
    if (f) return f;
    /* dlvsym, not dlsym: our own dlsym is what a plain lookup would find. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    void *p = NULL;
    for (size_t i = 0; !p && i < sizeof versions / sizeof versions[0]; i++)
        p = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (!p) return NULL;
    memcpy(&f, &p, sizeof f);
    atomic_store_explicit(&real_dlsym_p, f, memory_order_release);
    return f;
}

/* ---- resolving the real functions (once per library) ---- */

static void route_add(void *real, spwp_fn wrap) {
    pthread_mutex_lock(&routes_lock);
    int r = spwp_routes_add(&routes, real, fn2ptr(wrap));
    pthread_mutex_unlock(&routes_lock);
    if (r < 0) say("routing table full; some entry points are not capped");
}

static void *route_find(void *real) {
    pthread_mutex_lock(&routes_lock);
    void *w = spwp_routes_find(&routes, real);
    pthread_mutex_unlock(&routes_lock);
    return w;
}

static void fill_lib(char lib, const char *path) {
    dlsym_fn rd = real_dlsym();
    void *h = rd ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!h) {
        if (L.cfg.debug) say("debug: cannot load %s: %s", path, dlerror());
        return;
    }
    for (int i = 0; i < W_COUNT; i++) {
        if (wraps[i].lib != lib) continue;
        void *p = rd(h, wraps[i].name);
        wraps[i].real = p ? ptr2fn(p) : NULL;
        if (p && wraps[i].wrap) route_add(p, wraps[i].wrap);
    }
}

/* The driver's resolver may hand out pointers other than its exported symbols; ask it for each
 * wrapped function under the versions and flags a caller would use, and route those too. The
 * exported symbols were added first, so on agreement nothing changes. */
static void fill_from_resolver(void) {
    static const struct {
        const char *name;
        int version;
        cuuint64_t flags;
        int wrap;
    } q[] = {
        {"cuMemAlloc", 3020, 0, W_cuMemAlloc_v2},
        {"cuMemAlloc", 2000, 0, W_cuMemAlloc},
        {"cuMemAllocPitch", 3020, 0, W_cuMemAllocPitch_v2},
        {"cuMemAllocPitch", 2000, 0, W_cuMemAllocPitch},
        {"cuMemFree", 3020, 0, W_cuMemFree_v2},
        {"cuMemFree", 2000, 0, W_cuMemFree},
        {"cuMemGetInfo", 3020, 0, W_cuMemGetInfo_v2},
        {"cuMemGetInfo", 2000, 0, W_cuMemGetInfo},
        {"cuDeviceTotalMem", 3020, 0, W_cuDeviceTotalMem_v2},
        {"cuDeviceTotalMem", 2000, 0, W_cuDeviceTotalMem},
        {"cuArrayCreate", 3020, 0, W_cuArrayCreate_v2},
        {"cuArrayCreate", 2000, 0, W_cuArrayCreate},
        {"cuArray3DCreate", 3020, 0, W_cuArray3DCreate_v2},
        {"cuArray3DCreate", 2000, 0, W_cuArray3DCreate},
        {"cuMemAllocManaged", 6000, 0, W_cuMemAllocManaged},
        {"cuMemCreate", 10020, 0, W_cuMemCreate},
        {"cuMemRelease", 10020, 0, W_cuMemRelease},
        {"cuMemAllocAsync", 11020, CU_GET_PROC_ADDRESS_LEGACY_STREAM, W_cuMemAllocAsync},
        {"cuMemAllocAsync", 11020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, W_cuMemAllocAsync_ptsz},
        {"cuMemAllocFromPoolAsync", 11020, CU_GET_PROC_ADDRESS_LEGACY_STREAM, W_cuMemAllocFromPoolAsync},
        {"cuMemAllocFromPoolAsync", 11020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
         W_cuMemAllocFromPoolAsync_ptsz},
        {"cuMemFreeAsync", 11020, CU_GET_PROC_ADDRESS_LEGACY_STREAM, W_cuMemFreeAsync},
        {"cuMemFreeAsync", 11020, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, W_cuMemFreeAsync_ptsz},
        {"cuMipmappedArrayCreate", 5000, 0, W_cuMipmappedArrayCreate},
        {"cuArrayDestroy", 2000, 0, W_cuArrayDestroy},
        {"cuMipmappedArrayDestroy", 5000, 0, W_cuMipmappedArrayDestroy},
        {"cuGetProcAddress", 11030, 0, W_cuGetProcAddress},
        {"cuGetProcAddress", 12000, 0, W_cuGetProcAddress_v2},
    };
    typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);
    spwp_fn g2 = wraps[W_cuGetProcAddress_v2].real, g1 = wraps[W_cuGetProcAddress].real;
    if (!g2 && !g1) return;
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
        void *p = NULL;
        CUdriverProcAddressQueryResult st;
        CUresult r = g2 ? ((gpa2_fn)g2)(q[i].name, &p, q[i].version, q[i].flags, &st)
                        : ((gpa1_fn)g1)(q[i].name, &p, q[i].version, q[i].flags);
        if (r == CUDA_SUCCESS && p) route_add(p, wraps[q[i].wrap].wrap);
    }
}

static void fill_cuda(void) {
    in_fill = true;
    const char *path = getenv("SPILLWAY_LIBCUDA");
    fill_lib('c', path && *path ? path : "libcuda.so.1");
    fill_from_resolver();
    if (L.cfg.debug) say("debug: libcuda resolved, %zu routes", routes.n);
    atomic_store(&cuda_filled, true);
    in_fill = false;
}

static void fill_nvml(void) {
    in_fill = true;
    const char *path = getenv("SPILLWAY_LIBNVML");
    fill_lib('n', path && *path ? path : "libnvidia-ml.so.1");
    in_fill = false;
}

static void ensure_init(void) { pthread_once(&init_once, init_config); }

/* Ready to call wraps[w].real: configuration read and the wrapped library resolved. */
static bool ready(int w) {
    if (in_fill) return false; /* a library constructor calling back during resolution */
    ensure_init();
    pthread_once(wraps[w].lib == 'n' ? &nvml_once : &cuda_once,
                 wraps[w].lib == 'n' ? fill_nvml : fill_cuda);
    return wraps[w].real != NULL;
}

#define REAL(w, type) ((type)wraps[w].real)
/* The real function could not be found: what the driver says of an unknown symbol. */
#define MISSING CUDA_ERROR_NOT_FOUND

/* ---- accounting helpers ---- */

typedef CUresult (*ctxdev_fn)(CUdevice *);
typedef CUresult (*streamdev_fn)(CUstream, CUdevice *);
typedef CUresult (*totalmem_fn)(size_t *, CUdevice);

/* The device of the current context; 0 when there is none (the driver call will then fail and
 * the reservation is refunded). */
static int current_device(void) {
    CUdevice d = 0;
    if (wraps[W_cuCtxGetDevice].real && REAL(W_cuCtxGetDevice, ctxdev_fn)(&d) == CUDA_SUCCESS) return d;
    return 0;
}

static int stream_device(CUstream s) {
    CUdevice d = 0;
    if (s && wraps[W_cuStreamGetDevice].real &&
        REAL(W_cuStreamGetDevice, streamdev_fn)(s, &d) == CUDA_SUCCESS)
        return d;
    return current_device();
}

/* A percentage budget needs the device's size: asked once, without the ledger lock. */
static void ensure_physical(int dev) {
    if (!spwp_ledger_needs_physical(&L, dev) || !wraps[W_cuDeviceTotalMem_v2].real) return;
    size_t t = 0;
    if (REAL(W_cuDeviceTotalMem_v2, totalmem_fn)(&t, dev) == CUDA_SUCCESS) spwp_ledger_set_physical(&L, dev, t);
}

/* Reserve before the driver call; false means refused (the line is printed here). */
static bool reserve(int dev, uint64_t bytes) {
    ensure_physical(dev);
    spwp_refusal why;
    if (spwp_ledger_reserve(&L, dev, bytes, &why)) return true;
    say("out of memory: requested %llu B, charged %llu B of budget %llu B on device %d",
        (unsigned long long)why.requested, (unsigned long long)why.charged,
        (unsigned long long)why.budget, dev);
    return false;
}

/* After the driver call: keep and track the charge, or refund it. */
static CUresult settle(CUresult r, int kind, uint64_t key, int dev, uint64_t bytes) {
    if (r == CUDA_SUCCESS)
        spwp_ledger_track(&L, kind, key, dev, bytes);
    else
        spwp_ledger_refund(&L, dev, bytes);
    return r;
}

/* A free: forget the key first (so a racing double free cannot refund twice), free, then
 * refund; if the driver refused, the memory is still held and the charge goes back. */
#define FREE_BODY(kind, key, call)                                                             \
    do {                                                                                       \
        int dev_;                                                                              \
        uint64_t bytes_;                                                                       \
        bool tracked_ = spwp_ledger_untrack(&L, kind, key, &dev_, &bytes_);                   \
        CUresult r_ = (call);                                                                  \
        if (tracked_) {                                                                        \
            if (r_ == CUDA_SUCCESS)                                                            \
                spwp_ledger_refund(&L, dev_, bytes_);                                          \
            else                                                                               \
                spwp_ledger_track(&L, kind, key, dev_, bytes_);                                \
        }                                                                                      \
        return r_;                                                                             \
    } while (0)

static bool active(void) { return !disabled; }

/* ---- allocation ---- */

typedef CUresult (*alloc2_fn)(CUdeviceptr *, size_t);
typedef CUresult (*alloc1_fn)(spwp_deviceptr_v1 *, unsigned int);

SPWP_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (!ready(W_cuMemAlloc_v2)) return MISSING;
    alloc2_fn real = REAL(W_cuMemAlloc_v2, alloc2_fn);
    if (!active() || !dptr) return real(dptr, bytesize);
    int dev = current_device();
    if (!reserve(dev, bytesize)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, bytesize);
    return settle(r, SPWP_KIND_PTR, r == CUDA_SUCCESS ? *dptr : 0, dev, bytesize);
}

SPWP_EXPORT CUresult cuMemAlloc(spwp_deviceptr_v1 *dptr, unsigned int bytesize) {
    if (!ready(W_cuMemAlloc)) return MISSING;
    alloc1_fn real = REAL(W_cuMemAlloc, alloc1_fn);
    if (!active() || !dptr) return real(dptr, bytesize);
    int dev = current_device();
    if (!reserve(dev, bytesize)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, bytesize);
    return settle(r, SPWP_KIND_PTR, r == CUDA_SUCCESS ? *dptr : 0, dev, bytesize);
}

typedef CUresult (*free2_fn)(CUdeviceptr);
typedef CUresult (*free1_fn)(spwp_deviceptr_v1);

/* Pitched allocations: the pitch is known only afterwards, so reserve width x height, then
 * charge the difference to pitch x height; if that is refused, free and refuse. */
static CUresult pitch_settle(CUresult r, uint64_t key, int dev, uint64_t est, uint64_t actual,
                             void (*undo)(uint64_t)) {
    if (r != CUDA_SUCCESS) {
        spwp_ledger_refund(&L, dev, est);
        return r;
    }
    if (actual < est) spwp_ledger_refund(&L, dev, est - actual);
    if (actual > est && !reserve(dev, actual - est)) {
        undo(key);
        spwp_ledger_refund(&L, dev, est);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    spwp_ledger_track(&L, SPWP_KIND_PTR, key, dev, actual);
    return r;
}

static void undo_v2(uint64_t key) {
    if (wraps[W_cuMemFree_v2].real) REAL(W_cuMemFree_v2, free2_fn)((CUdeviceptr)key);
}
static void undo_v1(uint64_t key) {
    if (wraps[W_cuMemFree].real) REAL(W_cuMemFree, free1_fn)((spwp_deviceptr_v1)key);
}

typedef CUresult (*pitch2_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
typedef CUresult (*pitch1_fn)(spwp_deviceptr_v1 *, unsigned int *, unsigned int, unsigned int, unsigned int);

SPWP_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                        unsigned int elem) {
    if (!ready(W_cuMemAllocPitch_v2)) return MISSING;
    pitch2_fn real = REAL(W_cuMemAllocPitch_v2, pitch2_fn);
    if (!active() || !dptr || !pitch) return real(dptr, pitch, width, height, elem);
    int dev = current_device();
    uint64_t est = (uint64_t)width * height;
    if (height && est / height != width) est = UINT64_MAX;
    if (!reserve(dev, est)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, pitch, width, height, elem);
    uint64_t actual = r == CUDA_SUCCESS ? (uint64_t)*pitch * height : 0;
    return pitch_settle(r, r == CUDA_SUCCESS ? *dptr : 0, dev, est, actual, undo_v2);
}

SPWP_EXPORT CUresult cuMemAllocPitch(spwp_deviceptr_v1 *dptr, unsigned int *pitch, unsigned int width,
                                     unsigned int height, unsigned int elem) {
    if (!ready(W_cuMemAllocPitch)) return MISSING;
    pitch1_fn real = REAL(W_cuMemAllocPitch, pitch1_fn);
    if (!active() || !dptr || !pitch) return real(dptr, pitch, width, height, elem);
    int dev = current_device();
    uint64_t est = (uint64_t)width * height;
    if (!reserve(dev, est)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, pitch, width, height, elem);
    uint64_t actual = r == CUDA_SUCCESS ? (uint64_t)*pitch * height : 0;
    return pitch_settle(r, r == CUDA_SUCCESS ? *dptr : 0, dev, est, actual, undo_v1);
}

typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned int);

/* Managed memory is charged to the current device (where it would spill from) unless
 * charge_managed=0. */
SPWP_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    if (!ready(W_cuMemAllocManaged)) return MISSING;
    managed_fn real = REAL(W_cuMemAllocManaged, managed_fn);
    if (!active() || !L.cfg.charge_managed || !dptr) return real(dptr, bytesize, flags);
    int dev = current_device();
    if (!reserve(dev, bytesize)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, bytesize, flags);
    return settle(r, SPWP_KIND_PTR, r == CUDA_SUCCESS ? *dptr : 0, dev, bytesize);
}

SPWP_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    if (!ready(W_cuMemFree_v2)) return MISSING;
    FREE_BODY(SPWP_KIND_PTR, dptr, REAL(W_cuMemFree_v2, free2_fn)(dptr));
}

SPWP_EXPORT CUresult cuMemFree(spwp_deviceptr_v1 dptr) {
    if (!ready(W_cuMemFree)) return MISSING;
    FREE_BODY(SPWP_KIND_PTR, dptr, REAL(W_cuMemFree, free1_fn)(dptr));
}

/* ---- virtual memory management: only device locations are device memory ---- */

typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);

SPWP_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                 const CUmemAllocationProp *prop, unsigned long long flags) {
    if (!ready(W_cuMemCreate)) return MISSING;
    create_fn real = REAL(W_cuMemCreate, create_fn);
    if (!active() || !handle || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return real(handle, size, prop, flags);
    int dev = prop->location.id;
    if (!reserve(dev, size)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(handle, size, prop, flags);
    return settle(r, SPWP_KIND_HANDLE, r == CUDA_SUCCESS ? *handle : 0, dev, size);
}

SPWP_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (!ready(W_cuMemRelease)) return MISSING;
    FREE_BODY(SPWP_KIND_HANDLE, handle, REAL(W_cuMemRelease, release_fn)(handle));
}

/* ---- stream-ordered allocation ---- */

typedef CUresult (*async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*pool_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*freeasync_fn)(CUdeviceptr, CUstream);
typedef CUresult (*ptrattr_fn)(void *, CUpointer_attribute, CUdeviceptr);

static CUresult alloc_async(int w, CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    if (!ready(w)) return MISSING;
    async_fn real = REAL(w, async_fn);
    if (!active() || !dptr) return real(dptr, bytesize, s);
    int dev = stream_device(s);
    if (!reserve(dev, bytesize)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, bytesize, s);
    return settle(r, SPWP_KIND_PTR, r == CUDA_SUCCESS ? *dptr : 0, dev, bytesize);
}

SPWP_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    return alloc_async(W_cuMemAllocAsync, dptr, bytesize, s);
}
SPWP_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    return alloc_async(W_cuMemAllocAsync_ptsz, dptr, bytesize, s);
}

/* A pool may live in host memory (CUDA 12.6+): such allocations are refunded once the pointer
 * says so. */
static CUresult alloc_pool(int w, CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    if (!ready(w)) return MISSING;
    pool_fn real = REAL(w, pool_fn);
    if (!active() || !dptr) return real(dptr, bytesize, pool, s);
    int dev = stream_device(s);
    if (!reserve(dev, bytesize)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real(dptr, bytesize, pool, s);
    if (r == CUDA_SUCCESS && wraps[W_cuPointerGetAttribute].real) {
        unsigned int type = 0;
        if (REAL(W_cuPointerGetAttribute, ptrattr_fn)(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, *dptr) ==
                CUDA_SUCCESS &&
            type == CU_MEMORYTYPE_HOST) {
            spwp_ledger_refund(&L, dev, bytesize);
            return r;
        }
    }
    return settle(r, SPWP_KIND_PTR, r == CUDA_SUCCESS ? *dptr : 0, dev, bytesize);
}

SPWP_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream s) {
    return alloc_pool(W_cuMemAllocFromPoolAsync, dptr, bytesize, pool, s);
}
SPWP_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                  CUstream s) {
    return alloc_pool(W_cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, s);
}

SPWP_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    if (!ready(W_cuMemFreeAsync)) return MISSING;
    FREE_BODY(SPWP_KIND_PTR, dptr, REAL(W_cuMemFreeAsync, freeasync_fn)(dptr, s));
}
SPWP_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) {
    if (!ready(W_cuMemFreeAsync_ptsz)) return MISSING;
    FREE_BODY(SPWP_KIND_PTR, dptr, REAL(W_cuMemFreeAsync_ptsz, freeasync_fn)(dptr, s));
}

/* ---- arrays: charged width x height x depth x element size (per mipmap level) ---- */

/* Twice the bytes of one element (so 4-bit block formats are whole numbers). */
static uint64_t elem_x2(CUarray_format f, unsigned channels) {
    uint64_t ch = channels ? channels : 1;
    switch ((int)f) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 2 * ch;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 4 * ch;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT: return 8 * ch;
    case CU_AD_FORMAT_UNORM_INT8X1: case CU_AD_FORMAT_SNORM_INT8X1: return 2;
    case CU_AD_FORMAT_UNORM_INT8X2: case CU_AD_FORMAT_SNORM_INT8X2: case CU_AD_FORMAT_UNORM_INT16X1:
    case CU_AD_FORMAT_SNORM_INT16X1: return 4;
    case CU_AD_FORMAT_UNORM_INT8X4: case CU_AD_FORMAT_SNORM_INT8X4: case CU_AD_FORMAT_UNORM_INT16X2:
    case CU_AD_FORMAT_SNORM_INT16X2: case CU_AD_FORMAT_UNORM_INT_101010_2: return 8;
    case CU_AD_FORMAT_UNORM_INT16X4: case CU_AD_FORMAT_SNORM_INT16X4: return 16;
    case CU_AD_FORMAT_BC1_UNORM: case CU_AD_FORMAT_BC1_UNORM_SRGB: case CU_AD_FORMAT_BC4_UNORM:
    case CU_AD_FORMAT_BC4_SNORM: return 1;
    case CU_AD_FORMAT_BC2_UNORM: case CU_AD_FORMAT_BC2_UNORM_SRGB: case CU_AD_FORMAT_BC3_UNORM:
    case CU_AD_FORMAT_BC3_UNORM_SRGB: case CU_AD_FORMAT_BC5_UNORM: case CU_AD_FORMAT_BC5_SNORM:
    case CU_AD_FORMAT_BC6H_UF16: case CU_AD_FORMAT_BC6H_SF16: case CU_AD_FORMAT_BC7_UNORM:
    case CU_AD_FORMAT_BC7_UNORM_SRGB: return 2;
    case CU_AD_FORMAT_NV12: return 3;
    case CU_AD_FORMAT_NV16: case CU_AD_FORMAT_YUY2: return 4;
    case CU_AD_FORMAT_P010: case CU_AD_FORMAT_P016: case CU_AD_FORMAT_Y444_PLANAR8:
    case CU_AD_FORMAT_YUV444_8bit_SemiPlanar: return 6;
    case CU_AD_FORMAT_P210: case CU_AD_FORMAT_P216: case CU_AD_FORMAT_Y210: case CU_AD_FORMAT_Y216:
    case CU_AD_FORMAT_AYUV: case CU_AD_FORMAT_Y410: return 8;
    case CU_AD_FORMAT_Y444_PLANAR10: case CU_AD_FORMAT_YUV444_16bit_SemiPlanar: return 12;
    case CU_AD_FORMAT_Y416: return 16;
    default: return 8 * ch; /* unknown format: assume 4 bytes a channel */
    }
}

typedef CUresult (*arr2_fn)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
typedef CUresult (*arr1_fn)(CUarray *, const spwp_array_desc_v1 *);
typedef CUresult (*arr3d2_fn)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
typedef CUresult (*arr3d1_fn)(CUarray *, const spwp_array3d_desc_v1 *);
typedef CUresult (*mip_fn)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned int);
typedef CUresult (*arrdestroy_fn)(CUarray);
typedef CUresult (*mipdestroy_fn)(CUmipmappedArray);

#define LAYERS(flags) (((flags) & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0)

/* Shared body of the array creators: `call` creates into *h. */
#define ARRAY_BODY(kind, h, bytes, call)                                                       \
    do {                                                                                       \
        int dev_ = current_device();                                                           \
        uint64_t b_ = (bytes);                                                                 \
        if (!reserve(dev_, b_)) return CUDA_ERROR_OUT_OF_MEMORY;                               \
        CUresult r_ = (call);                                                                  \
        return settle(r_, kind, r_ == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*(h) : 0, dev_, b_);  \
    } while (0)

SPWP_EXPORT CUresult cuArrayCreate_v2(CUarray *h, const CUDA_ARRAY_DESCRIPTOR *d) {
    if (!ready(W_cuArrayCreate_v2)) return MISSING;
    arr2_fn real = REAL(W_cuArrayCreate_v2, arr2_fn);
    if (!active() || !h || !d) return real(h, d);
    ARRAY_BODY(SPWP_KIND_ARRAY, h, spwp_array_bytes(d->Width, d->Height, 1, elem_x2(d->Format, d->NumChannels), 1, false),
               real(h, d));
}

SPWP_EXPORT CUresult cuArrayCreate(CUarray *h, const spwp_array_desc_v1 *d) {
    if (!ready(W_cuArrayCreate)) return MISSING;
    arr1_fn real = REAL(W_cuArrayCreate, arr1_fn);
    if (!active() || !h || !d) return real(h, d);
    ARRAY_BODY(SPWP_KIND_ARRAY, h, spwp_array_bytes(d->Width, d->Height, 1, elem_x2(d->Format, d->NumChannels), 1, false),
               real(h, d));
}

SPWP_EXPORT CUresult cuArray3DCreate_v2(CUarray *h, const CUDA_ARRAY3D_DESCRIPTOR *d) {
    if (!ready(W_cuArray3DCreate_v2)) return MISSING;
    arr3d2_fn real = REAL(W_cuArray3DCreate_v2, arr3d2_fn);
    if (!active() || !h || !d) return real(h, d);
    ARRAY_BODY(SPWP_KIND_ARRAY, h,
               spwp_array_bytes(d->Width, d->Height, d->Depth, elem_x2(d->Format, d->NumChannels), 1,
                                LAYERS(d->Flags)),
               real(h, d));
}

SPWP_EXPORT CUresult cuArray3DCreate(CUarray *h, const spwp_array3d_desc_v1 *d) {
    if (!ready(W_cuArray3DCreate)) return MISSING;
    arr3d1_fn real = REAL(W_cuArray3DCreate, arr3d1_fn);
    if (!active() || !h || !d) return real(h, d);
    ARRAY_BODY(SPWP_KIND_ARRAY, h,
               spwp_array_bytes(d->Width, d->Height, d->Depth, elem_x2(d->Format, d->NumChannels), 1,
                                LAYERS(d->Flags)),
               real(h, d));
}

SPWP_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *h, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                            unsigned int levels) {
    if (!ready(W_cuMipmappedArrayCreate)) return MISSING;
    mip_fn real = REAL(W_cuMipmappedArrayCreate, mip_fn);
    if (!active() || !h || !d) return real(h, d, levels);
    ARRAY_BODY(SPWP_KIND_MIPMAP, h,
               spwp_array_bytes(d->Width, d->Height, d->Depth, elem_x2(d->Format, d->NumChannels), levels,
                                LAYERS(d->Flags)),
               real(h, d, levels));
}

SPWP_EXPORT CUresult cuArrayDestroy(CUarray h) {
    if (!ready(W_cuArrayDestroy)) return MISSING;
    FREE_BODY(SPWP_KIND_ARRAY, (uint64_t)(uintptr_t)h, REAL(W_cuArrayDestroy, arrdestroy_fn)(h));
}

SPWP_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray h) {
    if (!ready(W_cuMipmappedArrayDestroy)) return MISSING;
    FREE_BODY(SPWP_KIND_MIPMAP, (uint64_t)(uintptr_t)h, REAL(W_cuMipmappedArrayDestroy, mipdestroy_fn)(h));
}

/* ---- memory queries: the budget is the device ---- */

typedef CUresult (*info2_fn)(size_t *, size_t *);
typedef CUresult (*info1_fn)(unsigned int *, unsigned int *);
typedef CUresult (*total1_fn)(unsigned int *, CUdevice);

static unsigned int clamp_u32(uint64_t v) { return v > UINT_MAX ? UINT_MAX : (unsigned int)v; }

SPWP_EXPORT CUresult cuMemGetInfo_v2(size_t *free_out, size_t *total_out) {
    if (!ready(W_cuMemGetInfo_v2)) return MISSING;
    if (!active()) return REAL(W_cuMemGetInfo_v2, info2_fn)(free_out, total_out);
    size_t f = 0, t = 0;
    CUresult r = REAL(W_cuMemGetInfo_v2, info2_fn)(&f, &t);
    if (r != CUDA_SUCCESS) return REAL(W_cuMemGetInfo_v2, info2_fn)(free_out, total_out);
    uint64_t vf, vt;
    spwp_ledger_view(&L, current_device(), f, t, true, &vf, &vt);
    if (free_out) *free_out = (size_t)vf;
    if (total_out) *total_out = (size_t)vt;
    return r;
}

SPWP_EXPORT CUresult cuMemGetInfo(unsigned int *free_out, unsigned int *total_out) {
    if (!ready(W_cuMemGetInfo)) return MISSING;
    if (!active() || !wraps[W_cuMemGetInfo_v2].real) return REAL(W_cuMemGetInfo, info1_fn)(free_out, total_out);
    size_t f = 0, t = 0;
    CUresult r = REAL(W_cuMemGetInfo_v2, info2_fn)(&f, &t);
    if (r != CUDA_SUCCESS) return REAL(W_cuMemGetInfo, info1_fn)(free_out, total_out);
    uint64_t vf, vt;
    spwp_ledger_view(&L, current_device(), f, t, true, &vf, &vt);
    if (free_out) *free_out = clamp_u32(vf);
    if (total_out) *total_out = clamp_u32(vt);
    return r;
}

SPWP_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    if (!ready(W_cuDeviceTotalMem_v2)) return MISSING;
    CUresult r = REAL(W_cuDeviceTotalMem_v2, totalmem_fn)(bytes, dev);
    if (r != CUDA_SUCCESS || !active() || !bytes) return r;
    uint64_t vf, vt;
    spwp_ledger_view(&L, dev, *bytes, *bytes, true, &vf, &vt);
    *bytes = (size_t)vt;
    return r;
}

SPWP_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    if (!ready(W_cuDeviceTotalMem)) return MISSING;
    if (!active() || !bytes || !wraps[W_cuDeviceTotalMem_v2].real)
        return REAL(W_cuDeviceTotalMem, total1_fn)(bytes, dev);
    size_t t = 0;
    CUresult r = REAL(W_cuDeviceTotalMem_v2, totalmem_fn)(&t, dev);
    if (r != CUDA_SUCCESS) return REAL(W_cuDeviceTotalMem, total1_fn)(bytes, dev);
    uint64_t vf, vt;
    spwp_ledger_view(&L, dev, t, t, true, &vf, &vt);
    *bytes = clamp_u32(vt);
    return r;
}

/* ---- NVML ---- */

typedef nvmlReturn_t (*nvmem_fn)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*nvmem2_fn)(nvmlDevice_t, nvmlMemory_v2_t *);
typedef nvmlReturn_t (*nvpci_fn)(nvmlDevice_t, spwp_nvml_pci_t *);
typedef nvmlReturn_t (*nvidx_fn)(nvmlDevice_t, unsigned int *);
typedef CUresult (*bybus_fn)(CUdevice *, const char *);

/* The CUDA ordinal of an NVML device: by PCI bus id when this process already uses the driver
 * (CUDA_VISIBLE_DEVICES and ordering then agree with cuMemGetInfo), else NVML's own index
 * (the same unless devices are hidden or reordered). -1 when neither is known. */
static int nvml_cuda_ordinal(nvmlDevice_t dev) {
    spwp_nvml_pci_t pci;
    if (atomic_load(&cuda_filled) && wraps[W_cuDeviceGetByPCIBusId].real && wraps[W_nvmlDeviceGetPciInfo_v3].real &&
        REAL(W_nvmlDeviceGetPciInfo_v3, nvpci_fn)(dev, &pci) == 0) {
        CUdevice d;
        pci.busId[sizeof pci.busId - 1] = '\0';
        if (REAL(W_cuDeviceGetByPCIBusId, bybus_fn)(&d, pci.busId) == CUDA_SUCCESS) return d;
    }
    unsigned int idx;
    if (wraps[W_nvmlDeviceGetIndex].real && REAL(W_nvmlDeviceGetIndex, nvidx_fn)(dev, &idx) == 0) return (int)idx;
    return -1;
}

SPWP_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    if (!ready(W_nvmlDeviceGetMemoryInfo)) return 13; /* NVML_ERROR_FUNCTION_NOT_FOUND */
    nvmlReturn_t r = REAL(W_nvmlDeviceGetMemoryInfo, nvmem_fn)(dev, mem);
    if (r != 0 || !active() || !mem) return r;
    uint64_t vf, vt;
    spwp_ledger_view(&L, nvml_cuda_ordinal(dev), mem->free, mem->total, false, &vf, &vt);
    mem->total = vt;
    mem->free = vf;
    mem->used = vt - vf;
    return r;
}

SPWP_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    if (!ready(W_nvmlDeviceGetMemoryInfo_v2)) return 13;
    nvmlReturn_t r = REAL(W_nvmlDeviceGetMemoryInfo_v2, nvmem2_fn)(dev, mem);
    if (r != 0 || !active() || !mem) return r;
    uint64_t vf, vt;
    spwp_ledger_view(&L, nvml_cuda_ordinal(dev), mem->free, mem->total, false, &vf, &vt);
    mem->total = vt;
    mem->free = vf;
    if (mem->reserved > vt - vf) mem->reserved = vt - vf;
    mem->used = vt - vf - mem->reserved;
    return r;
}

/* ---- resolvers ---- */

typedef CUresult (*gpa2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);

static void route_result(const char *via, const char *symbol, void **pfn, int version, cuuint64_t flags) {
    if (!pfn || !*pfn) return;
    void *w = route_find(*pfn);
    if (L.cfg.debug) {
        bool ours = false;
        for (int i = 0; i < W_COUNT && !ours; i++) ours = wraps[i].wrap && fn2ptr(wraps[i].wrap) == *pfn;
        say("debug: %s(%s, %d, %llu) -> %s", via, symbol ? symbol : "(null)", version,
            (unsigned long long)flags, w ? "wrapped" : ours ? "shim (bound to the export)" : "driver");
    }
    if (w) *pfn = w;
}

SPWP_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *status) {
    if (!ready(W_cuGetProcAddress_v2)) return MISSING;
    CUresult r = REAL(W_cuGetProcAddress_v2, gpa2_fn)(symbol, pfn, version, flags, status);
    if (r == CUDA_SUCCESS) route_result("cuGetProcAddress_v2", symbol, pfn, version, flags);
    return r;
}

SPWP_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    if (!ready(W_cuGetProcAddress)) return MISSING;
    CUresult r = REAL(W_cuGetProcAddress, gpa1_fn)(symbol, pfn, version, flags);
    if (r == CUDA_SUCCESS) route_result("cuGetProcAddress", symbol, pfn, version, flags);
    return r;
}

/* 'c' or 'n' when symbol is the name of a wrapped function, else 0. */
static char wrapped_lib(const char *symbol) {
    if (!symbol || !((symbol[0] == 'c' && symbol[1] == 'u') || !strncmp(symbol, "nvml", 4))) return 0;
    for (int i = 0; i < W_COUNT; i++)
        if (wraps[i].wrap && !strcmp(wraps[i].name, symbol)) return wraps[i].lib;
    return 0;
}

__attribute__((noinline)) static void *dlsym_routed(void *handle, const char *symbol) {
    dlsym_fn rd = real_dlsym();
    if (!rd) return NULL;
    void *r = rd(handle, symbol);
    char lib = r && !in_fill ? wrapped_lib(symbol) : 0;
    if (!lib) return r;
    ensure_init();
    pthread_once(lib == 'n' ? &nvml_once : &cuda_once, lib == 'n' ? fill_nvml : fill_cuda);
    void *w = route_find(r);
    if (L.cfg.debug) say("debug: dlsym(%s) -> %s", symbol, w ? "wrapped" : "unchanged");
    return w ? w : r;
}

/* dlsym finds its caller's object from its return address (RTLD_NEXT searches after the
 * caller), so RTLD_NEXT must reach the real dlsym as a tail call, from the caller's frame: the
 * function is kept trivial and compiled with sibling calls on at any build type
 * (tests/test_preload_fake checks the result). */
__attribute__((optimize("O2", "optimize-sibling-calls"))) SPWP_EXPORT void *dlsym(void *handle,
                                                                                 const char *symbol) {
    if (handle == RTLD_NEXT) {
        dlsym_fn rd = real_dlsym();
        return rd ? rd(handle, symbol) : NULL;
    }
    return dlsym_routed(handle, symbol);
}

/* ---- the table, and the report at exit ---- */

static spwp_wrap wraps[W_COUNT] = {
#define X(n, l) [W_##n] = {#n, l, (spwp_fn)n, NULL},
    SPWP_WRAPS(X)
#undef X
#define X(n, l) [W_##n] = {#n, l, NULL, NULL},
        SPWP_HELPERS(X)
#undef X
};

/* 1 when this process is the command `spillway run` started (it exec'd itself into the command,
 * so the pid it left in SPILLWAY_RUN_PID is ours): that one reports even when it allocated
 * nothing, its children only when they did. */
static bool is_run_command(void) {
    const char *p = getenv("SPILLWAY_RUN_PID");
    return p && strtol(p, NULL, 10) == (long)getpid();
}

__attribute__((destructor)) static void spwp_report(void) {
    if (disabled) return;
    if (!atomic_load(&initialised)) { /* no CUDA call: the configuration was never read */
        spwp_config c;
        char err[512];
        if (!is_run_command() ||
            spwp_config_load(&c, getenv("SPILLWAY_CONF"), getenv("SPILLWAY_BUDGET"), getenv("SPILLWAY_REPORT"),
                             getenv("SPILLWAY_CHARGE_MANAGED"), err, sizeof err) ||
            !c.report)
            return;
        say("no device memory was allocated");
        return;
    }
    if (!L.cfg.report) return;
    int used = 0;
    for (int d = 0; d < SPWP_MAX_DEVICES; d++) {
        spwp_devstate s = spwp_ledger_state(&L, d);
        if (!s.used) continue;
        used++;
        uint64_t b = spwp_ledger_budget(&L, d);
        char budget[48];
        if (b == SPWP_UNLIMITED)
            snprintf(budget, sizeof budget, "none");
        else
            snprintf(budget, sizeof budget, "%llu B", (unsigned long long)b);
        say("device %d: budget %s, peak charged %llu B, charged at exit %llu B, %llu allocations, "
            "%llu refused",
            d, budget, (unsigned long long)s.peak, (unsigned long long)s.charged,
            (unsigned long long)s.charges, (unsigned long long)s.refusals);
    }
    if (!used && is_run_command()) say("no device memory was allocated");
}
