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
 * back to back; median over the second half of the passes, the steady state: plan learns in
 * the first half, as the split's search is left out of its time; the median over every pass
 * after the first is in the JSON as pass_ms_all); bytes moved per pass (spw_stats bytes_h2d
 * + bytes_d2h deltas, mean over the same passes); link bound = bytes moved / link rate;
 * ratio_to_link_bound = link_bound_ms / pass_ms (1.0: at the speed of the link); overlap bound =
 * max(all-resident ms, link bound ms) and its ratio. On emu the times are host times and no
 * link bound exists (reported null): emu checks correctness and bytes, not speed.
 *
 * Exit status: 0 done and correct, 1 a failure or a wrong result, 2 bad usage.
 */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "bench_stream.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: spillway bench stream [--layers N] [--layer-mib M] [--batch B] [--budget SIZE]\n"
            "       [--residency explicit|managed] [--policy lru|plan[,..]] [--passes P]\n"
            "       [--prefetch D] [--seed S] [--trace FILE] [--backend auto|cuda|emu] [--json]\n"
            "       [--summary] [--no-static-split] [--layer-times]\n\n"
            "Streams N bf16 layers of M MiB (K x K, K = sqrt(M MiB / 2)) through a chain of matrix\n"
            "products X <- X W_l, weights held as spillway buffers under a device budget; checks the\n"
            "result against the same chain on all-resident weights; reports ms per pass, bytes\n"
            "moved, GB/s and the ratio to the link bound (bytes moved / pinned H2D rate measured\n"
            "in the same run) and to the all-resident time.\n\n"
            "Defaults on cuda: --layers 32 --layer-mib 128 --batch 16 --passes 32 (the\n"
            "acceptance run: add --budget 2GiB); on emu (no GPU): --layers 8 --layer-mib 2\n"
            "--batch 16 --passes 4, a host stand-in for the product. --budget defaults to half\n"
            "the model plus the activations (rounded up to 2 MiB).\n"
            "  --policy P     one policy, or a comma list (lru,plan) run one after the other with\n"
            "                 the same data, link rate and reference\n"
            "  --prefetch D   spw_prefetch the next D layers before each product (default 2;\n"
            "                 capped below half the layers that fit in the budget)\n"
            "  --trace FILE   the engine's Chrome trace (with several policies: FILE.<policy>)\n"
            "  --summary      print the memory summary (spw_summary) after the last run\n"
            "  --no-static-split  skip the peer (cuda): the hand-tuned static split at the same\n"
            "                 budget, k resident layers and two streamed slots, the best k and\n"
            "                 placement found by timing every k that fits\n"
            "  --layer-times  (cuda) a timing event before every product; the JSON gets each\n"
            "                 run's layer_start_ms: the product's start after its pass's start\n"
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
        } else if (!strcmp(a, "--layer-times")) {
            o->layer_times = true;
        } else if (!strcmp(a, "--no-static-split")) {
            o->no_split = true;
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

/* Row i of the report: the policy runs, then the static split if it ran; NULL past the end. */
static const bs_run *report_row(const bench *B, int i) {
    if (i < B->o.npolicies) return &B->runs[i];
    return i == B->o.npolicies && B->split.policy ? &B->split : NULL;
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
    const bs_run *r;
    for (int i = 0; (r = report_row(B, i)); i++) {
        derived d = derive(B, r);
        printf("%s{\"policy\": \"%s\", \"completed\": %s, \"correct\": %s, \"bitwise_equal\": %s",
               i ? ", " : "", r->policy, r->completed ? "true" : "false", r->ok ? "true" : "false",
               r->ok && r->bitwise ? "true" : "false");
        if (!r->completed) { /* failed before the end: the figures would be meaningless */
            putchar('}');
            continue;
        }
        printf(", \"prefetch\": %ld", r->prefetch);
        if (r == &B->split)
            printf(", \"resident_layers\": %ld, \"placement\": \"%s\", \"candidates_timed\": %d",
                   r->split_k, r->split_placement ? r->split_placement : "none", r->split_tried);
        jnum("max_abs_diff", r->max_diff);
        printf(", \"weights\": \"%s\"", r->host_registered ? "registered" : "copied");
        jnum("pass_ms", r->pass_ms_median);
        jnum("pass_ms_all", r->pass_ms_all);
        jnum("first_pass_ms", r->pass_ms ? r->pass_ms[0] : -1);
        jnum("bytes_per_pass", r->bytes_per_pass);
        jnum("moved_fraction_of_model", d.frac_model);
        jnum("gbps", d.gbps);
        jnum("link_bound_ms", d.link_bound_ms);
        jnum("ratio_to_link_bound", d.ratio_link);
        jnum("ratio_to_all_resident", d.ratio_resident);
        jnum("overlap_bound_ms", d.overlap_ms);
        jnum("ratio_to_overlap_bound", d.ratio_overlap);
        if (r->policy_state[0]) printf(", \"policy_state\": \"%s\"", r->policy_state);
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
        if (r->layer_ms) {
            printf(", \"layer_start_ms\": [");
            for (long l = 0; l < B->o.layers; l++) printf("%s%.4f", l ? ", " : "", r->layer_ms[l]);
            putchar(']');
        }
        putchar('}');
    }
    putchar(']');
    const bs_run *lru = find_run(B, "lru"), *plan = find_run(B, "plan");
    if (lru && plan && plan->pass_ms_median > 0)
        printf(", \"speedup_plan_over_lru\": %.4f", lru->pass_ms_median / plan->pass_ms_median);
    if (plan && B->split.ok && plan->pass_ms_median > 0)
        printf(", \"plan_over_static_split\": %.4f", plan->pass_ms_median / B->split.pass_ms_median);
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
    const bs_run *r;
    for (int i = 0; (r = report_row(B, i)); i++) {
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
    if (lru && plan && plan->pass_ms_median > 0 && lru->pass_ms_median > 0) {
        double x = lru->pass_ms_median / plan->pass_ms_median;
        printf("\nplan is %.2fx %s than lru per pass%s\n", x >= 1 ? x : 1 / x, x >= 1 ? "faster" : "slower",
               B->gpu ? "" : " (emu: host times, not a speed measurement)");
    }
    for (int i = 0; i < B->o.npolicies; i++)
        if (B->runs[i].policy_state[0]) printf("%s\n", B->runs[i].policy_state);
    if (B->split.completed)
        printf("split: the hand-tuned static split, %ld resident layers (%s), %ld streamed through two\n"
               "slots; the fastest of %d candidates (every k that fits, two placements)\n",
               B->split.split_k, B->split.split_placement, B->o.layers - B->split.split_k,
               B->split.split_tried);
    if (plan && B->split.ok && plan->pass_ms_median > 0) {
        double x = B->split.pass_ms_median / plan->pass_ms_median;
        printf("plan is %.3fx the static split's speed (%s)\n", x, x >= 1 ? "as fast or faster" : "slower");
    }
    printf("\nms/pass: median over the second half of the passes (the steady state); moved: h2d +\n"
           "d2h, mean over the same passes;\n"
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
    if (!B.o.passes) B.o.passes = B.gpu ? 32 : 4; /* policy=plan times its pipelines on passes 1-12 */
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
    bs_generate(&B);
#ifdef SPW_HAVE_CUDA
    if (B.gpu) {
        spw_config *cfg = NULL;
        char dev[16] = "0";
        if (spw_config_create(&cfg) == SPW_OK && spw_config_from_env(cfg) == SPW_OK)
            spw_config_get(cfg, "device", dev, sizeof dev);
        spw_config_destroy(cfg);
        CK(cudaSetDevice(atoi(dev)));
        BK(cublasCreate(&B.blas));
        bs_gpu_link_rate(&B);
        if (bs_gpu_reference(&B)) goto out;
    }
#endif
    if (!B.gpu && bs_host_reference(&B)) goto out;
    if (bs_check_reference(&B)) goto out;
    rc = 0;
    for (int i = 0; i < B.o.npolicies; i++) {
        B.runs[i].policy = B.o.policies[i];
        int r = bs_run_policy(&B, &B.runs[i], i == B.o.npolicies - 1);
        if (r == 2) { /* a configuration error: the same for every run */
            rc = 2;
            goto out;
        }
        if (r) rc = 1;
    }
#ifdef SPW_HAVE_CUDA
    if (B.gpu && !B.o.no_split && bs_static_split(&B, &B.split)) rc = 1;
#endif
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
        free(B.runs[i].layer_ms);
    }
    free(B.split.layer_ms);
    free(B.split.pass_ms);
    free(B.split.pass_h2d);
    free(B.split.pass_d2h);
    free(B.weights);
    free(B.x0);
    free(B.ref);
    free(B.out);
    return rc;
}
