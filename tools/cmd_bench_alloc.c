/*
 * spillway bench alloc: latency of a cached spw_malloc + spw_free pair, beside the backend's raw
 * allocation measured in the same run.
 *
 * What is timed, for each size (1 KiB, 1 MiB, 64 MiB, 1 GiB):
 * - spillway: spw_malloc + spw_free on one stream, after a warm-up pair has put a block of that
 *   size in the cache. Pairs run in batches; each batch is timed as a whole (clock_gettime
 *   monotonic) and the median of the batch means is reported. The run checks that no timed pair
 *   reached the backend (stats backend_allocs unchanged), i.e. that the cache was hit.
 * - raw on emu: malloc + free of the same size, nothing touched, timed as above.
 * - raw on cuda: cudaMalloc + cudaFree (cudaFree synchronizes the device), each pair timed alone,
 *   at most 100 pairs (20 from 64 MiB up) because each pair synchronizes the device and costs
 *   orders of magnitude more than a cached one (bench/RESULTS.md).
 * - async on cuda: cudaMallocAsync + cudaFreeAsync on one stream with the device's default pool
 *   warmed and its release threshold at UINT64_MAX (nothing returned to the driver), batched as
 *   for spillway; cudaStreamSynchronize runs after each batch, outside the timed section.
 * Before timing, each allocator's block is validated: a pattern is written and read back
 * (emu: on the host pointer; cuda: cudaMemset, then a copy back of its first, middle and last
 * bytes), so a broken allocator is reported, never timed.
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "internal.h"

#ifdef SPW_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static const size_t bench_sizes[] = {SPW_KiB, SPW_MiB, 64 * SPW_MiB, SPW_GiB};
#define NSIZES (sizeof bench_sizes / sizeof bench_sizes[0])

typedef struct bench_row {
    size_t bytes;
    double spw_ns, raw_ns, async_ns; /* async_ns < 0: not measured (emu) */
    size_t raw_pairs;
    bool cached;                     /* every timed spillway pair was a cache hit */
} bench_row;

/* One timed pair; returns 0, or 1 after printing what failed. */
typedef int (*pair_fn)(void *u);
/* Run outside the timed section after each batch (may be NULL); returns 0 or 1 as pair_fn. */
typedef int (*batch_end_fn)(void *u);

static void *volatile bench_sink; /* keeps malloc/free pairs from being optimised away */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median over nbatches of the mean ns of one pair in a batch of `batch` pairs. */
static int time_pairs(pair_fn fn, batch_end_fn end, void *u, size_t nbatches, size_t batch,
                      double *median_ns) {
    double *means = malloc(nbatches * sizeof *means);
    if (!means) {
        fprintf(stderr, "spillway bench alloc: out of host memory\n");
        return 1;
    }
    for (size_t b = 0; b < nbatches; b++) {
        uint64_t t0 = spw__now_ns();
        for (size_t i = 0; i < batch; i++)
            if (fn(u) != 0) {
                free(means);
                return 1;
            }
        means[b] = (double)(spw__now_ns() - t0) / (double)batch;
        if (end && end(u) != 0) {
            free(means);
            return 1;
        }
    }
    qsort(means, nbatches, sizeof *means, cmp_double);
    *median_ns = nbatches % 2 ? means[nbatches / 2]
                              : (means[nbatches / 2 - 1] + means[nbatches / 2]) / 2.0;
    free(means);
    return 0;
}

/* Split iters pairs into batches: 100 a batch when there are enough, else ten batches. */
static void batching(size_t iters, size_t *nbatches, size_t *batch) {
    *batch = iters >= 1000 ? 100 : (iters >= 10 ? iters / 10 : 1);
    *nbatches = iters / *batch;
}

/* ---- spillway ---- */

typedef struct spw_pair_arg {
    spw_ctx *ctx;
    spw_stream stream;
    size_t bytes;
} spw_pair_arg;

static int spw_pair_fail(const spw_pair_arg *a, const char *call, spw_status st) {
    char what[128], b[64];
    snprintf(what, sizeof what, "%s of %s", call, spw__fmt_bytes(b, sizeof b, a->bytes));
    spw_cli_fail(what, st);
    return 1;
}

static int spw_pair(void *u) {
    spw_pair_arg *a = u;
    void *p = NULL;
    spw_status st = spw_malloc(a->ctx, a->bytes, a->stream, &p);
    if (st != SPW_OK) return spw_pair_fail(a, "spw_malloc", st);
    st = spw_free(a->ctx, p, a->stream);
    if (st != SPW_OK) return spw_pair_fail(a, "spw_free", st);
    return 0;
}

#ifdef SPW_HAVE_CUDA
/* Every CUDA call goes through cuda_ok: on failure it says which call, the error and the size
 * being measured. */
static size_t cuda_cur_bytes;

static bool cuda_ok(cudaError_t e, const char *call) {
    if (e == cudaSuccess) return true;
    fprintf(stderr, "spillway bench alloc: %s failed at size %zu: %s (%s)\n", call, cuda_cur_bytes,
            cudaGetErrorName(e), cudaGetErrorString(e));
    return false;
}
#define CUDA_OK(call) cuda_ok((call), #call)
#define CUDA_CHECK(call)                                                                       \
    do {                                                                                       \
        if (!CUDA_OK(call)) return 1;                                                          \
    } while (0)

/* Fill a device block with `pattern` on stream s and check its first, middle and last bytes. */
static int cuda_validate(void *p, size_t bytes, cudaStream_t s, unsigned char pattern) {
    unsigned char got[3][64];
    size_t n = bytes < sizeof got[0] ? bytes : sizeof got[0];
    size_t offs[3] = {0, (bytes - n) / 2, bytes - n};
    CUDA_CHECK(cudaMemsetAsync(p, pattern, bytes, s));
    for (int k = 0; k < 3; k++)
        CUDA_CHECK(cudaMemcpyAsync(got[k], (char *)p + offs[k], n, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    for (int k = 0; k < 3; k++)
        for (size_t i = 0; i < n; i++)
            if (got[k][i] != pattern) {
                fprintf(stderr, "spillway bench alloc: validation failed: byte %zu of a %zu-byte "
                        "block reads 0x%02x, wrote 0x%02x\n", offs[k] + i, bytes, got[k][i],
                        pattern);
                return 1;
            }
    return 0;
}
#endif

/* Write a pattern into the block and read it back. Up to 1 MiB the whole block; above, 64 bytes
 * at every MiB and at the end, which proves the whole extent is writable without committing a
 * GiB of host memory on emu. The value of a byte depends on its offset, so a block that aliases
 * another part of itself is caught too. */
static int host_validate(void *p, size_t bytes, unsigned char pattern) {
    unsigned char *c = p;
    size_t chunk = bytes <= SPW_MiB ? bytes : 64;
    size_t stride = bytes <= SPW_MiB ? bytes : SPW_MiB;
    for (int check = 0; check < 2; check++) {
        for (size_t off = 0; off < bytes; off += stride) {
            size_t at[2] = {off, off + stride >= bytes ? bytes - chunk : off};
            for (int k = 0; k < 2; k++)
                for (size_t j = at[k]; j < at[k] + chunk; j++) {
                    unsigned char v = (unsigned char)(pattern ^ (j * 131u) ^ (j >> 20));
                    if (!check) {
                        c[j] = v;
                    } else if (c[j] != v) {
                        fprintf(stderr, "spillway bench alloc: validation failed: byte %zu of a "
                                "%zu-byte block reads 0x%02x, wrote 0x%02x\n", j, bytes, c[j], v);
                        return 1;
                    }
                }
        }
    }
    return 0;
}

/* Warm the cache with one pair, validate a block, then time cached pairs. */
static int bench_spillway(spw_ctx *ctx, spw_stream s, bool on_cuda, size_t iters, bench_row *r) {
    spw_pair_arg a = {ctx, s, r->bytes};
    if (spw_pair(&a) != 0) return 1;
    void *p = NULL;
    spw_status st = spw_malloc(ctx, r->bytes, s, &p);
    if (st != SPW_OK) return spw_pair_fail(&a, "spw_malloc", st);
#ifdef SPW_HAVE_CUDA
    int bad = on_cuda ? cuda_validate(p, r->bytes, (cudaStream_t)s, 0xA5)
                      : host_validate(p, r->bytes, 0xA5);
#else
    (void)on_cuda;
    int bad = host_validate(p, r->bytes, 0xA5);
#endif
    st = spw_free(ctx, p, s);
    if (st != SPW_OK) return spw_pair_fail(&a, "spw_free", st);
    if (bad) return 1;

    spw_stats before, after;
    if ((st = spw_stats_get(ctx, &before)) != SPW_OK) return spw_pair_fail(&a, "spw_stats_get", st);
    size_t nb, batch;
    batching(iters, &nb, &batch);
    if (time_pairs(spw_pair, NULL, &a, nb, batch, &r->spw_ns) != 0) return 1;
    if ((st = spw_stats_get(ctx, &after)) != SPW_OK) return spw_pair_fail(&a, "spw_stats_get", st);
    r->cached = after.backend_allocs.total == before.backend_allocs.total;
    if (!r->cached)
        fprintf(stderr, "spillway bench alloc: warning: %lld of the timed %zu-byte pairs went to "
                "the backend (not a cache hit)\n",
                (long long)(after.backend_allocs.total - before.backend_allocs.total), r->bytes);
    return 0;
}

/* ---- raw allocation of the backend ---- */

static int malloc_pair(void *u) {
    size_t bytes = *(size_t *)u;
    void *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "spillway bench alloc: malloc(%zu) failed\n", bytes);
        return 1;
    }
    bench_sink = p;
    free(p);
    return 0;
}

#ifdef SPW_HAVE_CUDA
static int cuda_malloc_pair(void *u) {
    size_t bytes = *(size_t *)u;
    void *p = NULL;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    CUDA_CHECK(cudaFree(p));
    return 0;
}

typedef struct async_arg {
    size_t bytes;
    cudaStream_t stream;
} async_arg;

static int async_pair(void *u) {
    async_arg *a = u;
    void *p = NULL;
    CUDA_CHECK(cudaMallocAsync(&p, a->bytes, a->stream));
    CUDA_CHECK(cudaFreeAsync(p, a->stream));
    return 0;
}

static int async_sync(void *u) {
    CUDA_CHECK(cudaStreamSynchronize(((async_arg *)u)->stream));
    return 0;
}

/* cudaMallocAsync + cudaFreeAsync from the device's default pool, kept warm. The pool is trimmed
 * afterwards so the next size (and spillway) find the memory free. */
static int bench_async(size_t iters, bench_row *r) {
    int dev = 0, pools = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev));
    if (!pools) {
        fprintf(stderr, "spillway bench alloc: device %d has no memory pools; async not measured\n",
                dev);
        return 0;
    }
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    async_arg a = {r->bytes, NULL};
    CUDA_CHECK(cudaStreamCreateWithFlags(&a.stream, cudaStreamNonBlocking));
    int rc = 1;
    void *p = NULL;
    if (async_pair(&a) == 0 && async_sync(&a) == 0 &&
        CUDA_OK(cudaMallocAsync(&p, r->bytes, a.stream))) {
        int bad = cuda_validate(p, r->bytes, a.stream, 0x5A);
        bool freed = CUDA_OK(cudaFreeAsync(p, a.stream)) && async_sync(&a) == 0;
        if (!bad && freed) {
            size_t nb, batch;
            batching(iters, &nb, &batch);
            rc = time_pairs(async_pair, async_sync, &a, nb, batch, &r->async_ns);
        }
    }
    /* Each clean-up step runs even when an earlier one failed. */
    if (!CUDA_OK(cudaStreamSynchronize(a.stream))) rc = 1;
    if (!CUDA_OK(cudaStreamDestroy(a.stream))) rc = 1;
    if (!CUDA_OK(cudaMemPoolTrimTo(pool, 0))) rc = 1;
    return rc;
}
#endif

static int bench_raw(bool on_cuda, size_t iters, bench_row *r) {
    size_t bytes = r->bytes;
#ifdef SPW_HAVE_CUDA
    if (on_cuda) {
        size_t n = bytes >= 64 * SPW_MiB ? 20 : 100;
        if (n > iters) n = iters;
        r->raw_pairs = n;
        if (cuda_malloc_pair(&bytes) != 0) return 1; /* warm-up: first call may initialise */
        if (time_pairs(cuda_malloc_pair, NULL, &bytes, n, 1, &r->raw_ns) != 0) return 1;
        return bench_async(iters, r);
    }
#else
    (void)on_cuda;
#endif
    size_t nb, batch;
    batching(iters, &nb, &batch);
    r->raw_pairs = nb * batch;
    if (malloc_pair(&bytes) != 0) return 1;
    return time_pairs(malloc_pair, NULL, &bytes, nb, batch, &r->raw_ns);
}

/* ---- output ---- */

static void print_table(const char *backend, bool on_cuda, size_t iters, const bench_row *rows) {
    const char *raw = on_cuda ? "cudaMalloc" : "malloc";
    size_t nb, batch;
    batching(iters, &nb, &batch);
    printf("spillway bench alloc: backend %s; allocate + free pairs, median of %zu batch means of "
           "%zu pairs (%s: %s)\n", backend, nb, batch, raw,
           on_cuda ? "each pair timed alone, at most 100 (20 from 64 MiB)" : "same batches");
    printf("%10s %14s %14s %18s %14s %16s\n", "size", "spillway ns",
           on_cuda ? "cudaMalloc ns" : "malloc ns", "cudaMallocAsync ns", "raw/spillway",
           "async/spillway");
    for (size_t i = 0; i < NSIZES; i++) {
        const bench_row *r = &rows[i];
        char size[32], async[32] = "-", aratio[32] = "-";
        if (r->bytes >= SPW_GiB) snprintf(size, sizeof size, "%zu GiB", r->bytes / SPW_GiB);
        else if (r->bytes >= SPW_MiB) snprintf(size, sizeof size, "%zu MiB", r->bytes / SPW_MiB);
        else snprintf(size, sizeof size, "%zu KiB", r->bytes / SPW_KiB);
        if (r->async_ns >= 0) {
            snprintf(async, sizeof async, "%.1f", r->async_ns);
            snprintf(aratio, sizeof aratio, "%.2f", r->async_ns / r->spw_ns);
        }
        printf("%10s %14.1f %14.1f %18s %14.2f %16s%s\n", size, r->spw_ns, r->raw_ns, async,
               r->raw_ns / r->spw_ns, aratio, r->cached ? "" : "  (cache missed)");
    }
}

static void print_json(const char *backend, bool on_cuda, size_t iters, const bench_row *rows) {
    size_t nb, batch;
    batching(iters, &nb, &batch);
    printf("{\"bench\": \"alloc\", \"backend\": \"%s\", \"iters\": %zu, \"batch\": %zu, "
           "\"raw\": \"%s\", \"rows\": [",
           backend, iters, batch, on_cuda ? "cudaMalloc" : "malloc");
    for (size_t i = 0; i < NSIZES; i++) {
        const bench_row *r = &rows[i];
        printf("%s{\"bytes\": %zu, \"spillway_ns\": %.2f, \"raw_ns\": %.2f, \"raw_pairs\": %zu, "
               "\"raw_over_spillway\": %.3f, ", i ? ", " : "", r->bytes, r->spw_ns, r->raw_ns,
               r->raw_pairs, r->raw_ns / r->spw_ns);
        if (r->async_ns >= 0)
            printf("\"async_ns\": %.2f, \"async_over_spillway\": %.3f, ", r->async_ns,
                   r->async_ns / r->spw_ns);
        else
            printf("\"async_ns\": null, \"async_over_spillway\": null, ");
        printf("\"cached\": %s}", r->cached ? "true" : "false");
    }
    printf("]}\n");
}

/* ---- commands ---- */

static void bench_alloc_usage(FILE *f) {
    fprintf(f, "usage: spillway bench alloc [--backend auto|emu|cuda] [--json] [--iters N]\n\n"
               "Median latency of a cached spw_malloc + spw_free pair for 1 KiB .. 1 GiB, beside\n"
               "the backend's own allocation (malloc on emu; cudaMalloc and cudaMallocAsync with\n"
               "a warm pool on cuda). --iters: timed pairs per size (default 10000).\n");
}

int spw_bench_alloc(int argc, char **argv) {
    const char *backend = NULL;
    bool json = false;
    size_t iters = 10000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_alloc_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (spw_cli_is_flag(a, "--backend")) {
            if (!(backend = spw_cli_flag_value("spillway bench alloc", argc, argv, &i, "--backend"))) return 2;
        } else if (spw_cli_is_flag(a, "--iters")) {
            const char *v = spw_cli_flag_value("spillway bench alloc", argc, argv, &i, "--iters");
            if (!v) return 2;
            char *end;
            unsigned long long n = strtoull(v, &end, 10);
            if (v[0] < '0' || v[0] > '9' || *end || n == 0 || n > 100000000ull) {
                fprintf(stderr, "spillway bench alloc: bad --iters '%s' (1 .. 100000000)\n", v);
                return 2;
            }
            iters = (size_t)n;
        } else {
            fprintf(stderr, "spillway bench alloc: unknown argument '%s'\n", a);
            bench_alloc_usage(stderr);
            return 2;
        }
    }

    spw_config *cfg = NULL;
    spw_ctx *ctx = NULL;
    spw_stream stream = NULL;
    spw_status st;
    int rc = 2;
    if ((st = spw_config_create(&cfg)) != SPW_OK) {
        spw_cli_fail("cannot create a configuration", st);
        return 1;
    }
    if ((st = spw_config_from_env(cfg)) != SPW_OK) {
        spw_cli_fail("bad SPILLWAY_CONF", st);
        goto out;
    }
    if (backend && (st = spw_config_set(cfg, "backend", backend)) != SPW_OK) {
        spw_cli_fail("bad --backend", st);
        goto out;
    }
    rc = 1;
    if ((st = spw_ctx_create(cfg, &ctx)) != SPW_OK) {
        spw_cli_fail("cannot create a context", st);
        goto out;
    }
    const char *used = spw_ctx_backend(ctx);
    bool on_cuda = !strcmp(used, "cuda");
    fprintf(stderr, "spillway: backend %s\n", used);
    if ((st = spw_stream_create(ctx, &stream)) != SPW_OK) {
        spw_cli_fail("cannot create a stream", st);
        goto out;
    }

    bench_row rows[NSIZES];
    for (size_t i = 0; i < NSIZES; i++) {
        rows[i] = (bench_row){.bytes = bench_sizes[i], .async_ns = -1.0};
#ifdef SPW_HAVE_CUDA
        cuda_cur_bytes = bench_sizes[i];
#endif
        if (bench_spillway(ctx, stream, on_cuda, iters, &rows[i]) != 0) goto out;
        /* Return the cached block so the raw allocator (and the next size) find the memory. */
        if ((st = spw_empty_cache(ctx)) != SPW_OK) {
            spw_cli_fail("spw_empty_cache", st);
            goto out;
        }
        if (bench_raw(on_cuda, iters, &rows[i]) != 0) goto out;
    }
    if (json)
        print_json(used, on_cuda, iters, rows);
    else
        print_table(used, on_cuda, iters, rows);
    rc = 0;

out:
    if (stream && (st = spw_stream_destroy(ctx, stream)) != SPW_OK) {
        spw_cli_fail("cannot destroy the stream", st);
        rc = 1;
    }
    if (ctx && (st = spw_ctx_destroy(ctx)) != SPW_OK) {
        spw_cli_fail("cannot destroy the context", st);
        rc = 1;
    }
    spw_config_destroy(cfg);
    return rc;
}

static void bench_usage(FILE *f) {
    fprintf(f, "usage: spillway bench alloc|stream [ARGS...]\n\n"
               "  alloc    latency of cached allocation against the backend's own allocator\n"
               "  stream   streaming weights through the offload engine\n"
               "'spillway bench alloc --help' describes its options.\n");
}

int spw_cmd_bench(int argc, char **argv) {
    if (argc < 2) {
        bench_usage(stderr);
        return 2;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h")) {
        bench_usage(stdout);
        return 0;
    }
    if (!strcmp(sub, "alloc")) return spw_bench_alloc(argc - 1, argv + 1);
    if (!strcmp(sub, "stream")) return spw_bench_stream(argc - 1, argv + 1);
    fprintf(stderr, "spillway bench: unknown benchmark '%s'\n", sub);
    bench_usage(stderr);
    return 2;
}
