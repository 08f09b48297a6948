/*
 * spillway bench stream: stream N bf16 weight layers held as spillway buffers through a chain of
 * matrix products, as an offloaded inference pass does, and compare with the link and with the
 * same chain on all-resident weights, measured in the same run.
 *
 * Workload: layer l is a K x K bf16 matrix W_l (row-major), K = floor(sqrt(layer bytes / 2)) down
 * to a multiple of 8 (128 MiB: K = 8192 exactly). A pass takes the input X0 (batch x K bf16) and
 * computes X_{l+1} = X_l W_l for every layer, ping-ponging two activation buffers allocated with
 * spw_malloc. Per layer: spw_prefetch of the next --prefetch layers (wrapping into the next pass),
 * spw_acquire(READ) of W_l, the product, spw_release. spw_step_begin/end wrap each pass. On cuda
 * the product is cublasGemmEx (CUDA_R_16BF in and out, CUBLAS_COMPUTE_32F); on emu it is a host
 * callback (spw_launch_host) with fp32 accumulation, the same arithmetic as the host reference.
 *
 * Data: weights uniform in +-sqrt(3/K) (variance 1/K: activations keep their scale through any
 * number of layers, no overflow or underflow), input uniform in +-1; one deterministic generator
 * per layer (--seed). The weights live in one host array; each layer is registered as the host
 * copy of its read-only buffer (spw_buf_register_host, no copy) for explicit residency, or copied
 * into a buffer (spw_buf_create + spw_buf_write) for managed residency.
 *
 * Validation before timing is trusted: the reference is the same chain on all-resident weights
 * (cuda: cudaMalloc'd weights, the same cuBLAS calls: bitwise equality expected; emu: the host
 * function). The first and last pass outputs of every spillway run are compared with it; a
 * bitwise difference within 1% of the largest reference value is reported as "within tolerance",
 * anything more as wrong (exit status 1). A reference that is all zeros or not finite is refused.
 *
 * Figures (cuda): the pinned H2D link rate (1 GiB cudaMemcpyAsync, best of 3); all-resident ms per
 * pass; spillway ms per pass (cudaEvents at pass boundaries on the compute stream, passes run
 * back to back; median over passes after the first); bytes moved per pass (spw_stats bytes_h2d
 * + bytes_d2h deltas, mean over passes after the first); link bound = bytes moved / link rate;
 * ratio_to_link_bound = link_bound_ms / pass_ms (1.0: at the speed of the link); overlap bound =
 * max(all-resident ms, link bound ms) and its ratio. On emu the times are host times and no
 * link bound exists (reported null): emu checks correctness and bytes, not speed.
 *
 * Exit status: 0 done and correct, 1 a failure or a wrong result, 2 bad usage.
 */
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "internal.h"

#ifdef SPW_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#endif

#define MAX_POLICIES 4

typedef struct bs_opts {
    long layers, batch, passes, prefetch;
    double layer_mib;
    const char *budget, *residency, *trace, *backend;
    const char *policies[MAX_POLICIES];
    int npolicies;
    unsigned long long seed;
    bool json, summary;
} bs_opts;

typedef struct bs_run { /* one spillway run (one policy) */
    const char *policy;
    double *pass_ms;            /* per pass */
    uint64_t *pass_h2d, *pass_d2h;
    double pass_ms_median, bytes_per_pass;
    bool completed;             /* every pass ran and the outputs were read back */
    bool ok, bitwise;           /* ok: completed and correct */
    long prefetch;              /* prefetch depth used (see effective_prefetch) */
    double max_diff;
    bool host_registered;       /* weights registered (no copy) rather than copied in */
    int64_t evictions, stalls, prefetch_hits;
} bs_run;

typedef struct bench {
    bs_opts o;
    bool gpu;
    size_t K, layer_bytes, stride, act_bytes;
    uint64_t model_bytes;
    uint16_t *weights;          /* layers * stride bytes */
    uint16_t *x0, *ref, *out;   /* batch x K each */
    size_t budget;              /* as the context resolved it */
    double link_gbps;           /* < 0: not measured */
    double all_resident_ms;     /* < 0: not measured */
    const char *ref_how;
    bs_run runs[MAX_POLICIES];
#ifdef SPW_HAVE_CUDA
    cublasHandle_t blas;
#endif
} bench;

static void usage(FILE *f) {
    fprintf(f,
            "usage: spillway bench stream [--layers N] [--layer-mib M] [--batch B] [--budget SIZE]\n"
            "       [--residency explicit|managed] [--policy lru|plan[,..]] [--passes P]\n"
            "       [--prefetch D] [--seed S] [--trace FILE] [--backend auto|cuda|emu] [--json]\n"
            "       [--summary]\n\n"
            "Streams N bf16 layers of M MiB (K x K, K = sqrt(M MiB / 2)) through a chain of matrix\n"
            "products X <- X W_l, weights held as spillway buffers under a device budget; checks the\n"
            "result against the same chain on all-resident weights; reports ms per pass, bytes\n"
            "moved, GB/s and the ratio to the link bound (bytes moved / pinned H2D rate measured\n"
            "in the same run) and to the all-resident time.\n\n"
            "Defaults on cuda: --layers 32 --layer-mib 128 --batch 16 --passes 10 (the issue's\n"
            "acceptance run: add --budget 2GiB); on emu (no GPU): --layers 8 --layer-mib 2\n"
            "--batch 16 --passes 4, a host stand-in for the product. --budget defaults to half\n"
            "the model plus the activations (rounded up to 2 MiB).\n"
            "  --policy P     one policy, or a comma list (lru,plan) run one after the other with\n"
            "                 the same data, link rate and reference\n"
            "  --prefetch D   spw_prefetch the next D layers before each product (default 2;\n"
            "                 capped below half the layers that fit in the budget)\n"
            "  --trace FILE   the engine's Chrome trace (with several policies: FILE.<policy>)\n"
            "  --summary      print the memory summary (spw_summary) after the last run\n"
            "Options from SPILLWAY_CONF are applied first; flags override them.\n");
}

static bool parse_long(const char *flag, const char *v, long lo, long hi, long *out) {
    char *end;
    long x = strtol(v ? v : "", &end, 10);
    if (!v || !*v || *end || x < lo || x > hi) {
        if (v) fprintf(stderr, "spillway bench stream: bad %s '%s' (%ld..%ld)\n", flag, v, lo, hi);
        return false;
    }
    *out = x;
    return true;
}

static bool split_policies(bs_opts *o, char *list) {
    o->npolicies = 0;
    for (char *save = NULL, *p = strtok_r(list, ",", &save); p; p = strtok_r(NULL, ",", &save)) {
        if (strcmp(p, "lru") && strcmp(p, "plan")) {
            fprintf(stderr, "spillway bench stream: bad --policy '%s' (lru or plan)\n", p);
            return false;
        }
        if (o->npolicies == MAX_POLICIES) {
            fprintf(stderr, "spillway bench stream: at most %d policies\n", MAX_POLICIES);
            return false;
        }
        o->policies[o->npolicies++] = p;
    }
    if (!o->npolicies) fprintf(stderr, "spillway bench stream: empty --policy\n");
    return o->npolicies > 0;
}

/* Returns -1 to go on, else the exit status. Unset numbers stay 0 (defaults come later). */
static int parse_args(int argc, char **argv, bs_opts *o) {
    o->prefetch = 2;
    o->seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            o->json = true;
        } else if (!strcmp(a, "--summary")) {
            o->summary = true;
        } else if (spw_cli_is_flag(a, "--layers")) {
            if (!parse_long("--layers", spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--layers"), 1, 100000, &o->layers)) return 2;
        } else if (spw_cli_is_flag(a, "--batch")) {
            if (!parse_long("--batch", spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--batch"), 1, 1 << 20, &o->batch)) return 2;
        } else if (spw_cli_is_flag(a, "--passes")) {
            if (!parse_long("--passes", spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--passes"), 1, 100000, &o->passes)) return 2;
        } else if (spw_cli_is_flag(a, "--prefetch")) {
            if (!parse_long("--prefetch", spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--prefetch"), 0, 1024, &o->prefetch)) return 2;
        } else if (spw_cli_is_flag(a, "--seed")) {
            long s;
            if (!parse_long("--seed", spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--seed"), 0, 0x7fffffffL, &s)) return 2;
            o->seed = (unsigned long long)s;
        } else if (spw_cli_is_flag(a, "--layer-mib")) {
            if (!(v = spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--layer-mib"))) return 2;
            char *end;
            o->layer_mib = strtod(v, &end);
            if (!*v || *end || !(o->layer_mib >= 0.001 && o->layer_mib <= 65536)) {
                fprintf(stderr, "spillway bench stream: bad --layer-mib '%s' (0.001..65536)\n", v);
                return 2;
            }
        } else if (spw_cli_is_flag(a, "--budget")) {
            if (!(o->budget = spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--budget"))) return 2;
        } else if (spw_cli_is_flag(a, "--residency")) {
            if (!(o->residency = spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--residency"))) return 2;
            if (strcmp(o->residency, "explicit") && strcmp(o->residency, "managed")) {
                fprintf(stderr, "spillway bench stream: bad --residency '%s' (explicit or managed)\n",
                        o->residency);
                return 2;
            }
        } else if (spw_cli_is_flag(a, "--policy")) {
            if (!(v = spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--policy")) || !split_policies(o, (char *)v)) return 2;
        } else if (spw_cli_is_flag(a, "--trace")) {
            if (!(o->trace = spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--trace"))) return 2;
        } else if (spw_cli_is_flag(a, "--backend")) {
            if (!(o->backend = spw_cli_flag_value("spillway bench stream", argc, argv, &i, "--backend"))) return 2;
            if (strcmp(o->backend, "auto") && strcmp(o->backend, "cuda") && strcmp(o->backend, "emu")) {
                fprintf(stderr, "spillway bench stream: bad --backend '%s' (auto, cuda or emu)\n", o->backend);
                return 2;
            }
        } else {
            fprintf(stderr, "spillway bench stream: unknown argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    return -1;
}

/* ---- data ---- */

static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even (the values here are finite). */
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* n values uniform in +-scale from stream `seed`. */
static void fill_uniform(uint16_t *p, size_t n, uint64_t seed, float scale) {
    uint64_t s = seed;
    for (size_t i = 0; i < n; i += 2) {
        uint64_t r = splitmix(&s);
        p[i] = f2bf(((float)(r & 0xffffff) * 0x1p-23f - 1.0f) * scale);
        if (i + 1 < n) p[i + 1] = f2bf(((float)((r >> 32) & 0xffffff) * 0x1p-23f - 1.0f) * scale);
    }
}

typedef struct gen_job {
    bench *B;
    long first, step;
} gen_job;

static void *gen_layers(void *arg) {
    gen_job *j = arg;
    bench *B = j->B;
    float scale = sqrtf(3.0f / (float)B->K);
    for (long l = j->first; l < B->o.layers; l += j->step)
        fill_uniform((uint16_t *)((char *)B->weights + (size_t)l * B->stride), B->K * B->K,
                     B->o.seed * 1000003ull + (uint64_t)l + 1, scale);
    return NULL;
}

/* Generate every layer, in parallel (4 GiB of weights take seconds on one core). */
static void generate(bench *B) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    n = n < 1 ? 1 : n > 32 ? 32 : n;
    pthread_t th[32];
    gen_job jobs[32];
    long started = 0;
    for (long t = 0; t < n; t++) {
        jobs[t] = (gen_job){B, t, n};
        if (pthread_create(&th[t], NULL, gen_layers, &jobs[t]) != 0) break;
        started++;
    }
    if (started < n) { /* could not start them all: the rest on this thread */
        for (long t = started; t < n; t++) gen_layers(&jobs[t]);
    }
    for (long t = 0; t < started; t++) pthread_join(th[t], NULL);
    fill_uniform(B->x0, (size_t)B->o.batch * B->K, B->o.seed * 7919ull, 1.0f);
}

/* Y = X W on the host, fp32 accumulation in order of i: the emu product and the emu reference. */
typedef struct host_gemm {
    const uint16_t *x, *w;
    uint16_t *y;
    size_t batch, K;
    float *acc; /* K floats of scratch */
} host_gemm;

static void host_gemm_run(void *arg) {
    const host_gemm *g = arg;
    for (size_t b = 0; b < g->batch; b++) {
        memset(g->acc, 0, g->K * sizeof *g->acc);
        for (size_t i = 0; i < g->K; i++) {
            float xi = bf2f(g->x[b * g->K + i]);
            const uint16_t *wr = g->w + i * g->K;
            for (size_t j = 0; j < g->K; j++) g->acc[j] += xi * bf2f(wr[j]);
        }
        for (size_t j = 0; j < g->K; j++) g->y[b * g->K + j] = f2bf(g->acc[j]);
    }
}

typedef struct host_copy {
    void *dst;
    const void *src;
    size_t bytes;
} host_copy;

static void host_copy_run(void *arg) {
    const host_copy *c = arg;
    memcpy(c->dst, c->src, c->bytes);
}

/* Compare `out` with the reference: 0 equal or within tolerance, 1 wrong. */
static int compare(bench *B, const uint16_t *out, const char *what, bs_run *r) {
    size_t n = (size_t)B->o.batch * B->K, bad = 0;
    double maxref = 0, maxdiff = 0;
    for (size_t i = 0; i < n; i++) maxref = fmax(maxref, fabs(bf2f(B->ref[i])));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)bf2f(out[i]) - (double)bf2f(B->ref[i]));
        if (!(d <= maxdiff)) maxdiff = d; /* NaN counts as a difference */
        if (out[i] != B->ref[i]) bad++;
    }
    if (maxdiff > r->max_diff || isnan(maxdiff)) r->max_diff = maxdiff;
    if (bad) r->bitwise = false;
    if (bad && !(maxdiff <= 0.01 * maxref)) {
        fprintf(stderr, "spillway bench stream: WRONG RESULT (%s, policy %s): %zu of %zu values "
                        "differ from the all-resident reference, max difference %g (reference max %g)\n",
                what, r->policy, bad, n, maxdiff, maxref);
        return 1;
    }
    if (bad && !B->o.json)
        fprintf(stderr, "spillway bench stream: %s: %zu values differ in the last bits (max %g, "
                        "within 1%% of %g): within tolerance, not bitwise equal\n", what, bad,
                maxdiff, maxref);
    return 0;
}

/* Refuse a degenerate reference: it would validate nothing. */
static int check_reference(const bench *B) {
    size_t n = (size_t)B->o.batch * B->K, nonzero = 0;
    for (size_t i = 0; i < n; i++) {
        float v = bf2f(B->ref[i]);
        if (!isfinite(v)) {
            fprintf(stderr, "spillway bench stream: the reference output is not finite (%g at %zu)\n", v, i);
            return 1;
        }
        nonzero += v != 0.0f;
    }
    if (nonzero < n / 2) {
        fprintf(stderr, "spillway bench stream: the reference output is degenerate (%zu of %zu "
                        "values nonzero)\n", nonzero, n);
        return 1;
    }
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[from..n) (v[0..n) if from >= n). */
static double median_from(const double *v, size_t n, size_t from) {
    if (from >= n) from = 0;
    size_t m = n - from;
    double *c = malloc(m * sizeof *c);
    if (!c) return v[n - 1];
    memcpy(c, v + from, m * sizeof *c);
    qsort(c, m, sizeof *c, cmp_double);
    double r = m % 2 ? c[m / 2] : 0.5 * (c[m / 2 - 1] + c[m / 2]);
    free(c);
    return r;
}


/* ---- cuda: link rate, all-resident reference, products ---- */

#ifdef SPW_HAVE_CUDA
static void cuda_fail(const char *call, cudaError_t e, int line) {
    fprintf(stderr, "spillway bench stream: %s failed (cmd_bench_stream.c:%d): %s: %s\n", call,
            line, cudaGetErrorName(e), cudaGetErrorString(e));
}
static void blas_fail(const char *call, cublasStatus_t s, int line) {
    fprintf(stderr, "spillway bench stream: %s failed (cmd_bench_stream.c:%d): %s: %s\n", call,
            line, cublasGetStatusName(s), cublasGetStatusString(s));
}
#define CK(call)                                                                               \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            cuda_fail(#call, e_, __LINE__);                                                    \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)
#define BK(call)                                                                               \
    do {                                                                                       \
        cublasStatus_t s_ = (call);                                                            \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                     \
            blas_fail(#call, s_, __LINE__);                                                    \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

/* Y = X W (row-major X: batch x K, W: K x K) on stream s: in cuBLAS's column-major terms
 * Y^T = W^T X^T, which is W read with lda K times X read with ldb K. */
static int gpu_gemm(bench *B, const void *x, const void *w, void *y, cudaStream_t s) {
    const float alpha = 1.0f, beta = 0.0f;
    int K = (int)B->K, n = (int)B->o.batch;
    BK(cublasSetStream(B->blas, s));
    BK(cublasGemmEx(B->blas, CUBLAS_OP_N, CUBLAS_OP_N, K, n, K, &alpha, w, CUDA_R_16BF, K, x,
                    CUDA_R_16BF, K, &beta, y, CUDA_R_16BF, K, CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT));
    return 0;
fail:
    return 1;
}

/* Pinned host -> device rate, 1 GiB, best of 3 (after one warm-up copy). Not fatal: a failure
 * leaves link_gbps < 0 and says so. */
static void gpu_link_rate(bench *B) {
    const size_t bytes = SPW_GiB;
    void *h = NULL, *d = NULL;
    cudaStream_t s = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float best = 0;
    CK(cudaHostAlloc(&h, bytes, cudaHostAllocDefault));
    CK(cudaMalloc(&d, bytes));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    memset(h, 0x5a, bytes);
    CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s));
    for (int i = 0; i < 3; i++) {
        float ms;
        CK(cudaEventRecord(e0, s));
        CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (best == 0 || ms < best) best = ms;
    }
    B->link_gbps = (double)bytes / ((double)best * 1e6);
fail:
    if (B->link_gbps < 0)
        fprintf(stderr, "spillway bench stream: could not measure the link rate: no link bound\n");
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (s) cudaStreamDestroy(s);
    cudaFree(d);
    cudaFreeHost(h);
}

/* The reference: the same chain on weights in plain cudaMalloc memory, timed over the same
 * number of passes. When the model does not fit in free device memory, the layers are staged one
 * at a time through one buffer: the same products (same result), but no all-resident time. */
static int gpu_reference(bench *B) {
    size_t free_b = 0, total_b = 0, ab = B->act_bytes;
    long N = B->o.layers, P = B->o.passes;
    char *w = NULL, *act = NULL;
    cudaStream_t s = NULL;
    cudaEvent_t *ev = calloc((size_t)P + 1, sizeof *ev);
    double *ms = calloc((size_t)P, sizeof *ms);
    int rc = 1;
    if (!ev || !ms) goto fail;
    CK(cudaMemGetInfo(&free_b, &total_b));
    bool resident = B->model_bytes + 3 * ab + 512 * SPW_MiB <= free_b;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc((void **)&act, 3 * ab));
    CK(cudaMalloc((void **)&w, resident ? B->model_bytes : B->layer_bytes));
    CK(cudaMemcpy(act + 2 * ab, B->x0, ab, cudaMemcpyHostToDevice));
    if (!resident) {
        B->ref_how = "cuBLAS, layers staged one at a time (the model does not fit all-resident)";
        CK(cudaMemcpyAsync(act, act + 2 * ab, ab, cudaMemcpyDeviceToDevice, s));
        for (long l = 0; l < N; l++) {
            CK(cudaMemcpyAsync(w, (char *)B->weights + (size_t)l * B->stride, B->layer_bytes,
                               cudaMemcpyHostToDevice, s));
            if (gpu_gemm(B, act + (size_t)(l % 2) * ab, w, act + (size_t)((l + 1) % 2) * ab, s)) goto fail;
            CK(cudaStreamSynchronize(s));
        }
    } else {
        B->ref_how = "cuBLAS on all-resident weights (cudaMalloc)";
        for (long l = 0; l < N; l++)
            CK(cudaMemcpy(w + (size_t)l * B->layer_bytes, (char *)B->weights + (size_t)l * B->stride,
                          B->layer_bytes, cudaMemcpyHostToDevice));
        for (long p = 0; p <= P; p++) CK(cudaEventCreate(&ev[p]));
        CK(cudaEventRecord(ev[0], s));
        for (long p = 0; p < P; p++) {
            CK(cudaMemcpyAsync(act, act + 2 * ab, ab, cudaMemcpyDeviceToDevice, s));
            for (long l = 0; l < N; l++)
                if (gpu_gemm(B, act + (size_t)(l % 2) * ab, w + (size_t)l * B->layer_bytes,
                             act + (size_t)((l + 1) % 2) * ab, s)) goto fail;
            CK(cudaEventRecord(ev[p + 1], s));
        }
        CK(cudaStreamSynchronize(s));
        for (long p = 0; p < P; p++) {
            float m;
            CK(cudaEventElapsedTime(&m, ev[p], ev[p + 1]));
            ms[p] = m;
        }
        B->all_resident_ms = median_from(ms, (size_t)P, 1);
    }
    CK(cudaMemcpy(B->ref, act + (size_t)(N % 2) * ab, ab, cudaMemcpyDeviceToHost));
    rc = 0;
fail:
    for (long p = 0; ev && p <= P; p++)
        if (ev[p]) cudaEventDestroy(ev[p]);
    if (s) cudaStreamDestroy(s);
    cudaFree(w);
    cudaFree(act);
    free(ev);
    free(ms);
    return rc;
}
#endif

/* The emu reference: the host function, layer after layer. */
static int host_reference(bench *B) {
    size_t n = (size_t)B->o.batch * B->K;
    uint16_t *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    float *acc = malloc(B->K * sizeof *acc);
    if (!a || !b || !acc) {
        free(a);
        free(b);
        free(acc);
        fprintf(stderr, "spillway bench stream: out of host memory for the reference\n");
        return 1;
    }
    memcpy(a, B->x0, n * sizeof *a);
    for (long l = 0; l < B->o.layers; l++) {
        host_gemm g = {a, (const uint16_t *)((char *)B->weights + (size_t)l * B->stride), b,
                       (size_t)B->o.batch, B->K, acc};
        host_gemm_run(&g);
        uint16_t *t = a;
        a = b;
        b = t;
    }
    memcpy(B->ref, a, n * sizeof *a);
    B->ref_how = "host product (fp32 accumulation), the same function as the emu stand-in";
    free(a);
    free(b);
    free(acc);
    return 0;
}

/* ---- one spillway run ---- */

typedef struct run_state {
    spw_ctx *ctx;
    spw_stream s;
    spw_buf **w;
    char *x0d, *act[2], *first_out; /* device (emu: host addresses, as backend.h promises) */
    host_gemm *hg;                  /* emu: one argument per (pass, layer) */
    host_copy *hc;                  /* emu: two per pass */
    float *acc;
#ifdef SPW_HAVE_CUDA
    cudaEvent_t *ev;
#endif
} run_state;

/* Half the model, plus room for the activations (the small-request arena maps 2 MiB pages). */
static uint64_t default_budget(const bench *B) {
    return B->model_bytes / 2 + SPW_ALIGN_UP(4 * B->act_bytes, 2 * SPW_MiB);
}

/* Under LRU a layer prefetched d products ahead ages from its prefetch, so it outlives the layers
 * released since only if fewer than half the slots are prefetched: with `slots` layers fitting
 * beside the activations, a depth d with 2d >= slots makes each prefetch evict a layer
 * prefetched earlier, before its use, and every layer crosses the link twice. So the depth is
 * capped at (slots - 1) / 2 (15 slots at 2 GiB of 128 MiB layers: 7). */
static long effective_prefetch(const bench *B) {
    uint64_t acts = SPW_ALIGN_UP(4 * B->act_bytes, 2 * SPW_MiB);
    uint64_t slots = B->budget > acts ? (B->budget - acts) / B->layer_bytes : 0;
    long cap = slots >= 1 ? (long)((slots - 1) / 2) : 0;
    return B->o.prefetch < cap ? B->o.prefetch : cap;
}

static int make_ctx(bench *B, const char *policy, spw_ctx **out) {
    spw_config *cfg = NULL;
    spw_status st;
    char trace[4096], budget[32];
    int rc = 2;
    if ((st = spw_config_create(&cfg)) || (st = spw_config_from_env(cfg))) {
        spw_cli_fail("bad configuration (SPILLWAY_CONF)", st);
        goto out;
    }
    if (B->o.budget) snprintf(budget, sizeof budget, "%s", B->o.budget);
    else snprintf(budget, sizeof budget, "%llu", (unsigned long long)default_budget(B));
    if ((st = spw_config_set(cfg, "backend", B->gpu ? "cuda" : "emu")) ||
        (st = spw_config_set(cfg, "budget", budget)) ||
        (st = spw_config_set(cfg, "policy", policy)) ||
        (B->o.residency && (st = spw_config_set(cfg, "residency", B->o.residency)))) {
        spw_cli_fail("bad option", st);
        goto out;
    }
    if (B->o.trace) {
        if (B->o.npolicies > 1) snprintf(trace, sizeof trace, "%s.%s", B->o.trace, policy);
        else snprintf(trace, sizeof trace, "%s", B->o.trace);
        if ((st = spw_config_set(cfg, "trace", trace))) {
            spw_cli_fail("bad --trace", st);
            goto out;
        }
    }
    rc = 1;
    if ((st = spw_ctx_create(cfg, out))) {
        spw_cli_fail("cannot create the context", st);
        goto out;
    }
    B->budget = spw_ctx_budget(*out);
    rc = 0;
out:
    spw_config_destroy(cfg);
    return rc;
}

/* The weights as read-only buffers: registered (no copy) where the residency allows, else
 * created and written. */
static int make_weights(bench *B, bs_run *r, run_state *S) {
    bool managed = B->o.residency && !strcmp(B->o.residency, "managed");
    r->host_registered = !managed;
    for (long l = 0; l < B->o.layers; l++) {
        void *h = (char *)B->weights + (size_t)l * B->stride;
        spw_status st = SPW_ERR_UNSUPPORTED;
        if (r->host_registered) {
            st = spw_buf_register_host(S->ctx, h, B->layer_bytes, SPW_BUF_READ_ONLY, &S->w[l]);
            if (st == SPW_ERR_UNSUPPORTED && l == 0) {
                fprintf(stderr, "spillway bench stream: host registration unsupported (%s): "
                                "copying the weights into buffers\n", spw_last_error());
                r->host_registered = false;
            } else if (st) {
                spw_cli_fail("spw_buf_register_host of a layer", st);
                return 1;
            }
        }
        if (!r->host_registered) {
            if ((st = spw_buf_create(S->ctx, B->layer_bytes, SPW_BUF_READ_ONLY, &S->w[l])) ||
                (st = spw_buf_write(S->w[l], 0, h, B->layer_bytes))) {
                spw_cli_fail("spw_buf_create/spw_buf_write of a layer", st);
                return 1;
            }
        }
    }
    return 0;
}

/* Enqueue dst <- src (activation-sized, device memory) on the run's stream. */
static int enqueue_copy(bench *B, run_state *S, host_copy *arg, void *dst, const void *src) {
#ifdef SPW_HAVE_CUDA
    if (B->gpu) {
        CK(cudaMemcpyAsync(dst, src, B->act_bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)S->s));
        return 0;
    fail:
        return 1;
    }
#endif
    *arg = (host_copy){dst, src, B->act_bytes};
    spw_status st = spw_launch_host(S->ctx, S->s, host_copy_run, arg);
    if (st) spw_cli_fail("spw_launch_host", st);
    return st != SPW_OK;
}

static int enqueue_gemm(bench *B, run_state *S, host_gemm *arg, const void *x, const void *w, void *y) {
#ifdef SPW_HAVE_CUDA
    if (B->gpu) return gpu_gemm(B, x, w, y, (cudaStream_t)S->s);
#endif
    *arg = (host_gemm){x, w, y, (size_t)B->o.batch, B->K, S->acc};
    spw_status st = spw_launch_host(S->ctx, S->s, host_gemm_run, arg);
    if (st) spw_cli_fail("spw_launch_host", st);
    return st != SPW_OK;
}

/* Copy an activation-sized device buffer to the host after the stream's work. */
static int read_back(bench *B, run_state *S, const void *src, uint16_t *dst) {
    spw_status st = spw_stream_synchronize(S->ctx, S->s);
    if (st) {
        spw_cli_fail("spw_stream_synchronize", st);
        return 1;
    }
#ifdef SPW_HAVE_CUDA
    if (B->gpu) {
        CK(cudaMemcpy(dst, src, B->act_bytes, cudaMemcpyDeviceToHost));
        return 0;
    fail:
        return 1;
    }
#endif
    memcpy(dst, src, B->act_bytes);
    return 0;
}

/* The passes: see the comment at the top. Timing marks come after spw_step_end. */
static int passes(bench *B, bs_run *r, run_state *S) {
    long N = B->o.layers, P = B->o.passes;
    spw_stats before, now;
    spw_status st = spw_stats_get(S->ctx, &before);
    now = before;
    uint64_t t_prev = spw__now_ns();
#ifdef SPW_HAVE_CUDA
    if (B->gpu) CK(cudaEventRecord(S->ev[0], (cudaStream_t)S->s));
#endif
    for (long p = 0; p < P && st == SPW_OK; p++) {
        if ((st = spw_step_begin(S->ctx))) break;
        if (enqueue_copy(B, S, &S->hc[2 * p], S->act[0], S->x0d)) return 1;
        for (long l = 0; l < N && st == SPW_OK; l++) {
            for (long d = 1; d <= r->prefetch && d < N && st == SPW_OK; d++)
                st = spw_prefetch(S->w[(l + d) % N], S->s);
            void *wp = NULL;
            if (st || (st = spw_acquire(S->w[l], S->s, SPW_ACCESS_READ, &wp))) break;
            if (enqueue_gemm(B, S, &S->hg[p * N + l], S->act[l % 2], wp, S->act[(l + 1) % 2]))
                return 1;
            st = spw_release(S->w[l], S->s);
        }
        if (st) break;
        if (p == 0 && enqueue_copy(B, S, &S->hc[2 * p + 1], S->first_out, S->act[N % 2])) return 1;
        if ((st = spw_step_end(S->ctx))) break;
#ifdef SPW_HAVE_CUDA
        /* The host waits for each pass, as a training loop that reads its loss every step
         * does: the same for every policy, and what lets policy=plan time its steps. */
        if (B->gpu) {
            CK(cudaEventRecord(S->ev[p + 1], (cudaStream_t)S->s));
            CK(cudaEventSynchronize(S->ev[p + 1]));
        }
#endif
        if (!B->gpu) { /* emu: host time of the pass, its work finished */
            if ((st = spw_stream_synchronize(S->ctx, S->s))) break;
            uint64_t t = spw__now_ns();
            r->pass_ms[p] = (double)(t - t_prev) / 1e6;
            t_prev = t;
        }
        if (p == P - 1 && (st = spw_stream_synchronize(S->ctx, S->s))) break;
        if ((st = spw_stats_get(S->ctx, &now))) break;
        r->pass_h2d[p] = (uint64_t)(now.bytes_h2d.total - before.bytes_h2d.total);
        r->pass_d2h[p] = (uint64_t)(now.bytes_d2h.total - before.bytes_d2h.total);
        before = now;
    }
    if (st) {
        spw_cli_fail("a pass failed", st);
        return 1;
    }
#ifdef SPW_HAVE_CUDA
    for (long p = 0; B->gpu && p < P; p++) {
        float ms;
        CK(cudaEventElapsedTime(&ms, S->ev[p], S->ev[p + 1]));
        r->pass_ms[p] = ms;
    }
#endif
    r->evictions = now.evictions_clean.total + now.evictions_dirty.total;
    r->stalls = now.stalls.total;
    r->prefetch_hits = now.prefetch_hits.total;
    return 0;
#ifdef SPW_HAVE_CUDA
fail:
    return 1;
#endif
}

static int run_policy(bench *B, bs_run *r, bool last) {
    long N = B->o.layers, P = B->o.passes;
    run_state S = {0};
    int rc = 1;
    spw_status st;
    r->bitwise = true;
    r->pass_ms = calloc((size_t)P, sizeof *r->pass_ms);
    r->pass_h2d = calloc((size_t)P, sizeof *r->pass_h2d);
    r->pass_d2h = calloc((size_t)P, sizeof *r->pass_d2h);
    S.w = calloc((size_t)N, sizeof *S.w);
    S.hg = calloc((size_t)(N * P), sizeof *S.hg);
    S.hc = calloc((size_t)(2 * P), sizeof *S.hc);
    S.acc = calloc(B->K, sizeof *S.acc);
    if (!r->pass_ms || !r->pass_h2d || !r->pass_d2h || !S.w || !S.hg || !S.hc || !S.acc) {
        fprintf(stderr, "spillway bench stream: out of host memory\n");
        goto out;
    }
#ifdef SPW_HAVE_CUDA
    if (B->gpu && !(S.ev = calloc((size_t)P + 1, sizeof *S.ev))) goto out;
    for (long p = 0; B->gpu && p <= P; p++) CK(cudaEventCreate(&S.ev[p]));
#endif
    if ((rc = make_ctx(B, r->policy, &S.ctx))) goto out;
    rc = 1;
    if ((st = spw_stream_create(S.ctx, &S.s))) {
        spw_cli_fail("spw_stream_create", st);
        goto out;
    }
    void *bufs[4] = {0};
    for (int i = 0; i < 4; i++)
        if ((st = spw_malloc(S.ctx, B->act_bytes, S.s, &bufs[i]))) {
            spw_cli_fail("spw_malloc of an activation buffer", st);
            goto out;
        }
    S.x0d = bufs[0], S.act[0] = bufs[1], S.act[1] = bufs[2], S.first_out = bufs[3];
    r->prefetch = effective_prefetch(B);
    if (r->prefetch < B->o.prefetch && !B->o.json)
        fprintf(stderr, "spillway bench stream: prefetch depth %ld -> %ld: only that many layers "
                        "fit ahead in the budget\n", B->o.prefetch, r->prefetch);
    if (make_weights(B, r, &S)) goto out;
#ifdef SPW_HAVE_CUDA
    if (B->gpu) CK(cudaMemcpy(S.x0d, B->x0, B->act_bytes, cudaMemcpyHostToDevice));
#endif
    if (!B->gpu) memcpy(S.x0d, B->x0, B->act_bytes); /* nothing is enqueued on it yet */
    if (passes(B, r, &S)) goto out;
    char what[64];
    snprintf(what, sizeof what, "pass 1 of %ld", P);
    r->completed = true;
    if (read_back(B, &S, S.first_out, B->out) || compare(B, B->out, what, r)) goto out;
    snprintf(what, sizeof what, "pass %ld of %ld", P, P);
    if (read_back(B, &S, S.act[N % 2], B->out) || compare(B, B->out, what, r)) goto out;
    r->ok = true;
    r->pass_ms_median = median_from(r->pass_ms, (size_t)P, 1);
    double sum = 0;
    for (long p = P > 1 ? 1 : 0; p < P; p++) sum += (double)(r->pass_h2d[p] + r->pass_d2h[p]);
    r->bytes_per_pass = sum / (double)(P > 1 ? P - 1 : 1);
    if (last && B->o.summary) spw_summary(S.ctx, B->o.json ? stderr : stdout);
    rc = 0;
#ifdef SPW_HAVE_CUDA
fail:
#endif
out:
    for (long l = 0; S.w && l < N; l++)
        if (S.w[l] && (st = spw_buf_destroy(S.w[l]))) {
            spw_cli_fail("spw_buf_destroy", st);
            rc = 1;
        }
    void *acts[4] = {S.x0d, S.act[0], S.act[1], S.first_out};
    for (int i = 0; i < 4; i++)
        if (acts[i]) spw_free(S.ctx, acts[i], S.s);
    if (S.s) spw_stream_destroy(S.ctx, S.s);
    if (S.ctx && (st = spw_ctx_destroy(S.ctx))) {
        spw_cli_fail("spw_ctx_destroy", st);
        rc = 1;
    }
#ifdef SPW_HAVE_CUDA
    for (long p = 0; S.ev && p <= P; p++)
        if (S.ev[p]) cudaEventDestroy(S.ev[p]);
    free(S.ev);
#endif
    free(S.w);
    free(S.hg);
    free(S.hc);
    free(S.acc);
    return rc;
}

/* ---- report ---- */

typedef struct derived {
    double link_bound_ms, gbps, ratio_link, ratio_resident, overlap_ms, ratio_overlap, frac_model;
} derived;

/* Figures derived from a run; < 0 where they do not exist (no link rate, nothing moved, ...). */
static derived derive(const bench *B, const bs_run *r) {
    derived d = {-1, -1, -1, -1, -1, -1, -1};
    double ms = r->pass_ms_median;
    d.frac_model = r->bytes_per_pass / (double)B->model_bytes;
    if (ms > 0) d.gbps = r->bytes_per_pass / (ms * 1e6);
    if (B->link_gbps > 0) d.link_bound_ms = r->bytes_per_pass / (B->link_gbps * 1e6);
    if (d.link_bound_ms > 0 && ms > 0) d.ratio_link = d.link_bound_ms / ms;
    if (B->all_resident_ms > 0 && ms > 0) d.ratio_resident = B->all_resident_ms / ms;
    if (B->all_resident_ms > 0 && d.link_bound_ms >= 0) {
        d.overlap_ms = fmax(B->all_resident_ms, d.link_bound_ms);
        if (ms > 0) d.ratio_overlap = d.overlap_ms / ms;
    }
    return d;
}

static void jnum(const char *key, double v) {
    if (v < 0 || !isfinite(v)) printf(", \"%s\": null", key);
    else printf(", \"%s\": %.12g", key, v);
}

static const bs_run *find_run(const bench *B, const char *policy) {
    for (int i = 0; i < B->o.npolicies; i++)
        if (!strcmp(B->runs[i].policy, policy) && B->runs[i].ok) return &B->runs[i];
    return NULL;
}

static void print_json(const bench *B, size_t budget) {
    printf("{\"backend\": \"%s\", \"layers\": %ld, \"layer_mib\": %g, \"K\": %zu, \"layer_bytes\": %zu"
           ", \"model_bytes\": %llu, \"batch\": %ld, \"passes\": %ld, \"prefetch\": %ld"
           ", \"budget_bytes\": %zu, \"residency\": \"%s\", \"seed\": %llu",
           B->gpu ? "cuda" : "emu", B->o.layers, B->o.layer_mib, B->K, B->layer_bytes,
           (unsigned long long)B->model_bytes, B->o.batch, B->o.passes, B->o.prefetch, budget,
           B->o.residency ? B->o.residency : "default", B->o.seed);
    jnum("link_h2d_gbps", B->link_gbps);
    jnum("all_resident_ms", B->all_resident_ms);
    printf(", \"reference\": \"%s\", \"runs\": [", B->ref_how);
    for (int i = 0; i < B->o.npolicies; i++) {
        const bs_run *r = &B->runs[i];
        derived d = derive(B, r);
        printf("%s{\"policy\": \"%s\", \"completed\": %s, \"correct\": %s, \"bitwise_equal\": %s",
               i ? ", " : "", r->policy, r->completed ? "true" : "false", r->ok ? "true" : "false",
               r->ok && r->bitwise ? "true" : "false");
        if (!r->completed) { /* failed before the end: the figures would be meaningless */
            putchar('}');
            continue;
        }
        printf(", \"prefetch\": %ld", r->prefetch);
        jnum("max_abs_diff", r->max_diff);
        printf(", \"weights\": \"%s\"", r->host_registered ? "registered" : "copied");
        jnum("pass_ms", r->pass_ms_median);
        jnum("first_pass_ms", r->pass_ms ? r->pass_ms[0] : -1);
        jnum("bytes_per_pass", r->bytes_per_pass);
        jnum("moved_fraction_of_model", d.frac_model);
        jnum("gbps", d.gbps);
        jnum("link_bound_ms", d.link_bound_ms);
        jnum("ratio_to_link_bound", d.ratio_link);
        jnum("ratio_to_all_resident", d.ratio_resident);
        jnum("overlap_bound_ms", d.overlap_ms);
        jnum("ratio_to_overlap_bound", d.ratio_overlap);
        printf(", \"evictions\": %lld, \"stalls\": %lld, \"prefetch_hits\": %lld",
               (long long)r->evictions, (long long)r->stalls, (long long)r->prefetch_hits);
        const char *keys[3] = {"per_pass_ms", "per_pass_h2d", "per_pass_d2h"};
        for (int k = 0; k < 3; k++) {
            printf(", \"%s\": [", keys[k]);
            for (long p = 0; r->pass_ms && p < B->o.passes; p++) {
                if (k == 0) printf("%s%.4f", p ? ", " : "", r->pass_ms[p]);
                else printf("%s%llu", p ? ", " : "",
                            (unsigned long long)(k == 1 ? r->pass_h2d[p] : r->pass_d2h[p]));
            }
            putchar(']');
        }
        putchar('}');
    }
    putchar(']');
    const bs_run *lru = find_run(B, "lru"), *plan = find_run(B, "plan");
    if (lru && plan && plan->pass_ms_median > 0)
        printf(", \"speedup_plan_over_lru\": %.4f", lru->pass_ms_median / plan->pass_ms_median);
    printf("}\n");
}

static void print_human(const bench *B, size_t budget) {
    char b1[64], b2[64];
    printf("bench stream  backend %s, %ld layers of %s (K = %zu), model %s, batch %ld\n",
           B->gpu ? "cuda" : "emu (host stand-in for the product; times are not GPU times)",
           B->o.layers, spw__fmt_bytes(b1, sizeof b1, B->layer_bytes), B->K,
           spw__fmt_bytes(b2, sizeof b2, B->model_bytes), B->o.batch);
    printf("budget        %s, residency %s, %ld passes, prefetch up to %ld ahead\n",
           spw__fmt_bytes(b1, sizeof b1, budget), B->o.residency ? B->o.residency : "default",
           B->o.passes, B->runs[0].prefetch);
    if (B->link_gbps > 0) printf("link          %.1f GB/s pinned host to device (1 GiB, best of 3)\n", B->link_gbps);
    if (B->all_resident_ms > 0) printf("all-resident  %.3f ms per pass\n", B->all_resident_ms);
    printf("reference     %s\n\n", B->ref_how);
    printf("%-7s %10s %11s %9s %10s %9s %9s %11s %9s  %s\n", "policy", "ms/pass", "moved/pass",
           "of model", "GB/s", "link ms", "vs link", "vs resident", "vs max()", "result");
    for (int i = 0; i < B->o.npolicies; i++) {
        const bs_run *r = &B->runs[i];
        if (!r->completed) {
            printf("%-7s %10s  (failed before the end: see the messages above)\n", r->policy, "FAILED");
            continue;
        }
        derived d = derive(B, r);
        char c[5][32];
        double v[5] = {d.gbps, d.link_bound_ms, d.ratio_link, d.ratio_resident, d.ratio_overlap};
        for (int k = 0; k < 5; k++)
            if (v[k] < 0) snprintf(c[k], sizeof c[k], "n/a");
            else snprintf(c[k], sizeof c[k], k == 1 ? "%.2f" : k == 0 ? "%.1f" : "%.3f", v[k]);
        printf("%-7s %10.3f %9.1f MiB %8.1f%% %10s %9s %9s %11s %9s  %s\n", r->policy,
               r->pass_ms_median, r->bytes_per_pass / (double)SPW_MiB, 100 * d.frac_model, c[0],
               c[1], c[2], c[3], c[4],
               !r->ok ? "FAILED" : r->bitwise ? "correct (bitwise)" : "correct (tolerance)");
    }
    const bs_run *lru = find_run(B, "lru"), *plan = find_run(B, "plan");
    if (lru && plan && plan->pass_ms_median > 0)
        printf("\nplan is %.2fx faster than lru per pass\n", lru->pass_ms_median / plan->pass_ms_median);
    printf("\nms/pass: median over passes after the first; moved: h2d + d2h, mean after the first;\n"
           "vs link = link-bound ms / ms (1.0 = at the link's speed); vs resident = all-resident ms\n"
           "/ ms; vs max() = max(all-resident ms, link-bound ms) / ms.\n");
}

/* ---- entry ---- */

static int pick_backend(bench *B) {
    const char *want = B->o.backend ? B->o.backend : "auto";
    if (!strcmp(want, "emu")) return 0;
#ifdef SPW_HAVE_CUDA
    if (spw__backend_cuda_available()) {
        B->gpu = true;
        return 0;
    }
    if (!strcmp(want, "cuda")) {
        fprintf(stderr, "spillway bench stream: --backend cuda: no usable CUDA device\n");
        return 1;
    }
    fprintf(stderr, "spillway bench stream: no CUDA device: running the small emu version\n");
#else
    if (!strcmp(want, "cuda")) {
        fprintf(stderr, "spillway bench stream: --backend cuda: this build has no CUDA support\n");
        return 1;
    }
    fprintf(stderr, "spillway bench stream: built without CUDA: running the small emu version\n");
#endif
    return 0;
}

int spw_bench_stream(int argc, char **argv) {
    bench B = {.link_gbps = -1, .all_resident_ms = -1, .ref_how = "none"};
    char policy_default[] = "lru";
    int rc = parse_args(argc, argv, &B.o);
    if (rc >= 0) return rc;
    if (!B.o.npolicies) {
        B.o.policies[0] = policy_default;
        B.o.npolicies = 1;
    }
    if ((rc = pick_backend(&B))) return rc;
    if (!B.o.layers) B.o.layers = B.gpu ? 32 : 8;
    if (!B.o.layer_mib) B.o.layer_mib = B.gpu ? 128 : 2;
    if (!B.o.batch) B.o.batch = 16;
    if (!B.o.passes) B.o.passes = B.gpu ? 10 : 4;
    B.K = (size_t)floor(sqrt(B.o.layer_mib * (double)SPW_MiB / 2.0)) / 8 * 8;
    if (B.K < 8) {
        fprintf(stderr, "spillway bench stream: --layer-mib %g is too small (K < 8)\n", B.o.layer_mib);
        return 2;
    }
    B.layer_bytes = B.K * B.K * 2;
    B.stride = SPW_ALIGN_UP(B.layer_bytes, 2 * SPW_MiB); /* registrations never share a page */
    B.model_bytes = (uint64_t)B.layer_bytes * (uint64_t)B.o.layers;
    B.act_bytes = (size_t)B.o.batch * B.K * 2;
    size_t nact = (size_t)B.o.batch * B.K;
    B.weights = aligned_alloc(2 * SPW_MiB, B.stride * (size_t)B.o.layers);
    B.x0 = malloc(nact * 2);
    B.ref = malloc(nact * 2);
    B.out = malloc(nact * 2);
    rc = 1;
    if (!B.weights || !B.x0 || !B.ref || !B.out) {
        fprintf(stderr, "spillway bench stream: out of host memory for %llu bytes of weights\n",
                (unsigned long long)B.stride * (unsigned long long)B.o.layers);
        goto out;
    }
    generate(&B);
#ifdef SPW_HAVE_CUDA
    if (B.gpu) {
        spw_config *cfg = NULL;
        char dev[16] = "0";
        if (spw_config_create(&cfg) == SPW_OK && spw_config_from_env(cfg) == SPW_OK)
            spw_config_get(cfg, "device", dev, sizeof dev);
        spw_config_destroy(cfg);
        CK(cudaSetDevice(atoi(dev)));
        BK(cublasCreate(&B.blas));
        gpu_link_rate(&B);
        if (gpu_reference(&B)) goto out;
    }
#endif
    if (!B.gpu && host_reference(&B)) goto out;
    if (check_reference(&B)) goto out;
    rc = 0;
    for (int i = 0; i < B.o.npolicies; i++) {
        B.runs[i].policy = B.o.policies[i];
        int r = run_policy(&B, &B.runs[i], i == B.o.npolicies - 1);
        if (r == 2) { /* a configuration error: the same for every run */
            rc = 2;
            goto out;
        }
        if (r) rc = 1;
    }
    if (B.o.json) print_json(&B, B.budget);
    else print_human(&B, B.budget);
    goto out;
#ifdef SPW_HAVE_CUDA
fail:
    rc = 1;
#endif
out:
#ifdef SPW_HAVE_CUDA
    if (B.blas) cublasDestroy(B.blas);
#endif
    for (int i = 0; i < B.o.npolicies; i++) {
        free(B.runs[i].pass_ms);
        free(B.runs[i].pass_h2d);
        free(B.runs[i].pass_d2h);
    }
    free(B.weights);
    free(B.x0);
    free(B.ref);
    free(B.out);
    return rc;
}
