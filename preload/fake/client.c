/*
 * Runs under `spillway run` with the fake driver (preload/fake) and checks the interposer:
 * direct binding, dlsym on a libcuda handle, cuGetProcAddress routing (versions, _ptsz, the
 * resolver itself, pointers that are not the exports), refusals and their message, untracked
 * frees, host-located cuMemCreate, NVML, and RTLD_NEXT passing through dlsym intact.
 *
 * usage: spwp_fake_client EXPECTED_TOTAL_BYTES   (the budget the run was given)
 * Prints PASS/FAIL per check; exits 1 on any failure.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>

int fake_count(const char *name);

#define GiB (1ull << 30)
static int failures;

static void check(int ok, const char *what) {
    printf("%s: %s\n", ok ? "PASS" : "FAIL", what);
    fflush(stdout);
    if (!ok) failures++;
}

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*freeasync_fn)(CUdeviceptr, CUstream);
typedef CUresult (*info_fn)(size_t *, size_t *);

static void *sym(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) {
        printf("FAIL: dlsym(%s): %s\n", name, dlerror());
        exit(1);
    }
    return p;
}

#define AS(type, p) ((type)(uintptr_t)(p))

/* Allocate 1 GiB chunks through `alloc` until refused; expect exactly `fit` to succeed, the next
 * to fail with CUDA_ERROR_OUT_OF_MEMORY without reaching the driver; free them through `fr`. */
static void fill_to_budget(const char *via, alloc_fn alloc, free_fn fr, unsigned fit, const char *counter) {
    CUdeviceptr p[256];
    unsigned n = 0;
    int before = fake_count(counter);
    CUresult r = CUDA_SUCCESS;
    while (n < 256 && (r = alloc(&p[n], GiB)) == CUDA_SUCCESS) n++;
    char what[160];
    snprintf(what, sizeof what, "%s: %u x 1 GiB fit, the next fails with CUDA_ERROR_OUT_OF_MEMORY (got %u, %d)",
             via, fit, n, (int)r);
    check(n == fit && r == CUDA_ERROR_OUT_OF_MEMORY, what);
    snprintf(what, sizeof what, "%s: the refused call never reached the driver (%s ran %d times)", via, counter,
             fake_count(counter) - before);
    check(fake_count(counter) - before == (int)fit, what);
    int ok = 1;
    for (unsigned i = 0; i < n; i++) ok &= fr(p[i]) == CUDA_SUCCESS;
    snprintf(what, sizeof what, "%s: frees succeed and refund", via);
    size_t f = 0, t = 0;
    cuMemGetInfo(&f, &t);
    check(ok && f == t, what);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s EXPECTED_TOTAL_BYTES\n", argv[0]);
        return 2;
    }
    unsigned long long budget = strtoull(argv[1], NULL, 10);
    unsigned fit = (unsigned)(budget / GiB);
    char what[200];

    check(cuInit(0) == CUDA_SUCCESS, "cuInit");
    size_t f = 0, t = 0;
    check(cuMemGetInfo(&f, &t) == CUDA_SUCCESS && t == budget && f == budget,
          "cuMemGetInfo_v2 reports the budget as total and free");
    size_t total = 0;
    check(cuDeviceTotalMem(&total, 0) == CUDA_SUCCESS && total == budget, "cuDeviceTotalMem_v2 reports the budget");

    /* 1. direct binding to the exports */
    fill_to_budget("direct cuMemAlloc_v2", cuMemAlloc_v2, cuMemFree_v2, fit, "cuMemAlloc_v2");

    /* 2. dlopen + dlsym, as ctypes and XLA do */
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    check(h != NULL, "dlopen libcuda.so.1");
    alloc_fn a = AS(alloc_fn, sym(h, "cuMemAlloc_v2"));
    free_fn fr = AS(free_fn, sym(h, "cuMemFree_v2"));
    fill_to_budget("dlsym cuMemAlloc_v2", a, fr, fit, "cuMemAlloc_v2");

    /* 3. cuGetProcAddress, as cudart does; the fake returns a non-exported cuMemAlloc */
    gpa_fn gpa = AS(gpa_fn, sym(h, "cuGetProcAddress_v2"));
    void *p = NULL;
    CUdriverProcAddressQueryResult st;
    check(gpa("cuMemAlloc", &p, 12000, 0, &st) == CUDA_SUCCESS && p, "cuGetProcAddress(cuMemAlloc)");
    void *pf = NULL;
    gpa("cuMemFree", &pf, 12000, 0, &st);
    /* The wrapper calls the exported real function, whatever pointer the resolver gave. */
    fill_to_budget("cuGetProcAddress cuMemAlloc (non-exported driver pointer)", AS(alloc_fn, p), AS(free_fn, pf), fit,
                   "cuMemAlloc_v2");
    void *self = NULL;
    check(gpa("cuGetProcAddress", &self, 12000, 0, &st) == CUDA_SUCCESS && self == (void *)(uintptr_t)gpa,
          "cuGetProcAddress(cuGetProcAddress) returns the shim's resolver");
    Dl_info di;
    check(self && dladdr(self, &di) && strstr(di.dli_fname, "spillway-preload"),
          "the resolver handed out lives in libspillway-preload.so");

    /* 4. per-thread-stream variants stay apart */
    void *al = NULL, *ap = NULL, *fl = NULL, *fp = NULL;
    gpa("cuMemAllocAsync", &al, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &st);
    gpa("cuMemAllocAsync", &ap, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st);
    gpa("cuMemFreeAsync", &fl, 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &st);
    gpa("cuMemFreeAsync", &fp, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st);
    check(al && ap && al != ap, "cuMemAllocAsync legacy and _ptsz resolve to different wrappers");
    int c0 = fake_count("cuMemAllocAsync"), c1 = fake_count("cuMemAllocAsync_ptsz");
    CUdeviceptr d = 0;
    check(AS(async_fn, ap)(&d, GiB, NULL) == CUDA_SUCCESS && fake_count("cuMemAllocAsync_ptsz") == c1 + 1 &&
              fake_count("cuMemAllocAsync") == c0,
          "the _ptsz wrapper calls the driver's _ptsz function");
    cuMemGetInfo(&f, &t);
    check(f == budget - GiB, "a stream-ordered allocation is charged");
    check(AS(freeasync_fn, fp)(d, NULL) == CUDA_SUCCESS && fake_count("cuMemFreeAsync_ptsz") == 1,
          "cuMemFreeAsync_ptsz frees through the driver's _ptsz function");
    cuMemGetInfo(&f, &t);
    check(f == budget, "cuMemFreeAsync refunds");
    check(AS(async_fn, al)(&d, budget + 1, NULL) == CUDA_ERROR_OUT_OF_MEMORY,
          "cuMemAllocAsync past the budget: CUDA_ERROR_OUT_OF_MEMORY");

    /* 5. the refusal message */
    int pipefd[2];
    if (pipe(pipefd) == 0) {
        int saved = dup(2);
        dup2(pipefd[1], 2);
        CUresult r = cuMemAlloc(&d, budget + 1);
        dup2(saved, 2);
        close(pipefd[1]);
        char buf[512] = {0};
        ssize_t n = read(pipefd[0], buf, sizeof buf - 1);
        (void)n;
        char want[160];
        snprintf(want, sizeof want, "out of memory: requested %llu B, charged 0 B of budget %llu B", budget + 1,
                 budget);
        check(r == CUDA_ERROR_OUT_OF_MEMORY && strstr(buf, want) && strstr(buf, "spwp_fake_clien"),
              "one stderr line names the program, requested, charged and budget");
        printf("      (%.*s)\n", (int)strcspn(buf, "\n"), buf);
    }

    /* 6. untracked pointers go to the driver, whose answer is returned unchanged */
    check(cuMemFree(0xdead0000ull) == CUDA_ERROR_INVALID_VALUE, "free of an untracked pointer: the driver's error");

    /* 7. cuMemCreate: device locations charged, host locations untouched */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    CUmemGenericAllocationHandle mh;
    check(cuMemCreate(&mh, budget + GiB, &prop, 0) == CUDA_SUCCESS, "cuMemCreate on host NUMA past the budget passes");
    cuMemGetInfo(&f, &t);
    check(f == budget && cuMemRelease(mh) == CUDA_SUCCESS, "host cuMemCreate is not charged");
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    check(cuMemCreate(&mh, budget + GiB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY,
          "cuMemCreate on the device past the budget: CUDA_ERROR_OUT_OF_MEMORY");
    check(cuMemCreate(&mh, GiB, &prop, 0) == CUDA_SUCCESS, "cuMemCreate on the device within the budget");
    cuMemGetInfo(&f, &t);
    check(f == budget - GiB, "device cuMemCreate is charged");

    /* 8. managed memory and pitch are charged */
    CUdeviceptr m;
    check(cuMemAllocManaged(&m, budget, CU_MEM_ATTACH_GLOBAL) == CUDA_ERROR_OUT_OF_MEMORY,
          "cuMemAllocManaged past the budget: CUDA_ERROR_OUT_OF_MEMORY");
    size_t pitch = 0;
    check(cuMemAllocPitch(&m, &pitch, 1000, 1024, 4) == CUDA_SUCCESS && pitch == 1024, "cuMemAllocPitch");
    cuMemGetInfo(&f, &t);
    snprintf(what, sizeof what, "cuMemAllocPitch charges pitch x height (free %zu)", f);
    check(f == budget - GiB - 1024 * 1024, what);
    cuMemFree(m);

    /* 9. NVML agrees with cuMemGetInfo */
    void *nv = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (nv) {
        typedef int (*init_fn)(void);
        typedef int (*byidx_fn)(unsigned, void **);
        typedef struct {
            unsigned long long total, free, used;
        } mem_t;
        typedef int (*mem_fn)(void *, mem_t *);
        void *dev = NULL;
        mem_t mem;
        AS(init_fn, sym(nv, "nvmlInit_v2"))();
        AS(byidx_fn, sym(nv, "nvmlDeviceGetHandleByIndex_v2"))(0, &dev);
        int r = AS(mem_fn, sym(nv, "nvmlDeviceGetMemoryInfo"))(dev, &mem);
        cuMemGetInfo(&f, &t);
        snprintf(what, sizeof what, "NVML memory info agrees with cuMemGetInfo (nvml %llu/%llu, cuda %zu/%zu)",
                 mem.free, mem.total, f, t);
        check(r == 0 && mem.total == t && mem.free == f && mem.used == t - f, what);
    } else {
        check(0, "dlopen libnvidia-ml.so.1 (fake)");
    }
    cuMemRelease(mh);

    /* 10. RTLD_NEXT still means "after the caller" through the interposed dlsym */
    void *next = dlsym(RTLD_NEXT, "dlsym");
    check(next && dladdr(next, &di) && strstr(di.dli_fname, "spillway-preload"),
          "dlsym(RTLD_NEXT, \"dlsym\") from the program finds the shim (the next object after it)");

    printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
