/*
 * spillway simulate ACCESS_TRACE --budget SIZE: run an access trace (tests/data/README.md)
 * through the real offload engine on the emu backend and report the bytes it moved per step,
 * optionally next to the offline yardsticks of oracle.c (--compare).
 *
 * How the trace drives the engine (one stream, in trace order):
 *   b <id> <bytes> ro|rw   spw_buf_create (ro: SPW_BUF_READ_ONLY); contents start as zeros
 *   s                      spw_step_end (if a step is open), then spw_step_begin
 *   a <id>:<mode> ...      spw_acquire every listed buffer (r READ, w WRITE, rw READ_WRITE), one
 *                          host callback via spw_launch_host standing in for the kernel, then
 *                          spw_release each, in the order listed
 *   f <id>                 spw_buf_destroy
 * After a buffer's last access in the trace its contents are declared dead (spw_discard), as a
 * program does with a buffer it is done with: nothing reads them again, so no policy should
 * write them back. The oracle of tests/data/README.md assumes the same.
 * The callback checks data integrity cheaply: every write stamps the first bytes of the buffer
 * with the operation's number and every read checks the stamp of the last write (0 before any),
 * so a lost write-back or a wrong mapping shows up as a data error (exit status 1). It touches
 * at most 8 bytes per buffer: on emu, device memory is committed only where touched.
 *
 * Per-step bytes: spw_stats_get after each step's spw_step_end (the stream synchronized first, so
 * demand transfers are attributed to the step that caused them); prefetches the engine issues for
 * the next step while the current one runs count in the current one. Steps follow access.c:
 * every 's' starts one, and accesses before the first 's' form an implicit first step.
 *
 * The engine's counters are looked up by name in SPW_STAT_LIST (bytes_h2d and bytes_d2h are
 * required; evictions_clean, evictions_dirty, stalls, stall_ns, prefetch_hits are reported when
 * present, null otherwise),
 * so this file builds whatever the list holds and says clearly when a counter is missing.
 *
 * Exit status: 0 done, 1 the run failed (trace error, engine error, data error), 2 bad usage.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "internal.h"
#include "oracle.h"

/* --budget: a size, or a percentage (up to 1000) of the trace's total buffer bytes */
#define SIM_BUDGET_FLAGS (SPW_SIZE_NONZERO | SPW_SIZE_PERCENT | SPW_SIZE_PERCENT_ANY)

typedef struct sim_opts {
    const char *trace, *budget, *policy;
    uint64_t scale;
    bool json, compare, model_only, summary;
} sim_opts;

/* Figures of one run (engine or model), per step. */
typedef struct sim_result {
    size_t nsteps;
    uint64_t *h2d, *d2h;
    uint64_t bytes_h2d, bytes_d2h;
    int64_t evictions, evictions_clean, evictions_dirty, stalls, stall_ns, prefetch_hits; /* -1: n/a */
    uint64_t data_errors;
    double seconds;
    bool completed; /* the engine ran the whole trace (figures are valid) */
} sim_result;

static void usage(FILE *f) {
    fprintf(f,
            "usage: spillway simulate ACCESS_TRACE --budget SIZE [--policy lru|plan] [--json]\n"
            "                         [--compare] [--model-only] [--scale N] [--summary]\n\n"
            "Runs an access trace ('b <id> <bytes> ro|rw', 's', 'a <id>:r|w|rw ...', 'f <id>')\n"
            "through the offload engine on the emu backend and reports the bytes moved each way\n"
            "per step.\n\n"
            "  --budget S      device budget: 2GiB, 512MiB, ... or N%% of the trace's total buffer\n"
            "                  bytes (the sum over its 'b' lines; not of a device)\n"
            "  --policy P      eviction policy of the engine: lru or plan (default: the option\n"
            "                  'policy' from SPILLWAY_CONF, else the engine's default)\n"
            "  --compare       also run the offline yardsticks on the same trace and budget:\n"
            "                  the oracle (Belady; write back only what is read next), the oracle\n"
            "                  with the last step repeated after the end (no end-of-trace drops),\n"
            "                  and a plain LRU cache; print ratios over the steps after the first\n"
            "  --model-only    only the yardsticks (implies --compare); the engine does not run\n"
            "  --scale N       divide every buffer size and the budget by N (rounded up) to save\n"
            "                  RAM and time; the figures are then of the scaled trace\n"
            "  --json          one JSON object on stdout\n"
            "  --summary       also print the engine's statistics table\n"
            "Options from SPILLWAY_CONF are applied first; the backend is always emu.\n");
}

/* Returns -1 to go on, else the exit status (0 after --help, 2 for bad usage). */
static int parse_args(int argc, char **argv, sim_opts *o) {
    o->scale = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            o->json = true;
        } else if (!strcmp(a, "--compare")) {
            o->compare = true;
        } else if (!strcmp(a, "--model-only")) {
            o->model_only = o->compare = true;
        } else if (!strcmp(a, "--summary")) {
            o->summary = true;
        } else if (spw_cli_is_flag(a, "--budget")) {
            if (!(o->budget = spw_cli_flag_value("spillway simulate", argc, argv, &i, "--budget"))) return 2;
        } else if (spw_cli_is_flag(a, "--policy")) {
            if (!(o->policy = spw_cli_flag_value("spillway simulate", argc, argv, &i, "--policy"))) return 2;
            if (strcmp(o->policy, "lru") && strcmp(o->policy, "plan")) {
                fprintf(stderr, "spillway simulate: bad --policy '%s' (lru or plan)\n", o->policy);
                return 2;
            }
        } else if (spw_cli_is_flag(a, "--scale")) {
            const char *v = spw_cli_flag_value("spillway simulate", argc, argv, &i, "--scale");
            if (!v) return 2;
            if (!strncmp(v, "1/", 2)) v += 2; /* "1/64" reads as 64 */
            char *end;
            unsigned long long n = strtoull(v, &end, 10);
            if (*v < '0' || *v > '9' || *end || n == 0 || n > (1ull << 30)) {
                fprintf(stderr, "spillway simulate: bad --scale '%s' (a divisor 1..2^30)\n", v);
                return 2;
            }
            o->scale = n;
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "spillway simulate: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        } else if (o->trace) {
            fprintf(stderr, "spillway simulate: more than one trace ('%s', '%s')\n", o->trace, a);
            return 2;
        } else {
            o->trace = a;
        }
    }
    if (!o->trace || !o->budget) {
        fprintf(stderr, "spillway simulate: missing %s\n", !o->trace ? "ACCESS_TRACE" : "--budget");
        usage(stderr);
        return 2;
    }
    spw_size_spec b;
    char err[SPW_SIZE_ERR_MAX];
    if (spw__size_parse(o->budget, SIM_BUDGET_FLAGS, &b, err, sizeof err)) {
        fprintf(stderr, "spillway simulate: bad --budget: %s\n", err);
        return 2;
    }
    if (b.is_percent && b.percent > 1000) {
        fprintf(stderr, "spillway simulate: bad --budget '%s': at most 1000%% of the trace's buffers\n", o->budget);
        return 2;
    }
    return -1;
}

/* The budget in bytes for the (already scaled) trace: a percentage of its total buffer bytes,
 * or a size divided by the scale. */
static uint64_t resolve_budget(const sim_opts *o, const spw_access_trace *t) {
    spw_size_spec b = {0};
    spw__size_parse(o->budget, SIM_BUDGET_FLAGS, &b, NULL, 0); /* validated in parse_args */
    if (b.is_percent) return spw__size_resolve_spec(&b, t->total_bytes);
    return b.bytes / o->scale;
}

/* ---- engine counters, by name ---- */

typedef struct stat_field {
    const char *name;
    size_t offset;
} stat_field;

static const stat_field stat_fields[] = {
#define SIM_STAT_FIELD_(name, is_bytes, desc) {#name, offsetof(spw_stats, name)},
    SPW_STAT_LIST(SIM_STAT_FIELD_)
#undef SIM_STAT_FIELD_
};

/* The total of counter `name` in s, or -1 when this build's SPW_STAT_LIST has no such counter. */
static int64_t stat_total(const spw_stats *s, const char *name) {
    for (size_t i = 0; i < sizeof stat_fields / sizeof stat_fields[0]; i++)
        if (!strcmp(stat_fields[i].name, name))
            return ((const spw_counter *)((const char *)s + stat_fields[i].offset))->total;
    return -1;
}

/* ---- the engine run ---- */

typedef struct sim_run sim_run;

/* A callback's argument: which op it stands in for. One per op, so none is reused while queued. */
typedef struct cb_arg {
    sim_run *r;
    size_t op;
} cb_arg;

struct sim_run {
    const char *path;
    const spw_access_trace *t;
    spw_ctx *ctx;
    spw_stream stream;
    spw_buf **bufs;       /* per buffer of the trace; NULL when not created or destroyed */
    void **ptrs;          /* per item: the device pointer acquired for it */
    uint64_t *expect;     /* per item: the stamp a read must find */
    uint64_t *stamp;      /* per buffer: the stamp of the last write enqueued (0: none) */
    cb_arg *cb;           /* per op: the callback's argument */
    size_t *last_op;      /* per buffer: the last 'a' op that lists it (SIZE_MAX: none) */
    size_t errors;        /* written by callbacks only (one stream: one thread), read after sync */
    size_t first_error_op;
    uint64_t first_error_got;
};

/* The stand-in kernel for op *arg: check the stamps it reads, write its own where it writes. */
static void touch(void *arg) {
    sim_run *r = ((cb_arg *)arg)->r;
    size_t i = ((cb_arg *)arg)->op;
    const spw_access_op *op = &r->t->ops[i];
    uint64_t mine = i + 1;
    for (size_t k = 0; k < op->count; k++) {
        const spw_access_item *it = &r->t->items[op->first + k];
        size_t width = r->t->bufs[it->buf].bytes < 8 ? (size_t)r->t->bufs[it->buf].bytes : 8;
        unsigned char *p = r->ptrs[op->first + k];
        if (it->mode != SPW_ACCESS_WRITE && memcmp(p, &r->expect[op->first + k], width) != 0) {
            if (r->errors++ == 0) {
                r->first_error_op = i;
                r->first_error_got = 0;
                memcpy(&r->first_error_got, p, width);
            }
        }
        if (it->mode != SPW_ACCESS_READ) memcpy(p, &mine, width);
    }
}

/* Read the counters and add the movement since *last to step `step`. */
static int close_step(sim_run *r, sim_result *res, size_t step, spw_stats *last) {
    spw_status st = spw_stream_synchronize(r->ctx, r->stream);
    spw_stats now;
    if (st == SPW_OK) st = spw_stats_get(r->ctx, &now);
    if (st != SPW_OK) {
        spw_cli_fail("cannot read the statistics at the end of a step", st);
        return 1;
    }
    res->h2d[step] += (uint64_t)(stat_total(&now, "bytes_h2d") - stat_total(last, "bytes_h2d"));
    res->d2h[step] += (uint64_t)(stat_total(&now, "bytes_d2h") - stat_total(last, "bytes_d2h"));
    *last = now;
    return 0;
}

/* One 'a' op: acquire all, enqueue the stand-in kernel, release all. */
static int run_access(sim_run *r, size_t i) {
    const spw_access_op *op = &r->t->ops[i];
    size_t k = 0;
    spw_status st = SPW_OK;
    for (; k < op->count; k++) {
        const spw_access_item *it = &r->t->items[op->first + k];
        st = spw_acquire(r->bufs[it->buf], r->stream, it->mode, &r->ptrs[op->first + k]);
        if (st != SPW_OK) break;
        r->expect[op->first + k] = r->stamp[it->buf];
        if (it->mode != SPW_ACCESS_READ) r->stamp[it->buf] = i + 1;
    }
    const char *what = "acquiring";
    if (st == SPW_OK) {
        r->cb[i] = (cb_arg){.r = r, .op = i};
        st = spw_launch_host(r->ctx, r->stream, touch, &r->cb[i]);
        what = "the stand-in kernel over";
    }
    spw_status fail = st;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", spw_last_error());
    for (size_t j = 0; j < k; j++) {
        uint32_t b = r->t->items[op->first + j].buf;
        spw_status rs = spw_release(r->bufs[b], r->stream);
        if (rs == SPW_OK && fail == SPW_OK && r->last_op[b] == i) {
            rs = spw_discard(r->bufs[b]);
            if (rs != SPW_OK) what = "discarding";
        } else if (rs != SPW_OK) {
            what = "releasing";
        }
        if (rs != SPW_OK && fail == SPW_OK) {
            fail = rs;
            snprintf(msg, sizeof msg, "%s", spw_last_error());
        }
    }
    if (fail == SPW_OK) return 0;
    const spw_access_item *it = &r->t->items[op->first + (k < op->count ? k : 0)];
    char b[64];
    fprintf(stderr, "spillway simulate: %s:%zu: %s buffer %llu (%s, mode %s) failed: %s: %s\n",
            r->path, op->line, what, (unsigned long long)r->t->bufs[it->buf].id,
            spw__fmt_bytes(b, sizeof b, r->t->bufs[it->buf].bytes),
            it->mode == SPW_ACCESS_READ ? "r" : it->mode == SPW_ACCESS_WRITE ? "w" : "rw",
            spw_status_str(fail), msg);
    return 1;
}

/* Make `key` at least `want` bytes unless it is already set larger (or is not a plain size). */
static spw_status raise_size_option(spw_config *cfg, const char *key, uint64_t want) {
    char cur[64], val[32];
    size_t have;
    if (spw_config_get(cfg, key, cur, sizeof cur) != SPW_OK) return SPW_OK; /* no such option */
    if (spw_parse_size(cur, &have) != SPW_OK || have >= want) return SPW_OK;
    snprintf(val, sizeof val, "%llu", (unsigned long long)want);
    return spw_config_set(cfg, key, val);
}

static int engine_configure(const sim_opts *o, const spw_access_trace *t, uint64_t budget,
                            spw_config *cfg, char *policy, size_t plen) {
    char val[32];
    spw_status st;
    snprintf(val, sizeof val, "%llu", (unsigned long long)budget);
    if ((st = spw_config_from_env(cfg)) != SPW_OK) {
        spw_cli_fail("bad SPILLWAY_CONF", st);
        return 2;
    }
    if ((st = spw_config_set(cfg, "backend", "emu")) != SPW_OK ||
        (st = spw_config_set(cfg, "budget", val)) != SPW_OK) {
        spw_cli_fail("cannot configure the emu backend and budget", st);
        return 2;
    }
    if (o->policy && (st = spw_config_set(cfg, "policy", o->policy)) != SPW_OK) {
        spw_cli_fail("cannot set option 'policy' (is the offload engine built in?)", st);
        return 2;
    }
    /* The emulated device must hold the budget, and the pinned host pool every buffer at once
     * (plus a quarter for slab rounding): the trace, not the host, is what is being tested. */
    uint64_t host = t->peak_live_bytes + t->peak_live_bytes / 4 + 64 * SPW_MiB;
    if ((st = raise_size_option(cfg, "emu_capacity", budget + 64 * SPW_MiB)) != SPW_OK ||
        (st = raise_size_option(cfg, "host_budget", host)) != SPW_OK) {
        spw_cli_fail("cannot size the emulated device or the host pool", st);
        return 2;
    }
    if (spw_config_get(cfg, "policy", policy, plen) != SPW_OK) snprintf(policy, plen, "?");
    return 0;
}

/* Run the whole trace through the engine. Returns the exit status (0, 1 or 2). */
/* The per-buffer, per-item and per-op arrays of a run; 1 (said) when host memory runs out. */
static int run_alloc(sim_run *r) {
    const spw_access_trace *t = r->t;
    r->bufs = calloc(t->nbufs ? t->nbufs : 1, sizeof *r->bufs);
    r->ptrs = calloc(t->nitems ? t->nitems : 1, sizeof *r->ptrs);
    r->expect = calloc(t->nitems ? t->nitems : 1, sizeof *r->expect);
    r->stamp = calloc(t->nbufs ? t->nbufs : 1, sizeof *r->stamp);
    r->cb = calloc(t->nops ? t->nops : 1, sizeof *r->cb);
    r->last_op = malloc((t->nbufs ? t->nbufs : 1) * sizeof *r->last_op);
    if (r->last_op) {
        for (size_t b = 0; b < t->nbufs; b++) r->last_op[b] = SIZE_MAX;
        for (size_t i = 0; i < t->nops; i++)
            if (t->ops[i].kind == 'a')
                for (size_t k = 0; k < t->ops[i].count; k++) r->last_op[t->items[t->ops[i].first + k].buf] = i;
    }
    if (!r->bufs || !r->ptrs || !r->expect || !r->stamp || !r->cb || !r->last_op) {
        fprintf(stderr, "spillway simulate: out of host memory for %zu buffers\n", t->nbufs);
        return 1;
    }
    return 0;
}

/* Print "trace:LINE: " and the failure of `what`; returns 1. */
static int op_fail(const spw_access_op *op, const char *what, spw_status st) {
    fprintf(stderr, "spillway simulate: trace:%zu: ", op->line);
    spw_cli_fail(what, st);
    return 1;
}

/* Every op of the trace through the engine, steps closed into res as they end; *last holds the
 * statistics at the end of the last closed step. */
static int run_ops(sim_run *r, sim_result *res, spw_stats *last) {
    const spw_access_trace *t = r->t;
    spw_status st;
    bool step_open = false; /* spw_step_begin called and not ended */
    long cur = -1;          /* step being recorded */
    for (size_t i = 0; i < t->nops; i++) {
        const spw_access_op *op = &t->ops[i];
        if (op->kind == 's' || (op->kind == 'a' && cur < 0)) {
            if (step_open && (st = spw_step_end(r->ctx)) != SPW_OK) return op_fail(op, "ending the step", st);
            step_open = false;
            if (cur >= 0 && close_step(r, res, (size_t)cur, last) != 0) return 1;
            if (op->kind == 's' && (st = spw_step_begin(r->ctx)) != SPW_OK)
                return op_fail(op, "beginning a step", st);
            step_open = op->kind == 's';
            cur = (long)op->step;
            if (op->kind == 's') continue;
        }
        if (op->kind == 'a') {
            if (run_access(r, i) != 0) return 1;
        } else if (op->kind == 'b') {
            unsigned flags = t->bufs[op->buf].read_only ? SPW_BUF_READ_ONLY : 0;
            if ((st = spw_buf_create(r->ctx, t->bufs[op->buf].bytes, flags, &r->bufs[op->buf]))) {
                char b[64];
                fprintf(stderr, "spillway simulate: trace:%zu: buffer %llu (%s): ", op->line,
                        (unsigned long long)t->bufs[op->buf].id,
                        spw__fmt_bytes(b, sizeof b, t->bufs[op->buf].bytes));
                spw_cli_fail("creating the buffer", st);
                return 1;
            }
        } else if (op->kind == 'f') {
            st = spw_buf_destroy(r->bufs[op->buf]);
            r->bufs[op->buf] = NULL;
            if (st != SPW_OK) return op_fail(op, "destroying the buffer", st);
        }
    }
    if (step_open && (st = spw_step_end(r->ctx)) != SPW_OK) {
        spw_cli_fail("spw_step_end at the end of the trace", st);
        return 1;
    }
    if (cur >= 0 && close_step(r, res, (size_t)cur, last) != 0) return 1;
    return 0;
}

/* The run's totals: statistics from `first` to `last`, and the data check. */
static void run_collect(const sim_run *r, const spw_stats *first, const spw_stats *last, sim_result *res) {
    res->bytes_h2d = (uint64_t)(stat_total(last, "bytes_h2d") - stat_total(first, "bytes_h2d"));
    res->bytes_d2h = (uint64_t)(stat_total(last, "bytes_d2h") - stat_total(first, "bytes_d2h"));
    res->evictions_clean = stat_total(last, "evictions_clean");
    res->evictions_dirty = stat_total(last, "evictions_dirty");
    res->evictions = res->evictions_clean < 0 || res->evictions_dirty < 0
                         ? -1 : res->evictions_clean + res->evictions_dirty;
    res->stalls = stat_total(last, "stalls");
    res->stall_ns = stat_total(last, "stall_ns");
    res->prefetch_hits = stat_total(last, "prefetch_hits");
    res->data_errors = r->errors;
    if (r->errors) {
        const spw_access_op *op = &r->t->ops[r->first_error_op];
        fprintf(stderr, "spillway simulate: DATA ERROR: %zu reads found stale or lost data; the "
                        "first at trace line %zu (found stamp %llu)\n", r->errors, op->line,
                (unsigned long long)r->first_error_got);
    }
}

/* Everything a run made, whatever state it stopped in; rc, or 1 if the teardown failed. */
static int run_free(sim_run *r, int rc) {
    spw_status st;
    if (r->ctx && r->stream) spw_stream_synchronize(r->ctx, r->stream);
    for (size_t b = 0; r->ctx && r->bufs && b < r->t->nbufs; b++)
        if (r->bufs[b] && (st = spw_buf_destroy(r->bufs[b])) != SPW_OK) {
            spw_cli_fail("cannot destroy a buffer at the end", st);
            rc = rc ? rc : 1;
        }
    if (r->ctx && r->stream && (st = spw_stream_destroy(r->ctx, r->stream)) != SPW_OK) rc = rc ? rc : 1;
    if (r->ctx && (st = spw_ctx_destroy(r->ctx)) != SPW_OK) {
        spw_cli_fail("cannot destroy the context", st);
        rc = rc ? rc : 1;
    }
    free(r->bufs);
    free(r->ptrs);
    free(r->expect);
    free(r->stamp);
    free(r->cb);
    free(r->last_op);
    return rc;
}

static int run_engine(const sim_opts *o, const spw_access_trace *t, uint64_t budget,
                      sim_result *res, char *policy, size_t plen, FILE *summary) {
    sim_run r = {.path = o->trace, .t = t};
    spw_config *cfg = NULL;
    spw_status st;
    int rc = 1;
    if (stat_total(&(spw_stats){0}, "bytes_h2d") < 0 || stat_total(&(spw_stats){0}, "bytes_d2h") < 0) {
        fprintf(stderr, "spillway simulate: this build's statistics (SPW_STAT_LIST) have no "
                        "bytes_h2d/bytes_d2h counters: is the offload engine built in? "
                        "(--model-only runs the yardsticks without it)\n");
        return 1;
    }
    if (run_alloc(&r) != 0) goto out;
    if ((st = spw_config_create(&cfg)) != SPW_OK) {
        spw_cli_fail("cannot create a configuration", st);
        goto out;
    }
    if ((rc = engine_configure(o, t, budget, cfg, policy, plen)) != 0) goto out;
    rc = 1;
    if ((st = spw_ctx_create(cfg, &r.ctx)) != SPW_OK) {
        spw_cli_fail("cannot create the emu context", st);
        goto out;
    }
    if ((st = spw_stream_create(r.ctx, &r.stream)) != SPW_OK) {
        spw_cli_fail("cannot create a stream", st);
        goto out;
    }
    spw_stats first, last;
    if ((st = spw_stats_get(r.ctx, &first)) != SPW_OK) {
        spw_cli_fail("cannot read the statistics", st);
        goto out;
    }
    last = first;
    uint64_t t0 = spw__now_ns();
    if (run_ops(&r, res, &last) != 0) goto out;
    res->seconds = (double)(spw__now_ns() - t0) / 1e9;
    run_collect(&r, &first, &last, res);
    if (summary) {
        if (!o->json) fputc('\n', summary);
        spw_summary(r.ctx, summary);
    }
    res->completed = true;
    rc = r.errors ? 1 : 0;
out:
    spw_config_destroy(cfg);
    return run_free(&r, rc);
}

/* ---- reporting ---- */

static uint64_t moved_from(const sim_result *r, size_t from) {
    uint64_t sum = 0;
    for (size_t s = from; s < r->nsteps; s++) sum += r->h2d[s] + r->d2h[s];
    return sum;
}

static void json_str(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    putchar('"');
}

static void json_array(const char *key, const uint64_t *v, size_t n) {
    printf(", \"%s\": [", key);
    for (size_t i = 0; i < n; i++) printf("%s%llu", i ? ", " : "", (unsigned long long)v[i]);
    putchar(']');
}

static void json_i64(const char *key, int64_t v) {
    if (v < 0) printf(", \"%s\": null", key);
    else printf(", \"%s\": %lld", key, (long long)v);
}

static void json_ratio(const char *key, uint64_t num, uint64_t den) {
    if (den == 0) printf(", \"%s\": null", key);
    else printf(", \"%s\": %.6f", key, (double)num / (double)den);
}

static const char *const model_names[3] = {"oracle", "oracle_repeat", "lru_model"};

static void print_json(const sim_opts *o, const spw_access_trace *t, uint64_t budget,
                       const char *policy, const sim_result *e, const spw_model_result *m) {
    printf("{\"trace\": ");
    json_str(o->trace);
    printf(", \"backend\": \"emu\", \"policy\": ");
    json_str(o->model_only ? "none" : policy);
    printf(", \"budget_bytes\": %llu, \"scale\": %llu, \"steps\": %zu, \"buffers\": %zu"
           ", \"records\": %zu, \"accesses\": %zu, \"trace_total_bytes\": %llu"
           ", \"trace_peak_live_bytes\": %llu",
           (unsigned long long)budget, (unsigned long long)o->scale, t->nsteps, t->nbufs,
           t->nops, t->nitems, (unsigned long long)t->total_bytes,
           (unsigned long long)t->peak_live_bytes);
    uint64_t e_after = 0;
    if (!o->model_only) {
        e_after = moved_from(e, 1);
        printf(", \"bytes_h2d\": %llu, \"bytes_d2h\": %llu", (unsigned long long)e->bytes_h2d,
               (unsigned long long)e->bytes_d2h);
        json_array("per_step_h2d", e->h2d, e->nsteps);
        json_array("per_step_d2h", e->d2h, e->nsteps);
        printf(", \"moved_after_first\": %llu", (unsigned long long)e_after);
        json_i64("evictions", e->evictions);
        json_i64("evictions_clean", e->evictions_clean);
        json_i64("evictions_dirty", e->evictions_dirty);
        json_i64("stalls", e->stalls);
        json_i64("stall_ns", e->stall_ns);
        json_i64("prefetch_hits", e->prefetch_hits);
        printf(", \"data_errors\": %llu, \"seconds\": %.6f", (unsigned long long)e->data_errors,
               e->seconds);
    }
    for (int k = 0; o->compare && k < 3; k++) {
        char key[64];
        uint64_t after = spw__model_moved_from(&m[k], 1);
        snprintf(key, sizeof key, "%s_per_step_h2d", model_names[k]);
        json_array(key, m[k].h2d, m[k].nsteps);
        snprintf(key, sizeof key, "%s_per_step_d2h", model_names[k]);
        json_array(key, m[k].d2h, m[k].nsteps);
        printf(", \"%s_after_first\": %llu", model_names[k], (unsigned long long)after);
        if (!o->model_only) {
            snprintf(key, sizeof key, "ratio_to_%s_after_first", model_names[k]);
            json_ratio(key, e_after, after);
        }
    }
    putchar('}');
    putchar('\n');
}

static double mib(uint64_t b) { return (double)b / (double)SPW_MiB; }

static void print_human(const sim_opts *o, const spw_access_trace *t, uint64_t budget,
                        const char *policy, const sim_result *e, const spw_model_result *m) {
    char b1[64], b2[64];
    printf("trace     %s: %zu buffer%s (%s in all, peak live %s), %zu step%s%s\n", o->trace,
           t->nbufs, t->nbufs == 1 ? "" : "s", spw__fmt_bytes(b1, sizeof b1, t->total_bytes),
           spw__fmt_bytes(b2, sizeof b2, t->peak_live_bytes), t->nsteps, t->nsteps == 1 ? "" : "s",
           o->scale > 1 ? " (sizes scaled down)" : "");
    /* how the budget came about: a share of the (scaled) trace, or the size given over the scale */
    size_t blen = strlen(o->budget);
    printf("budget    %s", spw__fmt_bytes(b1, sizeof b1, budget));
    if (blen && o->budget[blen - 1] == '%') printf(" = %s of the buffer bytes", o->budget);
    else if (o->scale > 1) printf(" = %s / %llu", o->budget, (unsigned long long)o->scale);
    printf(", backend emu, policy %s\n", o->model_only ? "(engine not run)" : policy);
    if (o->scale > 1) printf("scale     every size divided by %llu\n", (unsigned long long)o->scale);
    printf("\n%5s", "step");
    if (!o->model_only) printf(" %12s %12s", "engine h2d", "engine d2h");
    if (o->compare) printf(" %12s %12s %12s %12s %12s %12s", "oracle h2d", "oracle d2h",
                           "orep h2d", "orep d2h", "lru h2d", "lru d2h");
    printf("   (MiB)\n");
    for (size_t s = 0; s < t->nsteps; s++) {
        printf("%5zu", s);
        if (!o->model_only) printf(" %12.1f %12.1f", mib(e->h2d[s]), mib(e->d2h[s]));
        for (int k = 0; o->compare && k < 3; k++)
            printf(" %12.1f %12.1f", mib(m[k].h2d[s]), mib(m[k].d2h[s]));
        putchar('\n');
    }
    uint64_t e_after = o->model_only ? 0 : moved_from(e, 1);
    printf("\nmoved after the first step (h2d + d2h):\n");
    if (!o->model_only)
        printf("  engine         %12.1f MiB\n", mib(e_after));
    for (int k = 0; o->compare && k < 3; k++) {
        uint64_t after = spw__model_moved_from(&m[k], 1);
        printf("  %-14s %12.1f MiB", model_names[k], mib(after));
        if (!o->model_only && after) printf("   engine / %s = %.3f", model_names[k],
                                            (double)e_after / (double)after);
        putchar('\n');
    }
    if (!o->model_only) {
        printf("\ntotal     h2d %s, d2h %s in %.3f s\n", spw__fmt_bytes(b1, sizeof b1, e->bytes_h2d),
               spw__fmt_bytes(b2, sizeof b2, e->bytes_d2h), e->seconds);
        printf("evictions ");
        if (e->evictions < 0) printf("n/a");
        else printf("%lld (%lld clean, %lld written back)", (long long)e->evictions,
                    (long long)e->evictions_clean, (long long)e->evictions_dirty);
        printf("; stalls %s; prefetch hits %s; data errors %llu\n",
               e->stalls < 0 ? "n/a" : (snprintf(b1, sizeof b1, "%lld (%.3f ms)", (long long)e->stalls,
                                                 (double)(e->stall_ns > 0 ? e->stall_ns : 0) / 1e6), b1),
               e->prefetch_hits < 0 ? "n/a" : (snprintf(b2, sizeof b2, "%lld", (long long)e->prefetch_hits), b2),
               (unsigned long long)e->data_errors);
    }
    if (o->compare)
        printf("\noracle: Belady, writes back only what is read next; oracle_repeat: the same with "
               "the last step\nrepeated after the end; lru_model: a plain LRU cache (see "
               "src/oracle.c)\n");
}

int spw_cmd_simulate(int argc, char **argv) {
    sim_opts o = {0};
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0) return rc;

    spw_access_trace t = {0};
    spw_status st = spw__access_load(o.trace, &t);
    if (st != SPW_OK) {
        spw_cli_fail("cannot load the access trace", st);
        return 1;
    }
    spw__access_scale(&t, o.scale);
    uint64_t budget = resolve_budget(&o, &t);
    spw_model_result m[3] = {{0}};
    sim_result e = {.nsteps = t.nsteps};
    char policy[32] = "?";
    rc = 1;
    if (budget == 0) {
        fprintf(stderr, "spillway simulate: budget '%s' is 0 bytes for this trace%s\n", o.budget,
                o.scale > 1 ? " at this scale" : "");
        rc = 2;
        goto out;
    }
    static const spw_model_kind kinds[3] = {SPW_MODEL_ORACLE, SPW_MODEL_ORACLE_REPEAT,
                                            SPW_MODEL_LRU};
    for (int k = 0; o.compare && k < 3; k++) {
        if ((st = spw__model_run(&t, budget, kinds[k], &m[k])) != SPW_OK) {
            char what[128];
            snprintf(what, sizeof what, "%s: model %s", o.trace, model_names[k]);
            spw_cli_fail(what, st);
            goto out;
        }
    }
    if (!o.model_only) {
        size_t n = t.nsteps ? t.nsteps : 1;
        e.h2d = calloc(n, sizeof *e.h2d);
        e.d2h = calloc(n, sizeof *e.d2h);
        if (!e.h2d || !e.d2h) {
            fprintf(stderr, "spillway simulate: out of host memory\n");
            goto out;
        }
        rc = run_engine(&o, &t, budget, &e, policy, sizeof policy,
                        o.summary ? (o.json ? stderr : stdout) : NULL);
        if (!e.completed) goto out; /* failed before the end: nothing to report */
    }
    if (o.json)
        print_json(&o, &t, budget, policy, &e, m);
    else
        print_human(&o, &t, budget, policy, &e, m);
    if (o.model_only) rc = 0;
out:
    for (int k = 0; k < 3; k++) spw__model_free(&m[k]);
    free(e.h2d);
    free(e.d2h);
    spw__access_free(&t);
    return rc;
}
