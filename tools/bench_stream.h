/*
 * bench_stream.h: private to `spillway bench stream` (cmd_bench_stream.c, bench_stream_run.c,
 * bench_stream_gpu.c). The benchmark's state and the functions one of its files calls in
 * another; the workload, validation and figures are described at the top of cmd_bench_stream.c.
 * - cmd_bench_stream.c: arguments, orchestration (spw_bench_stream), reporting.
 * - bench_stream_run.c: the data (generator, host product, reference, comparison) and one
 *   spillway run per policy (context, weights, passes).
 * - bench_stream_gpu.c (SPW_HAVE_CUDA only): link rate, all-resident cuBLAS reference, the
 *   cuBLAS product; CK/BK below report a failed CUDA/cuBLAS call and `goto fail`.
 * - bench_stream_split.c (SPW_HAVE_CUDA only): the hand-tuned static split, the expert's peer.
 * Functions return 0 on success, 1 on failure (message printed), unless said otherwise.
 */
#ifndef SPW_BENCH_STREAM_H
#define SPW_BENCH_STREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cli.h"
#include "ctx.h"
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
    bool json, summary, no_split, layer_times;
} bs_opts;

typedef struct bs_run { /* one spillway run (one policy) */
    const char *policy;
    double *pass_ms;            /* per pass */
    uint64_t *pass_h2d, *pass_d2h;
    double pass_ms_median, bytes_per_pass; /* over the steady passes (BS_STEADY_FROM) */
    double pass_ms_all;                    /* median over every pass after the first */
    bool completed;             /* every pass ran and the outputs were read back */
    bool ok, bitwise;           /* ok: completed and correct */
    long prefetch;              /* prefetch depth used (see effective_prefetch) */
    double max_diff;
    bool host_registered;       /* weights registered (no copy) rather than copied in */
    int64_t evictions, stalls, prefetch_hits;
    long split_k;               /* static split: resident layers chosen */
    int split_spread, split_tried; /* static split: placement (0 prefix, 1 spread); candidates timed */
    const char *split_placement;
    char policy_state[SPW__POLICY_DESCRIBE_MAX]; /* the policy's account of itself after the passes */
    double *layer_ms;           /* --layer-times: each product's start after its pass's start */
} bs_run;

/* Activation buffers every run holds on the device during its timed passes (input, two
 * ping-pong): the spillway runs allocate them from the budget, the static split counts them. */
#define BS_ACT_BUFFERS 3

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
    bs_run split;               /* the static split peer (cuda only; completed when it ran) */
#ifdef SPW_HAVE_CUDA
    cublasHandle_t blas;
#endif
} bench;

/* ---- bench_stream_run.c ---- */

/* Generate every layer and the input, in parallel. */
void bs_generate(bench *B);
/* The emu reference: the host function, layer after layer, into B->ref. */
int bs_host_reference(bench *B);
/* Refuse a degenerate reference (all zeros, not finite): it would validate nothing. */
int bs_check_reference(const bench *B);
/* The passes every figure is taken over: the second half, the steady state. The first half
 * holds what a policy pays to learn (plan records a step, then times its pipelines over nine),
 * as the split's search of every k is left out of its figures. */
#define BS_STEADY_FROM(P) ((P) > 1 ? (P) / 2 : 0)
/* Median of v[from..n) (v[0..n) if from >= n). */
double bs_median_from(const double *v, size_t n, size_t from);
/* r->pass_ms_median (the steady passes) and r->pass_ms_all from r->pass_ms[0..P). */
void bs_pass_medians(bs_run *r, long P);
/* One spillway run with r->policy: 0 done and correct, 1 failure or wrong result, 2 a
 * configuration error (the same for every run). `last`: the last run (prints --summary). */
int bs_run_policy(bench *B, bs_run *r, bool last);

#ifdef SPW_HAVE_CUDA
/* ---- bench_stream_gpu.c ---- */

void bs_cuda_fail(const char *call, cudaError_t e, const char *file, int line);
void bs_blas_fail(const char *call, cublasStatus_t s, const char *file, int line);
#define CK(call)                                                                               \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            bs_cuda_fail(#call, e_, __FILE__, __LINE__);                                       \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)
#define BK(call)                                                                               \
    do {                                                                                       \
        cublasStatus_t s_ = (call);                                                            \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                     \
            bs_blas_fail(#call, s_, __FILE__, __LINE__);                                       \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

/* Y = X W (row-major X: batch x K, W: K x K) on stream s, with cuBLAS. */
int bs_gpu_gemm(bench *B, const void *x, const void *w, void *y, cudaStream_t s);
/* Pinned host -> device rate into B->link_gbps; not fatal (< 0: not measured). */
void bs_gpu_link_rate(bench *B);
/* The all-resident (or staged) cuBLAS reference into B->ref, and B->all_resident_ms. */
int bs_gpu_reference(bench *B);

/* --layer-times: a timing event before each product of every pass (the same cost in every run,
 * the split's included), to see where a pipeline loses time within a pass. */
typedef struct bs_ltimes {
    cudaEvent_t *ev; /* P x N, NULL when off */
    long N, P;
} bs_ltimes;
int bs_ltimes_create(const bench *B, bs_ltimes *t);
/* Record the event of (pass p, layer l) on s; nothing when off. */
int bs_ltimes_mark(bs_ltimes *t, long p, long l, cudaStream_t s);
/* layer_ms[l] = median over the second half of the passes of the product's start after
 * pass_start[p] (allocated here; nothing when off). */
int bs_ltimes_finish(bs_ltimes *t, const cudaEvent_t *pass_start, double **layer_ms);
void bs_ltimes_destroy(bs_ltimes *t);

/* ---- bench_stream_split.c ---- */

/* The hand-tuned static split at B->budget (the best k and placement found by trying), timed
 * and checked like a spillway run, into r. */
int bs_static_split(bench *B, bs_run *r);
#endif

#endif
