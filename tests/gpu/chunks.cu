// GPU acceptance program for the interposer (built by run_shim_tests.sh with static and with
// shared cudart). Modes:
//   managed N | malloc N | async N   allocate 1 GiB chunks (cudaMallocManaged, the seed's
//                                     program / cudaMalloc / cudaMallocAsync) until one fails;
//                                     exit 0 iff exactly N succeeded and the next failed with
//                                     cudaErrorMemoryAllocation
//   nvml                             cudaMemGetInfo and NVML's nvmlDeviceGetMemoryInfo (dlopen of
//                                     libnvidia-ml.so.1) agree, with 1 GiB allocated
//   bench ITERS                      median time of a cudaMalloc(1 MiB) + cudaFree pair, in us
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

static double now_us() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int chunks(const char *mode, int expect) {
    const size_t GiB = 1ull << 30;
    std::vector<void *> ptrs;
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < 64; i++) {
        void *p = nullptr;
        if (!strcmp(mode, "managed"))
            e = cudaMallocManaged(&p, GiB);
        else if (!strcmp(mode, "malloc"))
            e = cudaMalloc(&p, GiB);
        else {
            e = cudaMallocAsync(&p, GiB, 0);
            if (e == cudaSuccess) e = cudaStreamSynchronize(0);
        }
        if (e != cudaSuccess) break;
        ptrs.push_back(p);
        printf("alloc GB: %zu\n", ptrs.size());
    }
    printf("chunk %zu: %s (%s)\n", ptrs.size() + 1, cudaGetErrorName(e), cudaGetErrorString(e));
    bool ok = (int)ptrs.size() == expect && e == cudaErrorMemoryAllocation;
    cudaGetLastError();
    for (void *p : ptrs) {
        cudaError_t f = !strcmp(mode, "async") ? cudaFreeAsync(p, 0) : cudaFree(p);
        if (f != cudaSuccess) {
            printf("free failed: %s\n", cudaGetErrorName(f));
            ok = false;
        }
    }
    cudaDeviceSynchronize();
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    printf("after frees: free %zu of %zu\n", fr, tot);
    return ok ? 0 : 1;
}

typedef struct {
    unsigned long long total, free, used;
} nvml_mem;

static int nvml() {
    void *p = nullptr;
    if (cudaMalloc(&p, 1ull << 30) != cudaSuccess) return printf("cudaMalloc failed\n"), 1;
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) return printf("no libnvidia-ml.so.1: %s\n", dlerror()), 1;
    auto init = (int (*)(void))dlsym(h, "nvmlInit_v2");
    auto get = (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    auto bus = (int (*)(const char *, void **))dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2");
    auto info = (int (*)(void *, nvml_mem *))dlsym(h, "nvmlDeviceGetMemoryInfo");
    if (!init || !get || !info || init() != 0) return printf("NVML unusable\n"), 1;
    // The NVML device of CUDA device 0, by PCI bus id.
    char busid[64];
    void *dev = nullptr;
    cudaDeviceGetPCIBusId(busid, sizeof busid, 0);
    if (!bus || bus(busid, &dev) != 0) get(0, &dev);
    nvml_mem m;
    int r = info(dev, &m);
    printf("cudaMemGetInfo: free %zu total %zu\nnvmlDeviceGetMemoryInfo: free %llu total %llu used %llu\n", fr, tot,
           m.free, m.total, m.used);
    cudaFree(p);
    // Free can differ by what other processes did between the two calls: allow 64 MiB.
    long long df = (long long)m.free - (long long)fr;
    return r == 0 && m.total == tot && llabs(df) <= (64ll << 20) ? 0 : 1;
}

static int bench(int iters) {
    void *p;
    cudaFree(0);
    std::vector<double> t;
    for (int i = 0; i < iters + 20; i++) {
        double a = now_us();
        if (cudaMalloc(&p, 1 << 20) != cudaSuccess || cudaFree(p) != cudaSuccess) return printf("failed\n"), 1;
        if (i >= 20) t.push_back(now_us() - a);
    }
    std::sort(t.begin(), t.end());
    printf("median_us %.2f\n", t[t.size() / 2]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return fprintf(stderr, "usage: %s managed|malloc|async N | nvml | bench ITERS\n", argv[0]), 2;
    if (!strcmp(argv[1], "nvml")) return nvml();
    if (!strcmp(argv[1], "bench")) return bench(argc > 2 ? atoi(argv[2]) : 200);
    return chunks(argv[1], argc > 2 ? atoi(argv[2]) : 4);
}
