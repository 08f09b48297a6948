// Experiment: what do cudaMemAdvise and cudaMemPrefetchAsync cost on 128 MiB managed ranges?
// nvcc -O2 -o managed_advise bench/dev/managed_advise.cu && ./managed_advise
#include <chrono>
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
static double now() { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
    const size_t n = 128u << 20; const int N = 8;
    char *p[N]; cudaStream_t s; CK(cudaStreamCreate(&s));
    cudaMemLocation dev = {cudaMemLocationTypeDevice, 0}, host = {cudaMemLocationTypeHost, 0};
    for (int i = 0; i < N; i++) { CK(cudaMallocManaged(&p[i], n)); for (size_t k = 0; k < n; k += 4096) p[i][k] = 1; }
    double t0, t1;
    for (int mode = 0; mode < 3; mode++) {
        for (int i = 0; i < N; i++) {
            if (mode >= 1) { CK(cudaMemAdvise(p[i], n, cudaMemAdviseSetPreferredLocation, host)); CK(cudaMemAdvise(p[i], n, cudaMemAdviseSetReadMostly, dev)); }
        }
        CK(cudaDeviceSynchronize());
        double pf = 0, ev = 0;
        for (int r = 0; r < 3; r++) {
            t0 = now();
            for (int i = 0; i < N; i++) CK(cudaMemPrefetchAsync(p[i], n, dev, 0, s));
            CK(cudaStreamSynchronize(s)); t1 = now(); pf += t1 - t0;
            t0 = now();
            for (int i = 0; i < N; i++) {
                if (mode == 0) CK(cudaMemPrefetchAsync(p[i], n, host, 0, s));
                else { CK(cudaMemAdvise(p[i], n, cudaMemAdviseUnsetReadMostly, dev)); if (mode == 2) CK(cudaMemAdvise(p[i], n, cudaMemAdviseSetReadMostly, dev)); }
            }
            CK(cudaStreamSynchronize(s)); t1 = now(); ev += t1 - t0;
            if (mode == 1) for (int i = 0; i < N; i++) CK(cudaMemAdvise(p[i], n, cudaMemAdviseSetReadMostly, dev));
        }
        size_t fr, tot; CK(cudaMemGetInfo(&fr, &tot));
        printf("mode %d (%s): to device %.1f GB/s; evict %.2f ms per 128 MiB; free after evict %.1f GiB\n", mode,
               mode == 0 ? "prefetch both ways" : mode == 1 ? "read-mostly, unset to evict, set again later" : "read-mostly, unset+set to evict",
               3.0 * N * n / (pf / 1e3) / 1e9, ev / (3 * N), fr / 1073741824.0);
    }
    return 0;
}
