/*
 * spillway replay TRACE: run an allocation trace through the caching allocator and report how
 * much device memory it held against what the trace needed, and how fast each call was.
 *
 * Exit status: 0 done, 1 the replay failed (an allocation was refused, a backend error), 2 bad
 * usage or configuration.
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "internal.h"
#include "trace.h"

/* uthash must never exit(): a failed insert sets `hash_oom` (a local at each HASH_ADD). */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) (hash_oom = 1)
#include <uthash.h>

typedef struct replay_opts {
    const char *trace;
    const char *backend; /* NULL: from the configuration */
    const char *budget;  /* NULL: from the configuration */
    bool json, summary;
} replay_opts;

/* What the timed loop needs, computed from the trace before timing so the loop does no lookup:
 * for op i, slot[i] is the index of its 'a' op (i itself for an 'a'), sidx[i] the index of its
 * stream in streams[]/handles[], ptrs[i] the pointer of a live 'a' op (NULL otherwise). */
typedef struct replay_plan {
    size_t *slot;
    uint32_t *sidx;
    void **ptrs;
    uint64_t *streams;     /* distinct trace stream numbers, in order of first use */
    spw_stream *handles;   /* their spillway streams; stream number 0 is the default stream */
    size_t nstreams;
    size_t allocs, frees;
    uint64_t peak_live;    /* peak of the sum of live bytes, from the trace alone */
} replay_plan;

typedef struct id_entry {
    uint64_t id;
    size_t index;
    UT_hash_handle hh;
} id_entry;

static void usage(FILE *f) {
    fprintf(f,
            "usage: spillway replay TRACE [--backend auto|emu|cuda] [--budget SIZE] [--json] "
            "[--summary]\n\n"
            "Replays an allocation trace ('a <id> <bytes> <stream>' / 'f <id>' lines, plain or\n"
            "gzip) through spillway's caching allocator and reports the peak bytes held from the\n"
            "device against the trace's own peak of live bytes, and the time per call.\n\n"
            "  --backend B   auto (default: cuda if a device is present, else emu), emu or cuda\n"
            "  --budget S    device budget: 6GiB, 512MiB, ... or 80%% of the device\n"
            "  --json        one JSON object on stdout\n"
            "  --summary     also print the allocator's statistics table\n"
            "Options from SPILLWAY_CONF are applied first; flags override them.\n");
}

/* Returns -1 to go on, else the exit status (0 after --help, 2 for bad usage). */
static int parse_args(int argc, char **argv, replay_opts *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            o->json = true;
        } else if (!strcmp(a, "--summary")) {
            o->summary = true;
        } else if (spw_cli_is_flag(a, "--backend")) {
            if (!(o->backend = spw_cli_flag_value("spillway replay", argc, argv, &i, "--backend"))) return 2;
        } else if (spw_cli_is_flag(a, "--budget")) {
            if (!(o->budget = spw_cli_flag_value("spillway replay", argc, argv, &i, "--budget"))) return 2;
            if (spw_parse_budget(o->budget, 0, NULL, NULL) != SPW_OK) {
                fprintf(stderr, "spillway replay: bad --budget: %s\n", spw_last_error());
                return 2;
            }
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "spillway replay: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        } else if (o->trace) {
            fprintf(stderr, "spillway replay: more than one trace ('%s', '%s')\n", o->trace, a);
            return 2;
        } else {
            o->trace = a;
        }
    }
    if (!o->trace) {
        fprintf(stderr, "spillway replay: missing TRACE\n");
        usage(stderr);
        return 2;
    }
    return -1;
}

static void plan_free(replay_plan *p) {
    free(p->slot);
    free(p->sidx);
    free(p->ptrs);
    free(p->streams);
    free(p->handles);
    memset(p, 0, sizeof *p);
}

/* Build the plan. The loader has validated the pairing (every 'f' names a live 'a'). */
static int plan_build(const spw_trace *t, replay_plan *p) {
    size_t n = t->count ? t->count : 1;
    p->slot = malloc(n * sizeof *p->slot);
    p->sidx = malloc(n * sizeof *p->sidx);
    p->ptrs = calloc(n, sizeof *p->ptrs);
    id_entry *entries = malloc(n * sizeof *entries);
    if (!p->slot || !p->sidx || !p->ptrs || !entries) {
        free(entries);
        fprintf(stderr, "spillway replay: out of host memory planning %zu ops\n", t->count);
        return 1;
    }
    id_entry *map = NULL;
    size_t cap_streams = 0;
    uint64_t live = 0;
    int rc = 0;
    for (size_t i = 0; i < t->count && rc == 0; i++) {
        const spw_trace_op *op = &t->ops[i];
        if (op->kind == 'f') {
            id_entry *e = NULL;
            HASH_FIND(hh, map, &op->id, sizeof op->id, e);
            if (!e) { /* cannot happen for a loaded trace; refuse rather than crash */
                fprintf(stderr, "spillway replay: op %zu frees unknown id %llu\n", i,
                        (unsigned long long)op->id);
                rc = 1;
                break;
            }
            p->slot[i] = e->index;
            p->sidx[i] = p->sidx[e->index];
            live -= t->ops[e->index].bytes;
            HASH_DEL(map, e);
            p->frees++;
            continue;
        }
        p->slot[i] = i;
        p->allocs++;
        live += op->bytes;
        if (live > p->peak_live) p->peak_live = live;
        size_t s = 0;
        while (s < p->nstreams && p->streams[s] != op->stream) s++;
        if (s == p->nstreams) {
            if (p->nstreams == cap_streams) {
                cap_streams = cap_streams ? 2 * cap_streams : 4;
                uint64_t *ns = realloc(p->streams, cap_streams * sizeof *ns);
                if (ns) p->streams = ns;
                spw_stream *nh = ns ? realloc(p->handles, cap_streams * sizeof *nh) : NULL;
                if (nh) p->handles = nh;
                if (!ns || !nh) {
                    fprintf(stderr, "spillway replay: out of host memory for streams\n");
                    rc = 1;
                    break;
                }
            }
            p->streams[p->nstreams] = op->stream;
            p->handles[p->nstreams++] = NULL;
        }
        p->sidx[i] = (uint32_t)s;
        id_entry *e = &entries[i];
        e->id = op->id;
        e->index = i;
        int hash_oom = 0;
        HASH_ADD(hh, map, id, sizeof e->id, e);
        if (hash_oom) {
            fprintf(stderr, "spillway replay: out of host memory for the id map\n");
            rc = 1;
        }
    }
    HASH_CLEAR(hh, map);
    free(entries);
    return rc;
}

/* PyTorch's max_memory_reserved from the .json beside the trace (NAME.trace[.gz] ->
 * NAME.json), or 0 when there is none. Only for comparison in the report. */
static uint64_t pytorch_reserved(const char *trace) {
    char path[4096];
    const char *dot = strstr(trace, ".trace");
    size_t stem = dot ? (size_t)(dot - trace) : strlen(trace);
    if (stem + sizeof ".json" > sizeof path) return 0;
    memcpy(path, trace, stem);
    memcpy(path + stem, ".json", sizeof ".json");
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *k = strstr(buf, "\"max_memory_reserved\"");
    if (!k || !(k = strchr(k, ':'))) return 0;
    return strtoull(k + 1, NULL, 10);
}

static void json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

/* The allocator's statistics as JSON text (malloc'd), or NULL if they cannot be had. */
static char *stats_json(spw_ctx *ctx) {
    char *text = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&text, &len);
    if (!m) return NULL;
    spw_status st = spw_summary_json(ctx, m);
    if (fclose(m) != 0 || st != SPW_OK) {
        free(text);
        return NULL;
    }
    return text;
}

/* Say on stderr which backend the context uses and why, and its budget. */
static void report_backend(spw_ctx *ctx, const spw_config *cfg) {
    char want[32] = "";
    if (spw_config_get(cfg, "backend", want, sizeof want) != SPW_OK) want[0] = '\0';
    const char *got = spw_ctx_backend(ctx);
    const char *why = "";
    if (!strcmp(want, "auto")) {
#ifdef SPW_HAVE_CUDA
        why = !strcmp(got, "emu") ? " (auto: no CUDA device)" : " (auto)";
#else
        why = " (auto: built without CUDA)";
#endif
    }
    char b[64];
    fprintf(stderr, "spillway: backend %s%s, budget %s\n", got, why,
            spw__fmt_bytes(b, sizeof b, spw_ctx_budget(ctx)));
}

static void print_human(const replay_opts *o, const spw_trace *t, const replay_plan *p,
                        spw_ctx *ctx, const spw_stats *s, uint64_t ns, uint64_t torch) {
    char b1[64], b2[64], b3[64];
    double ratio = p->peak_live ? (double)s->held.peak / (double)p->peak_live : 0.0;
    printf("trace         %s: %zu ops (%zu allocs, %zu frees, %zu live at the end), %zu stream%s\n",
           o->trace, t->count, p->allocs, p->frees, p->allocs - p->frees, p->nstreams,
           p->nstreams == 1 ? "" : "s");
    printf("backend       %s, budget %s\n", spw_ctx_backend(ctx),
           spw__fmt_bytes(b1, sizeof b1, spw_ctx_budget(ctx)));
    printf("peak reserved %s\n", spw__fmt_bytes(b1, sizeof b1, (uint64_t)s->held.peak));
    printf("peak live     %s (allocator), %s (trace)\n",
           spw__fmt_bytes(b2, sizeof b2, (uint64_t)s->live.peak),
           spw__fmt_bytes(b3, sizeof b3, p->peak_live));
    printf("reserved/live %.3f", ratio);
    if (torch && p->peak_live)
        printf(" (PyTorch: %.3f, reserved %s)", (double)torch / (double)p->peak_live,
               spw__fmt_bytes(b1, sizeof b1, torch));
    printf("\nbackend calls %lld allocs, %lld frees; %lld OOMs\n",
           (long long)s->backend_allocs.total, (long long)s->backend_frees.total,
           (long long)s->ooms.total);
    printf("time          %.1f ns/op (%.3f ms for %zu calls)\n",
           t->count ? (double)ns / (double)t->count : 0.0, (double)ns / 1e6, t->count);
}

static void print_json(const replay_opts *o, const spw_trace *t, const replay_plan *p,
                       spw_ctx *ctx, const spw_stats *s, uint64_t ns, uint64_t torch) {
    printf("{\"trace\": ");
    json_string(stdout, o->trace);
    printf(", \"backend\": \"%s\", \"budget_bytes\": %llu", spw_ctx_backend(ctx),
           (unsigned long long)spw_ctx_budget(ctx));
    printf(", \"ops\": %zu, \"allocs\": %zu, \"frees\": %zu, \"live_at_end\": %zu, "
           "\"streams\": %zu", t->count, p->allocs, p->frees, p->allocs - p->frees, p->nstreams);
    printf(", \"peak_reserved_bytes\": %lld, \"peak_live_bytes\": %lld, \"trace_peak_live\": %llu",
           (long long)s->held.peak, (long long)s->live.peak, (unsigned long long)p->peak_live);
    printf(", \"reserved_over_live\": %.6f",
           p->peak_live ? (double)s->held.peak / (double)p->peak_live : 0.0);
    if (torch) printf(", \"pytorch_max_memory_reserved\": %llu", (unsigned long long)torch);
    printf(", \"backend_allocs\": %lld, \"backend_frees\": %lld, \"ooms\": %lld",
           (long long)s->backend_allocs.total, (long long)s->backend_frees.total,
           (long long)s->ooms.total);
    printf(", \"ns_per_op\": %.2f, \"seconds\": %.6f",
           t->count ? (double)ns / (double)t->count : 0.0, (double)ns / 1e9);
    char *stats = stats_json(ctx);
    printf(", \"stats\": %s}\n", stats ? stats : "null");
    free(stats);
}

/* Replay every op, timing the loop only. On a failure, says which op and returns 1; the
 * allocations made so far stay in plan->ptrs for the caller to free. */
static int replay_ops(spw_ctx *ctx, const spw_trace *t, replay_plan *p, uint64_t *ns) {
    const spw_trace_op *ops = t->ops;
    size_t i = 0;
    spw_status st = SPW_OK;
    uint64_t t0 = spw__now_ns();
    for (; i < t->count; i++) {
        if (ops[i].kind == 'a') {
            st = spw_malloc(ctx, ops[i].bytes, p->handles[p->sidx[i]], &p->ptrs[i]);
        } else {
            size_t a = p->slot[i];
            st = spw_free(ctx, p->ptrs[a], p->handles[p->sidx[i]]);
            if (st == SPW_OK) p->ptrs[a] = NULL;
        }
        if (st != SPW_OK) break;
    }
    *ns = spw__now_ns() - t0;
    if (st == SPW_OK) return 0;
    char what[256], b[64];
    snprintf(what, sizeof what, "replay op %zu of %zu ('%c' id %llu, %s, stream %llu)", i,
             t->count, ops[i].kind, (unsigned long long)ops[i].id,
             spw__fmt_bytes(b, sizeof b, ops[i].bytes), (unsigned long long)ops[i].stream);
    spw_cli_fail(what, st);
    return 1;
}

int spw_cmd_replay(int argc, char **argv) {
    replay_opts o = {0};
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0) return rc;

    /* Configuration first: a usage error is reported before any work. */
    spw_trace t = {0};
    replay_plan p = {0};
    spw_config *cfg = NULL;
    spw_ctx *ctx = NULL;
    spw_status st;
    rc = 2; /* configuration errors are usage errors */
    if ((st = spw_config_create(&cfg)) != SPW_OK) {
        spw_cli_fail("cannot create a configuration", st);
        rc = 1;
        goto out;
    }
    if ((st = spw_config_from_env(cfg)) != SPW_OK) {
        spw_cli_fail("bad SPILLWAY_CONF", st);
        goto out;
    }
    if (o.backend && (st = spw_config_set(cfg, "backend", o.backend)) != SPW_OK) {
        spw_cli_fail("bad --backend", st);
        goto out;
    }
    if (o.budget && (st = spw_config_set(cfg, "budget", o.budget)) != SPW_OK) {
        spw_cli_fail("bad --budget", st);
        goto out;
    }
    rc = 1;
    if ((st = spw__trace_load(o.trace, &t)) != SPW_OK) {
        spw_cli_fail("cannot load trace", st);
        goto out;
    }
    if (plan_build(&t, &p) != 0) goto out;
    if ((st = spw_ctx_create(cfg, &ctx)) != SPW_OK) {
        spw_cli_fail("cannot create a context", st);
        goto out;
    }
    report_backend(ctx, cfg);
    for (size_t s = 0; s < p.nstreams; s++) {
        if (p.streams[s] == 0) continue; /* the default stream */
        if ((st = spw_stream_create(ctx, &p.handles[s])) != SPW_OK) {
            spw_cli_fail("cannot create a stream", st);
            goto out;
        }
    }

    uint64_t ns = 0;
    if (replay_ops(ctx, &t, &p, &ns) != 0) goto out;

    spw_stats stats;
    if ((st = spw_stats_get(ctx, &stats)) != SPW_OK) {
        spw_cli_fail("cannot read statistics", st);
        goto out;
    }
    uint64_t torch = pytorch_reserved(o.trace);
    if (o.json)
        print_json(&o, &t, &p, ctx, &stats, ns, torch);
    else
        print_human(&o, &t, &p, ctx, &stats, ns, torch);
    if (o.summary) {
        /* Taken at the end of the trace, with its last allocations still live. */
        if (!o.json) printf("\n");
        if ((st = spw_summary(ctx, stdout)) != SPW_OK) {
            spw_cli_fail("cannot print the summary", st);
            goto out;
        }
    }
    rc = 0;

out:
    /* Allocations the trace left live (or made before a failure) are freed here, after the
     * measurement, so that destroying the context reports no leak of ours. */
    for (size_t i = 0; ctx && i < t.count; i++) {
        if (!p.ptrs[i]) continue;
        if ((st = spw_free(ctx, p.ptrs[i], p.handles[p.sidx[i]])) != SPW_OK) {
            spw_cli_fail("cannot free a live allocation at the end", st);
            rc = 1;
        }
    }
    for (size_t s = 0; ctx && s < p.nstreams; s++) {
        if (!p.handles[s]) continue;
        if ((st = spw_stream_destroy(ctx, p.handles[s])) != SPW_OK) {
            spw_cli_fail("cannot destroy a stream", st);
            rc = 1;
        }
    }
    if (ctx && (st = spw_ctx_destroy(ctx)) != SPW_OK) {
        spw_cli_fail("cannot destroy the context", st);
        rc = 1;
    }
    spw_config_destroy(cfg);
    plan_free(&p);
    spw__trace_free(&t);
    return rc;
}
