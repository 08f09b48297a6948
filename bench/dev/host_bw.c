/* The host memory's bandwidth as an optimizer step sees it: four fp32 arrays of N elements
 * (parameter, gradient, two moments), each thread a contiguous share first-touched by that
 * thread, and four kernels over them: a read (one array summed), a copy (one read, one written),
 * a triad (two read, one written) and an update shaped as AdamW's (four read, three written, a
 * few flops an element). GB/s counts the bytes the kernel must read and write (28 an element for
 * the update, as the C AdamW's table counts them), median of the repetitions.
 *
 *   cc -O3 -march=native -fno-math-errno -pthread -o /tmp/host_bw bench/dev/host_bw.c -lm
 *   /tmp/host_bw [threads] [million elements] [repetitions]
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static float *P, *G, *M, *V;
static size_t N;
static int T;
static pthread_barrier_t bar;
static int kernel;
static double sink[256];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void run(int id, size_t lo, size_t hi) {
    double s = 0;
    switch (kernel) {
    case 0: /* first touch */
        for (size_t i = lo; i < hi; i++) P[i] = G[i] = M[i] = V[i] = (float)(i & 1023) * 1e-3f;
        break;
    case 1: { /* read: sixteen partial sums, so that the loop vectorizes without reassociation */
        float part[16] = {0};
        size_t i = lo;
        for (; i + 16 <= hi; i += 16)
            for (int j = 0; j < 16; j++) part[j] += P[i + j];
        for (int j = 0; j < 16; j++) s += part[j];
        break;
    }
    case 2: /* copy */
        for (size_t i = lo; i < hi; i++) M[i] = G[i];
        break;
    case 3: /* triad */
        for (size_t i = lo; i < hi; i++) M[i] = G[i] + 0.5f * V[i];
        break;
    case 4: /* AdamW-shaped: p, g, m, v read; p, m, v written */
        for (size_t i = lo; i < hi; i++) {
            float g = G[i], m = 0.9f * M[i] + 0.1f * g, v = 0.999f * V[i] + 0.001f * g * g;
            M[i] = m;
            V[i] = v;
            P[i] = P[i] * 0.9999f - 1e-3f * m / (sqrtf(v) + 1e-8f);
        }
        break;
    }
    sink[id] += s;
}

static void *worker(void *arg) {
    int id = (int)(size_t)arg;
    size_t lo = N * (size_t)id / (size_t)T, hi = N * (size_t)(id + 1) / (size_t)T;
    for (;;) {
        pthread_barrier_wait(&bar);
        if (kernel < 0) return NULL;
        run(id, lo, hi);
        pthread_barrier_wait(&bar);
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    T = argc > 1 ? atoi(argv[1]) : 16;
    N = (size_t)(argc > 2 ? atof(argv[2]) : 256) * 1000000;
    int reps = argc > 3 ? atoi(argv[3]) : 7;
    if (T < 1 || T > 256 || reps < 1 || reps > 100) return 2;
    float **arr[4] = {&P, &G, &M, &V};
    for (int a = 0; a < 4; a++)
        if (!(*arr[a] = aligned_alloc(4096, (N * sizeof(float) + 4095) / 4096 * 4096))) return 1;
    pthread_barrier_init(&bar, NULL, (unsigned)T + 1);
    pthread_t th[256];
    for (int i = 0; i < T; i++) pthread_create(&th[i], NULL, worker, (void *)(size_t)i);
    const char *names[] = {"first touch", "read", "copy", "triad", "adamw-shaped"};
    const double bytes[] = {16, 4, 8, 12, 28};
    printf("%d threads, %zu elements an array (%.2f GiB each)\n", T, N, (double)N * 4 / (1 << 30));
    for (kernel = 0; kernel <= 4; kernel++) {
        double t[100];
        int n = kernel ? reps : 1;
        for (int r = 0; r < n; r++) {
            double t0 = now();
            pthread_barrier_wait(&bar);
            pthread_barrier_wait(&bar);
            t[r] = now() - t0;
        }
        qsort(t, (size_t)n, sizeof t[0], cmp);
        double med = t[n / 2];
        printf("%-13s %8.2f ms  %7.1f GB/s\n", names[kernel], med * 1e3, bytes[kernel] * (double)N / med / 1e9);
    }
    kernel = -1;
    pthread_barrier_wait(&bar);
    for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
    double s = 0;
    for (int i = 0; i < T; i++) s += sink[i];
    return s == 12345.0; /* keeps the read kernel's sum live */
}
