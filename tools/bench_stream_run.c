/*
 * spillway bench stream, the data and the runs: the deterministic generator, the host product
 * (the emu stand-in for the GPU product and the emu reference), the comparison with the
 * reference, and one spillway run per policy (context, weights as buffers, the timed passes,
 * read-back and check). The workload and the figures are described at the top of
 * cmd_bench_stream.c; the cuBLAS side is in bench_stream_gpu.c.
 */
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_stream.h"

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
void bs_generate(bench *B) {
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
int bs_check_reference(const bench *B) {
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
double bs_median_from(const double *v, size_t n, size_t from) {
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

void bs_pass_medians(bs_run *r, long P) {
    r->pass_ms_median = bs_median_from(r->pass_ms, (size_t)P, (size_t)BS_STEADY_FROM(P));
    r->pass_ms_all = bs_median_from(r->pass_ms, (size_t)P, 1);
}

/* The emu reference: the host function, layer after layer. */
int bs_host_reference(bench *B) {
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
    uint16_t *first;                /* the first pass's output, read back (first_out is freed) */
    host_gemm *hg;                  /* emu: one argument per (pass, layer) */
    host_copy *hc;                  /* emu: two per pass */
    float *acc;
#ifdef SPW_HAVE_CUDA
    cudaEvent_t *ev;
    bs_ltimes lt;
#endif
} run_state;

/* Half the model, plus room for the activations (the small-request arena maps 2 MiB pages). */
static uint64_t default_budget(const bench *B) {
    return B->model_bytes / 2 + SPW_ALIGN_UP(BS_ACT_BUFFERS * B->act_bytes, 2 * SPW_MiB);
}

/* Under LRU a layer prefetched d products ahead ages from its prefetch, so it outlives the layers
 * released since only if fewer than half the slots are prefetched: with `slots` layers fitting
 * beside the activations, a depth d with 2d >= slots makes each prefetch evict a layer
 * prefetched earlier, before its use, and every layer crosses the link twice. So the depth is
 * capped at (slots - 1) / 2 (15 slots at 2 GiB of 128 MiB layers: 7). */
static long effective_prefetch(const bench *B) {
    uint64_t acts = SPW_ALIGN_UP(BS_ACT_BUFFERS * B->act_bytes, 2 * SPW_MiB);
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
    if (st) spw_cli_fail("enqueueing the layer's work", st);
    return st != SPW_OK;
}

static int enqueue_gemm(bench *B, run_state *S, host_gemm *arg, const void *x, const void *w, void *y) {
#ifdef SPW_HAVE_CUDA
    if (B->gpu) return bs_gpu_gemm(B, x, w, y, (cudaStream_t)S->s);
#endif
    *arg = (host_gemm){x, w, y, (size_t)B->o.batch, B->K, S->acc};
    spw_status st = spw_launch_host(S->ctx, S->s, host_gemm_run, arg);
    if (st) spw_cli_fail("enqueueing the layer's work", st);
    return st != SPW_OK;
}

/* Copy an activation-sized device buffer to the host after the stream's work. */
static int read_back(bench *B, run_state *S, const void *src, uint16_t *dst) {
    spw_status st = spw_stream_synchronize(S->ctx, S->s);
    if (st) {
        spw_cli_fail("waiting for the stream", st);
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

/* The passes: see the comment at the top of cmd_bench_stream.c. Timing marks come after spw_step_end. */
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
#ifdef SPW_HAVE_CUDA
            if (B->gpu && bs_ltimes_mark(&S->lt, p, l, (cudaStream_t)S->s)) return 1;
#endif
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
        if (p == 0) { /* keep the first pass's output on the host: the timed passes hold three buffers */
            if (read_back(B, S, S->first_out, S->first)) return 1;
            if ((st = spw_free(S->ctx, S->first_out, S->s))) break;
            S->first_out = NULL;
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
    if (B->gpu && bs_ltimes_finish(&S->lt, S->ev, &r->layer_ms)) return 1;
#endif
    spw__ctx_describe_policy(S->ctx, r->policy_state, sizeof r->policy_state);
    r->evictions = now.evictions_clean.total + now.evictions_dirty.total;
    r->stalls = now.stalls.total;
    r->prefetch_hits = now.prefetch_hits.total;
    return 0;
#ifdef SPW_HAVE_CUDA
fail:
    return 1;
#endif
}

int bs_run_policy(bench *B, bs_run *r, bool last) {
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
    S.first = malloc(B->act_bytes);
    if (!r->pass_ms || !r->pass_h2d || !r->pass_d2h || !S.w || !S.hg || !S.hc || !S.acc || !S.first) {
        fprintf(stderr, "spillway bench stream: out of host memory\n");
        goto out;
    }
#ifdef SPW_HAVE_CUDA
    if (B->gpu && !(S.ev = calloc((size_t)P + 1, sizeof *S.ev))) goto out;
    for (long p = 0; B->gpu && p <= P; p++) CK(cudaEventCreate(&S.ev[p]));
    if (B->gpu && bs_ltimes_create(B, &S.lt)) goto out;
#endif
    if ((rc = make_ctx(B, r->policy, &S.ctx))) goto out;
    rc = 1;
    if ((st = spw_stream_create(S.ctx, &S.s))) {
        spw_cli_fail("creating a stream", st);
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
    if (compare(B, S.first, what, r)) goto out;
    snprintf(what, sizeof what, "pass %ld of %ld", P, P);
    if (read_back(B, &S, S.act[N % 2], B->out) || compare(B, B->out, what, r)) goto out;
    r->ok = true;
    bs_pass_medians(r, P);
    long from = BS_STEADY_FROM(P);
    double sum = 0;
    for (long p = from; p < P; p++) sum += (double)(r->pass_h2d[p] + r->pass_d2h[p]);
    r->bytes_per_pass = sum / (double)(P - from);
    if (last && B->o.summary) spw_summary(S.ctx, B->o.json ? stderr : stdout);
    rc = 0;
#ifdef SPW_HAVE_CUDA
fail:
#endif
out:
    for (long l = 0; S.w && l < N; l++)
        if (S.w[l] && (st = spw_buf_destroy(S.w[l]))) {
            spw_cli_fail("destroying a buffer", st);
            rc = 1;
        }
    void *acts[4] = {S.x0d, S.act[0], S.act[1], S.first_out};
    for (int i = 0; i < 4; i++)
        if (acts[i]) spw_free(S.ctx, acts[i], S.s);
    if (S.s) spw_stream_destroy(S.ctx, S.s);
    if (S.ctx && (st = spw_ctx_destroy(S.ctx))) {
        spw_cli_fail("closing the context", st);
        rc = 1;
    }
#ifdef SPW_HAVE_CUDA
    for (long p = 0; S.ev && p <= P; p++)
        if (S.ev[p]) cudaEventDestroy(S.ev[p]);
    free(S.ev);
    bs_ltimes_destroy(&S.lt);
#endif
    free(S.w);
    free(S.hg);
    free(S.hc);
    free(S.acc);
    free(S.first);
    return rc;
}
