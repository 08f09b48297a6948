// Experiment: does splitting each host-to-device copy over several copy streams move pinned
// memory faster than one cudaMemcpyAsync per layer on one stream (the static split's way)?
//   nvcc -O2 -std=c++17 -o link_parallel bench/dev/link_parallel.cu && ./link_parallel
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
static const int N = 20;
static const size_t LB = 128u << 20;

int main() {
    char *h, *d[2];
    CK(cudaHostAlloc(&h, N * LB, cudaHostAllocDefault));
    memset(h, 1, N * LB);
    for (int i = 0; i < 2; i++) CK(cudaMalloc(&d[i], LB));
    cudaStream_t s[4];
    for (int i = 0; i < 4; i++) CK(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int rep = 0; rep < 3; rep++)
        for (int ways : {1, 2, 4}) {
            for (int chunk_mib : {128, 32, 8}) {
                size_t cb = (size_t)chunk_mib << 20;
                CK(cudaDeviceSynchronize());
                CK(cudaEventRecord(a, s[0]));
                for (int i = 1; i < ways; i++) CK(cudaStreamWaitEvent(s[i], a, 0));
                int k = 0;
                for (int l = 0; l < N; l++)
                    for (size_t off = 0; off < LB; off += cb, k++)
                        CK(cudaMemcpyAsync(d[l % 2] + off, h + l * LB + off, cb, cudaMemcpyHostToDevice, s[k % ways]));
                for (int i = 1; i < ways; i++) { cudaEvent_t e; CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); CK(cudaEventRecord(e, s[i])); CK(cudaStreamWaitEvent(s[0], e, 0)); CK(cudaEventDestroy(e)); }
                CK(cudaEventRecord(b, s[0]));
                CK(cudaEventSynchronize(b));
                float ms; CK(cudaEventElapsedTime(&ms, a, b));
                printf("rep %d streams %d chunk %3d MiB: %.3f ms for %d x 128 MiB, %.2f GB/s\n", rep, ways, chunk_mib, ms, N,
                       N * (double)LB / ms / 1e6);
            }
        }
    return 0;
}
