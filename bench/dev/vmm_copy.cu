// Experiment: what does the way device memory is mapped cost a host-to-device copy? A 416 MiB
// and a 128 MiB pinned copy into memory from cudaMalloc, and into one VMM reservation mapped
// with physical allocations of 2 MiB (the granule), 32 MiB, or one for the whole range: host
// time of the enqueue (median of 20) and the copy's rate.
//   nvcc -O2 -std=c++17 -o vmm_copy bench/dev/vmm_copy.cu -lcuda && ./vmm_copy
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CU(x) do { CUresult r_ = (x); if (r_) { printf("%s:%d %s: %d\n", __FILE__, __LINE__, #x, (int)r_); exit(1); } } while (0)
static double us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

static const size_t MAXB = 416u << 20;

static char *vmm_map(size_t chunk) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUdeviceptr va;
    CU(cuMemAddressReserve(&va, MAXB, 2u << 20, 0, 0));
    for (size_t off = 0; off < MAXB; off += chunk) {
        CUmemGenericAllocationHandle h;
        size_t n = std::min(chunk, MAXB - off);
        CU(cuMemCreate(&h, n, &prop, 0));
        CU(cuMemMap(va + off, n, 0, h, 0));
    }
    CUmemAccessDesc acc = {};
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU(cuMemSetAccess(va, MAXB, &acc, 1));
    return (char *)va;
}

int main() {
    CK(cudaFree(0));
    char *h;
    CK(cudaHostAlloc(&h, MAXB, cudaHostAllocDefault));
    memset(h, 1, MAXB);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    struct { const char *name; char *d; } dst[4];
    CK(cudaMalloc(&dst[0].d, MAXB)); dst[0].name = "cudaMalloc";
    dst[1].d = vmm_map(2u << 20); dst[1].name = "VMM 2 MiB chunks";
    dst[2].d = vmm_map(32u << 20); dst[2].name = "VMM 32 MiB chunks";
    dst[3].d = vmm_map(MAXB); dst[3].name = "VMM one allocation";
    for (size_t mib : {416, 128})
        for (auto &d : dst) {
            size_t n = mib << 20;
            std::vector<double> t;
            float ms_total = 0;
            for (int i = 0; i < 21; i++) {
                CK(cudaStreamSynchronize(s));
                CK(cudaEventRecord(a, s));
                double t0 = us();
                CK(cudaMemcpyAsync(d.d, h, n, cudaMemcpyHostToDevice, s));
                double t1 = us();
                CK(cudaEventRecord(b, s));
                CK(cudaEventSynchronize(b));
                float ms; CK(cudaEventElapsedTime(&ms, a, b));
                if (i) { t.push_back(t1 - t0); ms_total += ms; }
            }
            std::sort(t.begin(), t.end());
            printf("%3zu MiB into %-20s enqueue median %6.1f us (min %.1f, max %.1f), copy %.2f GB/s\n", mib, d.name,
                   t[t.size() / 2], t.front(), t.back(), 20 * (double)n / ms_total / 1e6);
        }
    return 0;
}
