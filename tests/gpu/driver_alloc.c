/* GPU acceptance program: 1 GiB cuMemAlloc chunks through the driver API, either linked against
 * libcuda (mode "link") or resolved at run time with dlopen("libcuda.so.1") + dlsym("cuMemAlloc_v2")
 * (mode "dlsym", as ctypes and XLA do). Exit 0 iff exactly N chunks fit and the next call
 * returned CUDA_ERROR_OUT_OF_MEMORY.  usage: driver_alloc link|dlsym N */
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*setcur_fn)(CUcontext);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);

static void *need(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) {
        printf("dlsym(%s) failed: %s\n", name, dlerror());
        exit(1);
    }
    return p;
}
#define AS(t, p) ((t)(uintptr_t)(p))

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    int expect = atoi(argv[2]);
    init_fn init = cuInit;
    retain_fn retain = cuDevicePrimaryCtxRetain;
    setcur_fn setcur = cuCtxSetCurrent;
    alloc_fn alloc = cuMemAlloc;
    free_fn fr = cuMemFree;
    if (!strcmp(argv[1], "dlsym")) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) return printf("dlopen: %s\n", dlerror()), 1;
        init = AS(init_fn, need(h, "cuInit"));
        retain = AS(retain_fn, need(h, "cuDevicePrimaryCtxRetain"));
        setcur = AS(setcur_fn, need(h, "cuCtxSetCurrent"));
        alloc = AS(alloc_fn, need(h, "cuMemAlloc_v2"));
        fr = AS(free_fn, need(h, "cuMemFree_v2"));
    }
    CUcontext ctx;
    if (init(0) || retain(&ctx, 0) || setcur(ctx)) return printf("driver setup failed\n"), 1;
    CUdeviceptr p[64];
    int n = 0;
    CUresult r = CUDA_SUCCESS;
    while (n < 64 && (r = alloc(&p[n], 1ull << 30)) == CUDA_SUCCESS) n++;
    printf("%s: %d chunks of 1 GiB, then CUresult %d\n", argv[1], n, (int)r);
    for (int i = 0; i < n; i++) fr(p[i]);
    return n == expect && r == CUDA_ERROR_OUT_OF_MEMORY ? 0 : 1;
}
