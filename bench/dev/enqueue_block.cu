// Experiment: does cudaMemcpyAsync of pinned memory block the host when many large copies are
// already queued (the driver's queue full), i.e. is host time in an enqueue really waiting for
// the GPU? Prints the host time of each of 24 back-to-back 416 MiB and 128 MiB enqueues, then of
// event records and stream waits enqueued behind them.
//   nvcc -O2 -std=c++17 -o enqueue_block bench/dev/enqueue_block.cu && ./enqueue_block
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
static double us() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int main() {
    const int N = 24;
    for (size_t mib : {416, 128}) {
        size_t LB = mib << 20;
        char *h, *d[2];
        CK(cudaHostAlloc(&h, 4 * LB, cudaHostAllocDefault));
        memset(h, 1, 4 * LB);
        for (int i = 0; i < 2; i++) CK(cudaMalloc(&d[i], LB));
        cudaStream_t s, c;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
        cudaEvent_t ev[N];
        for (int i = 0; i < N; i++) CK(cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming));
        CK(cudaDeviceSynchronize());
        printf("%zu MiB copies, host us per call (copy / record / wait):", mib);
        double t_all = us();
        for (int i = 0; i < N; i++) {
            double t0 = us();
            CK(cudaMemcpyAsync(d[i % 2], h + (i % 4) * LB, LB, cudaMemcpyHostToDevice, s));
            double t1 = us();
            CK(cudaEventRecord(ev[i], s));
            double t2 = us();
            CK(cudaStreamWaitEvent(c, ev[i], 0));
            double t3 = us();
            printf(" %.0f/%.0f/%.0f", t1 - t0, t2 - t1, t3 - t2);
        }
        double t_enq = us() - t_all;
        CK(cudaDeviceSynchronize());
        printf("\n  enqueue total %.0f us, all done after %.0f us\n", t_enq, us() - t_all);
        for (int i = 0; i < N; i++) CK(cudaEventDestroy(ev[i]));
        CK(cudaFreeHost(h)); CK(cudaFree(d[0])); CK(cudaFree(d[1]));
        CK(cudaStreamDestroy(s)); CK(cudaStreamDestroy(c));
    }
    return 0;
}
