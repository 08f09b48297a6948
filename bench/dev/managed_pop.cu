// Experiment: does the way managed pages are first populated on the host change the rate of a
// read-mostly prefetch to the device (and of a migration either way)? Host chunks allocated by a
// migration from the device may be larger than those of CPU first-touch faults.
//   nvcc -O2 -std=c++17 -o managed_pop bench/dev/managed_pop.cu && ./managed_pop
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
static double now() { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static const int N = 8;
static const size_t LB = 128u << 20;
static cudaMemLocation DEV = {cudaMemLocationTypeDevice, 0}, HOST = {cudaMemLocationTypeHost, 0};

static void fill(char *p, int l) { for (size_t k = 0; k < LB; k += 8) *(uint64_t *)(p + k) = k * 2654435761u + l; }

int main() {
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const char *how[] = {"cpu first touch", "prefetch to host, then cpu writes", "device memset, prefetch to host, cpu writes",
                         "prefetch to device, to host, cpu writes"};
    for (int pop = 0; pop < 4; pop++) {
        char *L[N];
        for (int l = 0; l < N; l++) {
            CK(cudaMallocManaged(&L[l], LB));
            CK(cudaMemAdvise(L[l], LB, cudaMemAdviseSetPreferredLocation, HOST));
            if (pop == 1) CK(cudaMemPrefetchAsync(L[l], LB, HOST, 0, s));
            if (pop == 2) { CK(cudaMemsetAsync(L[l], 1, LB, s)); CK(cudaMemPrefetchAsync(L[l], LB, HOST, 0, s)); }
            if (pop == 3) { CK(cudaMemPrefetchAsync(L[l], LB, DEV, 0, s)); CK(cudaMemPrefetchAsync(L[l], LB, HOST, 0, s)); }
            CK(cudaStreamSynchronize(s));
            fill(L[l], l);
        }
        double rm = 0, mig = 0, back = 0; int reps = 3;
        for (int r = 0; r < reps; r++) {
            for (int l = 0; l < N; l++) CK(cudaMemAdvise(L[l], LB, cudaMemAdviseSetReadMostly, DEV));
            double t0 = now();
            for (int l = 0; l < N; l++) CK(cudaMemPrefetchAsync(L[l], LB, DEV, 0, s));
            CK(cudaStreamSynchronize(s)); rm += now() - t0;
            for (int l = 0; l < N; l++) CK(cudaMemAdvise(L[l], LB, cudaMemAdviseUnsetReadMostly, DEV));
            CK(cudaDeviceSynchronize());
            t0 = now();
            for (int l = 0; l < N; l++) CK(cudaMemPrefetchAsync(L[l], LB, DEV, 0, s));
            CK(cudaStreamSynchronize(s)); mig += now() - t0;
            t0 = now();
            for (int l = 0; l < N; l++) CK(cudaMemPrefetchAsync(L[l], LB, HOST, 0, s));
            CK(cudaStreamSynchronize(s)); back += now() - t0;
        }
        double gb = (double)reps * N * LB / 1e6;
        printf("%-45s read-mostly to device %.1f GB/s | migrate to device %.1f GB/s | migrate to host %.1f GB/s\n", how[pop], gb / rm, gb / mig, gb / back);
        fflush(stdout);
        for (int l = 0; l < N; l++) CK(cudaFree(L[l]));
    }
    return 0;
}
