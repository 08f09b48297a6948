// Experiment: where does managed residency lose time against the pinned link? The bench's
// pipeline without the library: 32 read-only layers of 128 MiB cycled through 15 device slots
// (LRU, every access misses), a kernel reading each layer, the host waiting for each pass.
// Variants differ in how a replica is dropped and how prefetches are issued.
//   nvcc -O2 -std=c++17 -o managed_pipe bench/dev/managed_pipe.cu -lpthread && ./managed_pipe [0,1,...]
// (the optional list picks variants by index; POP=1 populates the layers through the device)
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <string>
#include <deque>
#include <mutex>
#include <thread>
#include <atomic>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
static double now() { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

static const int N = 32, SLOTS = 15, PASSES = 8;
static const size_t LB = 128u << 20;
static cudaMemLocation DEV = {cudaMemLocationTypeDevice, 0}, HOST = {cudaMemLocationTypeHost, 0};

__global__ void readk(const uint4 *p, size_t n, unsigned long long *out) {
    unsigned long long s = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = p[i]; s += v.x ^ v.y ^ v.z ^ v.w;
    }
    atomicAdd(out, s);
}

__global__ void fillk(uint64_t *p, size_t n, int l) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = i * 8 * 2654435761u + l;
}

struct Stat { double sum = 0, mx = 0; long n = 0; void add(double v) { sum += v; mx = std::max(mx, v); n++; } };

enum Mode { RM_MAIN = 1, RM_UNSET_ONLY, RM_THREAD, MIGRATE, PINNED, RM_WORKERS, MIG_WORKERS, RM_BATCH };
struct Cfg { const char *name; Mode mode; int depth; int split; int workers = 0; };

// Prefetch workers: each issues cudaMemPrefetchAsync on its own stream and records the chunk's
// event, then flags it issued; the main thread waits for the flag before its stream waits on the
// event. (The driver runs a prefetch inside the call when its stream is idle, so one thread
// serializes the host-side work of every migration.)
struct Job { int l, k; bool home; };
struct Workers {
    int W = 0, K = 1; std::vector<std::thread> t; std::vector<cudaStream_t> s;
    std::mutex m; std::condition_variable cv; std::vector<std::deque<Job>> q; bool stop = false;
    std::vector<char*> *L; std::vector<std::vector<cudaEvent_t>> ready; std::atomic<int> issued[32 * 8];
    std::atomic<int> home[32]; std::vector<cudaEvent_t> *use; Stat pf; std::mutex pfm;
    void start(int w, int k) {
        W = w; K = k; s.resize(W); q.resize(W + 1); ready.assign(32, std::vector<cudaEvent_t>(K));
        for (auto &x : s) CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
        for (auto &v : ready) for (auto &e : v) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        for (auto &h : home) h = 1;
        for (int i = 0; i <= W; i++) t.emplace_back(&Workers::run, this, i);
    }
    void push(int w, Job j) { std::lock_guard<std::mutex> g(m); q[w].push_back(j); cv.notify_all(); }
    void run(int w) {
        cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        for (;;) {
            Job j;
            { std::unique_lock<std::mutex> g(m); cv.wait(g, [&] { return stop || !q[w].empty(); }); if (q[w].empty()) return; j = q[w].front(); q[w].pop_front(); }
            size_t cb = LB / K; char *p = (*L)[j.l] + j.k * cb;
            if (j.home) {  // w == W: evictions (migrate mode): after the last use, pages go home
                CK(cudaEventSynchronize((*use)[j.l])); CK(cudaMemPrefetchAsync((*L)[j.l], LB, HOST, 0, st));
                CK(cudaStreamSynchronize(st)); home[j.l] = 1; continue;
            }
            while (!home[j.l]) std::this_thread::yield();
            double t0 = now();
            CK(cudaMemPrefetchAsync(p, cb, DEV, 0, s[w]));
            CK(cudaEventRecord(ready[j.l][j.k], s[w]));
            { std::lock_guard<std::mutex> g(pfm); pf.add(now() - t0); }
            issued[j.l * 8 + j.k] = 1;
        }
    }
    void finish() { { std::lock_guard<std::mutex> g(m); stop = true; } cv.notify_all(); for (auto &x : t) x.join(); }
};

struct Helper {  // collapses replicas off the main thread
    std::mutex m; std::condition_variable cv; std::deque<int> q; bool stop = false; std::thread t;
    std::vector<char*> *L; std::vector<cudaEvent_t> *use; std::vector<int> *pending; Stat adv;
    void run() {
        for (;;) {
            int l;
            { std::unique_lock<std::mutex> g(m); cv.wait(g, [&] { return stop || !q.empty(); }); if (q.empty()) return; l = q.front(); q.pop_front(); }
            CK(cudaEventSynchronize((*use)[l]));
            double t0 = now();
            CK(cudaMemAdvise((*L)[l], LB, cudaMemAdviseUnsetReadMostly, DEV));
            CK(cudaMemAdvise((*L)[l], LB, cudaMemAdviseSetReadMostly, DEV));
            adv.add(now() - t0);
            std::lock_guard<std::mutex> g(m); (*pending)[l] = 0;
        }
    }
};

int main(int argc, char **argv) {
    int pop = getenv("POP") ? atoi(getenv("POP")) : 0;
    printf("population: %s\n", pop == 2 ? "written by a kernel, migrated to host, never mapped by the cpu"
                                : pop ? "device, then migrated to host, cpu writes" : "cpu first touch");
    double link;
    std::vector<char*> L(N); char *pin; std::vector<char*> slot(SLOTS);
    unsigned long long *out; CK(cudaMalloc(&out, 8));
    cudaStream_t comp, h2d[4], d2h; CK(cudaStreamCreateWithFlags(&comp, cudaStreamNonBlocking));
    for (auto &s : h2d) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking));
    for (int l = 0; l < N; l++) {
        CK(cudaMallocManaged(&L[l], LB));
        if (pop == 2) {  // the cpu never maps these pages: no cpu mapping to revoke on prefetch
            fillk<<<264, 512, 0, d2h>>>((uint64_t *)L[l], LB / 8, l);
            CK(cudaGetLastError());
            CK(cudaMemPrefetchAsync(L[l], LB, HOST, 0, d2h));
            CK(cudaStreamSynchronize(d2h));
        } else {
            if (pop) {  // host pages allocated by a migration from the device (see managed_pop.cu)
                CK(cudaMemPrefetchAsync(L[l], LB, DEV, 0, d2h)); CK(cudaMemPrefetchAsync(L[l], LB, HOST, 0, d2h));
                CK(cudaStreamSynchronize(d2h));
            }
            for (size_t k = 0; k < LB; k += 8) *(uint64_t*)(L[l] + k) = k * 2654435761u + l;
        }
        CK(cudaMemAdvise(L[l], LB, cudaMemAdviseSetPreferredLocation, HOST));
    }
    {   // pinned link rate
        CK(cudaMallocHost(&pin, (size_t)N * LB)); for (size_t k = 0; k < (size_t)N * LB; k += 4096) pin[k] = (char)k;
        char *d; CK(cudaMalloc(&d, 1u << 30)); double best = 1e9;
        for (int r = 0; r < 3; r++) { double t0 = now(); CK(cudaMemcpyAsync(d, pin, 1u << 30, cudaMemcpyHostToDevice, h2d[0])); CK(cudaStreamSynchronize(h2d[0])); best = std::min(best, now() - t0); }
        CK(cudaFree(d)); link = (1u << 30) / (best * 1e6);
        printf("pinned link %.1f GB/s; link bound for %d x 128 MiB: %.2f ms/pass\n", link, N, N * LB / (link * 1e6));
        for (auto &s : slot) CK(cudaMalloc(&s, LB));
    }
    if (!getenv("SKIPISO")) {   // isolated prefetch rate, read-mostly set, split over k streams
        for (int split : {1, 2, 4}) for (int rm : {1, 0}) {
            double tot = 0; int moved = 0;
            for (int r = 0; r < 2; r++) {
                for (int l = 0; l < 8; l++) {
                    if (rm) CK(cudaMemAdvise(L[l], LB, cudaMemAdviseSetReadMostly, DEV));
                    else CK(cudaMemAdvise(L[l], LB, cudaMemAdviseUnsetReadMostly, DEV));
                }
                CK(cudaDeviceSynchronize());
                double t0 = now();
                for (int l = 0; l < 8; l++) for (int c = 0; c < split; c++)
                    CK(cudaMemPrefetchAsync(L[l] + c * (LB / split), LB / split, DEV, 0, h2d[c]));
                CK(cudaDeviceSynchronize()); tot += now() - t0; moved += 8;
                for (int l = 0; l < 8; l++) {
                    if (rm) CK(cudaMemAdvise(L[l], LB, cudaMemAdviseUnsetReadMostly, DEV));
                    else CK(cudaMemPrefetchAsync(L[l], LB, HOST, 0, d2h));
                }
                CK(cudaDeviceSynchronize());
            }
            printf("isolated prefetch, %s, %d stream(s): %.1f GB/s (%.3f of pinned)\n", rm ? "read-mostly" : "migrate", split,
                   moved * LB / (tot * 1e6), moved * LB / (tot * 1e6) / link);
        }
        for (int l = 0; l < N; l++) CK(cudaMemAdvise(L[l], LB, cudaMemAdviseSetReadMostly, DEV));
    }
    std::vector<Cfg> cfgs = {
        {"pinned copies into 15 slots", PINNED, 2, 1},
        {"rm, collapse unset+set on main thread (library today)", RM_MAIN, 2, 1},
        {"rm, main thread, 2 streams", RM_MAIN, 2, 2},
        {"rm, main thread, 4 streams", RM_MAIN, 2, 4},
        {"rm, collapse unset only, set at acquire", RM_UNSET_ONLY, 2, 1},
        {"rm, collapse on a helper thread", RM_THREAD, 2, 1},
        {"rm, collapse on a helper thread, 2 streams", RM_THREAD, 2, 2},
        {"rm, 2 prefetch threads, 2 chunks, depth 2", RM_WORKERS, 2, 2, 2},
        {"rm, 4 prefetch threads, 4 chunks, depth 4", RM_WORKERS, 4, 4, 4},
        {"rm, main thread, cudaMemPrefetchBatchAsync of 8 x 16 MiB", RM_BATCH, 2, 8},
        {"rm, main thread, cudaMemPrefetchBatchAsync of 64 x 2 MiB", RM_BATCH, 2, 64},
    };
    const char *only = argc > 1 ? argv[1] : nullptr;
    for (size_t ci = 0; ci < cfgs.size(); ci++) {
        Cfg c = cfgs[ci];
        if (only && !strstr(("," + std::string(only) + ",").c_str(), ("," + std::to_string(ci) + ",").c_str())) continue;
        for (int l = 0; l < N; l++) {
            if (c.mode == MIGRATE || c.mode == MIG_WORKERS) CK(cudaMemAdvise(L[l], LB, cudaMemAdviseUnsetReadMostly, DEV));
            else { CK(cudaMemAdvise(L[l], LB, cudaMemAdviseUnsetReadMostly, DEV)); CK(cudaMemAdvise(L[l], LB, cudaMemAdviseSetReadMostly, DEV)); }
            CK(cudaMemPrefetchAsync(L[l], LB, HOST, 0, d2h));
        }
        CK(cudaDeviceSynchronize());
        std::vector<cudaEvent_t> ready(N), use(N);
        for (int l = 0; l < N; l++) { CK(cudaEventCreateWithFlags(&ready[l], cudaEventDisableTiming)); CK(cudaEventCreateWithFlags(&use[l], cudaEventDisableTiming)); }
        std::vector<int> res(N, 0), slot_of(N, -1), pending(N, 0), rmset(N, 1); std::vector<long> last(N, -1); std::vector<int> freeslots, slot_prev(SLOTS, -1);
        for (int s = 0; s < SLOTS; s++) freeslots.push_back(s);
        std::deque<int> cq; Stat adv, pf; Helper H; H.L = &L; H.use = &use; H.pending = &pending;
        Workers Wk; Wk.L = &L; Wk.use = &use;
        bool wk = c.mode == RM_WORKERS || c.mode == MIG_WORKERS;
        if (wk) Wk.start(c.workers, c.split);
        if (c.mode == RM_THREAD || c.mode == RM_WORKERS) H.t = std::thread(&Helper::run, &H);
        long tick = 0; int nres = 0; std::vector<double> pass;
        auto poll = [&] {
            if (c.mode != RM_MAIN && c.mode != RM_UNSET_ONLY && c.mode != RM_BATCH) return;
            while (!cq.empty() && cudaEventQuery(use[cq.front()]) == cudaSuccess) {
                int v = cq.front(); cq.pop_front(); double t0 = now();
                CK(cudaMemAdvise(L[v], LB, cudaMemAdviseUnsetReadMostly, DEV));
                if (c.mode != RM_UNSET_ONLY) CK(cudaMemAdvise(L[v], LB, cudaMemAdviseSetReadMostly, DEV)); else rmset[v] = 0;
                adv.add(now() - t0); pending[v] = 0;
            }
        };
        auto evict_one = [&](int cur) {
            int v = -1;
            for (int l = 0; l < N; l++) if (res[l] && (l - cur + N) % N > c.depth && (v < 0 || last[l] < last[v])) v = l;
            if (v < 0) { fprintf(stderr, "no victim\n"); exit(1); }
            res[v] = 0; nres--;
            if (c.mode == PINNED) { freeslots.push_back(slot_of[v]); slot_prev[slot_of[v]] = v; slot_of[v] = -1; }
            else if (c.mode == MIGRATE) { CK(cudaStreamWaitEvent(d2h, use[v])); CK(cudaMemPrefetchAsync(L[v], LB, HOST, 0, d2h)); CK(cudaEventRecord(ready[v], d2h)); }
            else if (c.mode == MIG_WORKERS) { Wk.home[v] = 0; Wk.push(c.workers, {v, 0, true}); }
            else if (c.mode == RM_THREAD || c.mode == RM_WORKERS) { std::lock_guard<std::mutex> g(H.m); pending[v] = 1; H.q.push_back(v); H.cv.notify_one(); }
            else { pending[v] = 1; cq.push_back(v); }  // RM_MAIN, RM_UNSET_ONLY, RM_BATCH
        };
        auto make_res = [&](int l, int cur) {
            if (res[l]) return;
            while (nres >= SLOTS) evict_one(cur);
            if (c.mode == RM_THREAD || c.mode == RM_WORKERS) for (;;) { std::lock_guard<std::mutex> g(H.m); if (!pending[l]) break; }
            if (c.mode == RM_MAIN || c.mode == RM_UNSET_ONLY || c.mode == RM_BATCH) { while (pending[l]) { CK(cudaEventSynchronize(use[cq.front()])); poll(); } }
            if (c.mode == RM_UNSET_ONLY && !rmset[l]) { double t0 = now(); CK(cudaMemAdvise(L[l], LB, cudaMemAdviseSetReadMostly, DEV)); adv.add(now() - t0); rmset[l] = 1; }
            double t0 = now();
            if (c.mode == RM_BATCH) {
                std::vector<void *> ptrs(c.split); std::vector<size_t> sizes(c.split, LB / c.split); size_t idx0 = 0;
                for (int k = 0; k < c.split; k++) ptrs[k] = L[l] + k * (LB / c.split);
                CK(cudaMemPrefetchBatchAsync(ptrs.data(), sizes.data(), c.split, &DEV, &idx0, 1, 0, h2d[0]));
                CK(cudaEventRecord(ready[l], h2d[0]));
            } else if (wk) {
                for (int k = 0; k < c.split; k++) { Wk.issued[l * 8 + k] = 0; Wk.push((l * c.split + k) % c.workers, {l, k, false}); }
            } else if (c.mode == PINNED) {
                int s = freeslots.back(); freeslots.pop_back(); slot_of[l] = s;
                if (slot_prev[s] >= 0) CK(cudaStreamWaitEvent(h2d[0], use[slot_prev[s]]));  // its last reader
                CK(cudaMemcpyAsync(slot[s], pin + (size_t)l * LB, LB, cudaMemcpyHostToDevice, h2d[0]));
                CK(cudaEventRecord(ready[l], h2d[0]));
            } else {
                if (c.mode == MIGRATE) CK(cudaStreamWaitEvent(h2d[0], ready[l]));  // its migration home
                for (int k = 0; k < c.split; k++) {
                    if (k) CK(cudaStreamWaitEvent(h2d[k], ready[l]));
                    CK(cudaMemPrefetchAsync(L[l] + k * (LB / c.split), LB / c.split, DEV, 0, h2d[k]));
                }
                for (int k = 1; k < c.split; k++) { cudaEvent_t e; CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); CK(cudaEventRecord(e, h2d[k])); CK(cudaStreamWaitEvent(h2d[0], e)); CK(cudaEventDestroy(e)); }
                CK(cudaEventRecord(ready[l], h2d[0]));
            }
            pf.add(now() - t0);
            res[l] = 1; nres++;
        };
        for (int p = 0; p < PASSES; p++) {
            double t0 = now();
            for (int l = 0; l < N; l++) {
                poll();
                for (int d = 0; d <= c.depth; d++) make_res((l + d) % N, l);
                if (wk) for (int k = 0; k < c.split; k++) { while (!Wk.issued[l * 8 + k]) std::this_thread::yield(); CK(cudaStreamWaitEvent(comp, Wk.ready[l][k])); }
                else CK(cudaStreamWaitEvent(comp, ready[l]));
                const char *src = c.mode == PINNED ? slot[slot_of[l]] : L[l];
                readk<<<264, 512, 0, comp>>>((const uint4*)src, LB / 16, out);
                CK(cudaGetLastError());
                CK(cudaEventRecord(use[l], comp));
                last[l] = tick++;
            }
            CK(cudaStreamSynchronize(comp));
            pass.push_back(now() - t0);
        }
        if (c.mode == RM_THREAD || c.mode == RM_WORKERS) { { std::lock_guard<std::mutex> g(H.m); H.stop = true; } H.cv.notify_one(); H.t.join(); adv = H.adv; }
        if (wk) { Wk.finish(); pf = Wk.pf; }
        CK(cudaDeviceSynchronize());
        size_t fr, tot; CK(cudaMemGetInfo(&fr, &tot));
        std::vector<double> s(pass.begin() + 1, pass.end()); std::sort(s.begin(), s.end());
        double med = s[s.size() / 2], bound = N * LB / (link * 1e6);  // every access misses: 32 layers a pass
        printf("%2zu %-58s %7.2f ms/pass (min %.2f max %.2f) vs link %.3f | advise %.2f ms avg %.2f max (%ld) | prefetch call %.2f avg %.2f max | free %.1f GiB\n",
               ci, c.name, med, s.front(), s.back(), bound / med, adv.n ? adv.sum / adv.n : 0, adv.mx, adv.n, pf.n ? pf.sum / pf.n : 0, pf.mx, fr / 1073741824.0);
        fflush(stdout);
        for (int l = 0; l < N; l++) { CK(cudaEventDestroy(ready[l])); CK(cudaEventDestroy(use[l])); }
    }
    return 0;
}
