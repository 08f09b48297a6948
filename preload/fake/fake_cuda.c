/*
 * A fake libcuda.so.1 for testing the interposer without a GPU: two 80 GiB devices held in a
 * table (no memory behind the addresses), the entry points the shim wraps, and a resolver that
 * behaves like the real one: versioned names, per-thread-stream variants, and for cuMemAlloc
 * (v2) a pointer that is NOT the exported symbol, as a real driver is free to hand out.
 * fake_count(name) tells the client how often each implementation ran.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <cuda.h>

#undef cuMemAlloc
#undef cuMemFree
#undef cuMemGetInfo
#undef cuDeviceTotalMem
#undef cuMemAllocPitch
#undef cuArrayCreate
#undef cuGetProcAddress

#define EXPORT __attribute__((visibility("default")))
#define DEV_BYTES (80ull << 30)
#define MAX_LIVE 8192

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    uint64_t key, bytes;
    int dev, kind;
} live[MAX_LIVE];
static uint64_t used[2], next_addr = 0x100000000ull;
static int current = 0;

enum { C_ALLOC, C_ALLOC_INTERNAL, C_FREE, C_ASYNC, C_ASYNC_PTSZ, C_FREEASYNC, C_FREEASYNC_PTSZ,
       C_CREATE, C_RELEASE, C_MANAGED, C_PITCH, C_ARRAY, C_COUNT };
static const char *const count_names[C_COUNT] = {
    "cuMemAlloc_v2", "cuMemAlloc_internal", "cuMemFree_v2", "cuMemAllocAsync", "cuMemAllocAsync_ptsz",
    "cuMemFreeAsync", "cuMemFreeAsync_ptsz", "cuMemCreate", "cuMemRelease", "cuMemAllocManaged",
    "cuMemAllocPitch_v2", "cuArrayCreate_v2"};
static int counts[C_COUNT];

EXPORT int fake_count(const char *name) {
    for (int i = 0; i < C_COUNT; i++)
        if (!strcmp(name, count_names[i])) return counts[i];
    return -1;
}
EXPORT void fake_set_device(int d) { current = d; }

/* kind 1 device memory, 2 host memory (not counted in used). */
static CUresult take(unsigned long long *key, uint64_t bytes, int dev, int kind, int counter) {
    pthread_mutex_lock(&lock);
    counts[counter]++;
    if (!bytes) return pthread_mutex_unlock(&lock), CUDA_ERROR_INVALID_VALUE;
    if (kind == 1 && used[dev] + bytes > DEV_BYTES) return pthread_mutex_unlock(&lock), CUDA_ERROR_OUT_OF_MEMORY;
    for (int i = 0; i < MAX_LIVE; i++) {
        if (live[i].key) continue;
        live[i].key = next_addr;
        live[i].bytes = bytes;
        live[i].dev = dev;
        live[i].kind = kind;
        *key = next_addr;
        next_addr += (bytes + 0xfffff) & ~0xfffffull;
        if (kind == 1) used[dev] += bytes;
        pthread_mutex_unlock(&lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult give(uint64_t key, int counter) {
    pthread_mutex_lock(&lock);
    counts[counter]++;
    for (int i = 0; i < MAX_LIVE; i++) {
        if (live[i].key != key || !key) continue;
        if (live[i].kind == 1) used[live[i].dev] -= live[i].bytes;
        live[i].key = 0;
        pthread_mutex_unlock(&lock);
        return CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuInit(unsigned int flags) { return flags ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS; }
EXPORT CUresult cuDriverGetVersion(int *v) { return *v = 13000, CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetCount(int *n) { return *n = 2, CUDA_SUCCESS; }
EXPORT CUresult cuCtxGetDevice(CUdevice *d) { return *d = current, CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *d, const char *bus) {
    if (!strcmp(bus, "00000000:01:00.0")) return *d = 0, CUDA_SUCCESS;
    if (!strcmp(bus, "00000000:02:00.0")) return *d = 1, CUDA_SUCCESS;
    return CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) {
    if (d < 0 || d > 1) return CUDA_ERROR_INVALID_DEVICE;
    return *b = DEV_BYTES, CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t *f, size_t *t) {
    pthread_mutex_lock(&lock);
    *f = DEV_BYTES - used[current];
    *t = DEV_BYTES;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return take(p, n, current, 1, C_ALLOC); }
/* What the resolver returns for cuMemAlloc: same behaviour, different address. */
static CUresult mem_alloc_internal(CUdeviceptr *p, size_t n) { return take(p, n, current, 1, C_ALLOC_INTERNAL); }
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return give(p, C_FREE); }
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int flags) {
    (void)flags;
    return take(p, n, current, 1, C_MANAGED);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned int e) {
    (void)e;
    *pitch = (w + 511) / 512 * 512;
    return take(p, *pitch * h, current, 1, C_PITCH);
}
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) {
    (void)s;
    return take(p, n, current, 1, C_ASYNC);
}
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) {
    (void)s;
    return take(p, n, current, 1, C_ASYNC_PTSZ);
}
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    (void)s;
    return give(p, C_FREEASYNC);
}
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    (void)s;
    return give(p, C_FREEASYNC_PTSZ);
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    (void)flags;
    int dev = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : 0;
    if (dev < 0 || dev > 1) return CUDA_ERROR_INVALID_DEVICE;
    return take(h, n, dev, prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? 1 : 2, C_CREATE);
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { return give(h, C_RELEASE); }
EXPORT CUresult cuArrayCreate_v2(CUarray *a, const CUDA_ARRAY_DESCRIPTOR *d) {
    unsigned long long key;
    CUresult r = take(&key, (uint64_t)d->Width * (d->Height ? d->Height : 1) * 4, current, 1, C_ARRAY);
    if (r == CUDA_SUCCESS) *a = (CUarray)(uintptr_t)key;
    return r;
}
EXPORT CUresult cuArrayDestroy(CUarray a) { return give((uint64_t)(uintptr_t)a, C_FREE); }

typedef void (*fn)(void);
EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *st);
EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int version, cuuint64_t flags);

static const struct {
    const char *name;
    int min_version;
    int ptsz; /* -1 either, 0 legacy only, 1 per-thread only */
    fn f;
} table[] = {
    {"cuInit", 2000, -1, (fn)cuInit},
    {"cuDriverGetVersion", 2020, -1, (fn)cuDriverGetVersion},
    {"cuCtxGetDevice", 2000, -1, (fn)cuCtxGetDevice},
    {"cuDeviceTotalMem", 3020, -1, (fn)cuDeviceTotalMem_v2},
    {"cuMemGetInfo", 3020, -1, (fn)cuMemGetInfo_v2},
    {"cuMemAlloc", 3020, -1, (fn)mem_alloc_internal},
    {"cuMemFree", 3020, -1, (fn)cuMemFree_v2},
    {"cuMemAllocManaged", 6000, -1, (fn)cuMemAllocManaged},
    {"cuMemAllocPitch", 3020, -1, (fn)cuMemAllocPitch_v2},
    {"cuMemAllocAsync", 11020, 0, (fn)cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, (fn)cuMemAllocAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, (fn)cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, (fn)cuMemFreeAsync_ptsz},
    {"cuMemCreate", 10020, -1, (fn)cuMemCreate},
    {"cuMemRelease", 10020, -1, (fn)cuMemRelease},
    {"cuArrayCreate", 3020, -1, (fn)cuArrayCreate_v2},
    {"cuArrayDestroy", 2000, -1, (fn)cuArrayDestroy},
    {"cuGetProcAddress", 12000, -1, (fn)cuGetProcAddress_v2},
    {"cuGetProcAddress", 11030, -1, (fn)cuGetProcAddress},
};

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *st) {
    int want_ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    int found = 0;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].name, sym)) continue;
        found = 1;
        if (version < table[i].min_version) continue;
        if (table[i].ptsz >= 0 && table[i].ptsz != want_ptsz) continue;
        memcpy(pfn, &table[i].f, sizeof *pfn);
        if (st) *st = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    *pfn = NULL;
    if (st) *st = found ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int version, cuuint64_t flags) {
    return cuGetProcAddress_v2(sym, pfn, version, flags, NULL);
}
