/*
 * spillway probe [--device N] [--quick] [--json] [--max-mem SIZE] [--backend auto|cuda|emu]
 *
 * Arguments, backend choice, the plan (sizes and repetitions), progress on stderr, output and
 * the exit status: 0 all measured and validated, 1 a failure of the work (validation, CUDA error,
 * self-test on a real GPU, no device for --backend cuda), 2 bad usage.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "probe.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: spillway probe [--device N] [--quick] [--json] [--max-mem SIZE] [--backend auto|cuda|emu]\n"
            "\n"
            "Measures the GPU's memory, its copy paths and whether device allocations silently land in\n"
            "system memory, then recommends a budget.\n"
            "\n"
            "  --device N        CUDA device index (default 0)\n"
            "  --quick           smaller transfers and fewer repetitions (under 5 s on a large GPU)\n"
            "  --json            one JSON object with every figure on stdout, instead of the table\n"
            "  --max-mem SIZE    device memory the fallback scan may allocate: a size (8GiB, 512MiB)\n"
            "                    or a percentage of free memory (50%%); default 90%% of free, never\n"
            "                    more than free\n"
            "  --backend B       auto (cuda when a device is present, else emu), cuda, or emu\n");
}

static int bad_usage(const char *fmt, const char *arg) {
    fputs("spillway probe: ", stderr);
    fprintf(stderr, fmt, arg);
    fputs("\n(see 'spillway probe --help')\n", stderr);
    return 2;
}

/* ---- progress: stderr only, only on a terminal, only for a step running over a second ---- */

typedef struct progress {
    bool tty;
    bool shown;
    char step[96];
    uint64_t t0;
} progress;

static void on_progress(void *u, const char *step, size_t i, size_t n) {
    progress *p = u;
    if (!step) {
        if (p->shown) fputs("\r\033[K", stderr);
        p->shown = false;
        return;
    }
    uint64_t now = spw__now_ns();
    if (strcmp(p->step, step) != 0) {
        snprintf(p->step, sizeof p->step, "%s", step);
        p->t0 = now;
    }
    if (!p->tty || now - p->t0 < 1000000000ull) return;
    if (n > 1)
        fprintf(stderr, "\r\033[Kspillway probe: %s (%zu/%zu)...", step, i + 1 < n ? i + 1 : n, n);
    else
        fprintf(stderr, "\r\033[Kspillway probe: %s...", step);
    fflush(stderr);
    p->shown = true;
}

/* ---- plans ---- */

static spw_probe_plan plan_for(bool emu, bool quick) {
    spw_probe_plan p;
    memset(&p, 0, sizeof p);
    p.max_mem_fraction = 0.9;
    p.windows_per_chunk = 3;
    p.lat_small_bytes = SPW_MiB;
    if (!emu) {
        /* 1 GiB transfers reach the link's plateau; 256 MiB is within a percent of it */
        p.xfer_bytes = quick ? 256 * SPW_MiB : SPW_GiB;
        p.reps_pinned = quick ? 5 : 10;
        p.reps_pageable = quick ? 3 : 5;
        p.reps_d2d = quick ? 10 : 20;
        p.reps_lat = quick ? 5 : 9;
        p.reps_host_lat = quick ? 3 : 5;
        p.host_lat_bytes = quick ? 16 * SPW_MiB : 64 * SPW_MiB;
        /* at most ~64 chunks keeps the scan well under a second on a 141 GiB device */
        p.min_chunk = SPW_GiB;
        p.chunk_divisor = 64;
        p.window_bytes = quick ? 64 * SPW_MiB : 256 * SPW_MiB;
        p.reps_window = quick ? 2 : 3;
        p.touch_whole_chunk = true;
        p.margin_bytes = 256 * SPW_MiB;
        p.selftest_bytes = quick ? 64 * SPW_MiB : 256 * SPW_MiB;
        /* enough to see a limit such as WSL2's (hundreds of MiB to a few GiB) and whether a
         * model's weights can be pinned, at a few hundred milliseconds a GiB */
        p.pin_chunk = 256 * SPW_MiB;
        p.pin_cap = quick ? 4 * SPW_GiB : 16 * SPW_GiB;
    } else {
        /* emu: host RAM is what gets touched, and host<->device copies crawl at the emulated
         * link's rate: keep everything small */
        p.xfer_bytes = quick ? 4 * SPW_MiB : 32 * SPW_MiB;
        p.reps_pinned = quick ? 3 : 5;
        p.reps_pageable = quick ? 2 : 3;
        p.reps_d2d = quick ? 3 : 5;
        p.reps_lat = quick ? 3 : 5;
        p.reps_host_lat = quick ? 2 : 3;
        p.host_lat_bytes = quick ? 4 * SPW_MiB : 16 * SPW_MiB;
        p.lat_small_bytes = SPW_MiB;
        p.min_chunk = 16 * SPW_MiB;
        p.chunk_divisor = 16;
        p.window_bytes = quick ? 2 * SPW_MiB : 8 * SPW_MiB;
        p.reps_window = 3;
        p.touch_whole_chunk = false;
        p.margin_bytes = 64 * SPW_MiB;
        p.selftest_bytes = quick ? 2 * SPW_MiB : 8 * SPW_MiB;
        p.pin_chunk = 4 * SPW_MiB;
        p.pin_cap = quick ? 32 * SPW_MiB : 128 * SPW_MiB;
    }
    /* never pin more than half of the memory the host has available */
    size_t avail = spw_probe_host_available();
    if (avail && p.pin_chunk && p.pin_cap > avail / 2) p.pin_cap = avail / 2 / p.pin_chunk * p.pin_chunk;
    return p;
}

/* "N%" with 0 < N <= 100 into *pct, or a positive size into *bytes. */
static bool parse_max_mem(const char *s, size_t *bytes, double *pct) {
    uint64_t b = 0;
    double p = 0;
    if (spw_parse_budget(s, 0, &b, &p) != SPW_OK) return false;
    *pct = p / 100.0;
    *bytes = p > 0 ? 0 : (size_t)b;
    return true;
}

static bool parse_device(const char *s, int *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < 0 || v > 4096) return false;
    *out = (int)v;
    return true;
}

int spw_cmd_probe(int argc, char **argv) {
    uint64_t t_start = spw__now_ns();
    int device = 0;
    bool quick = false, json = false;
    size_t max_mem = 0;
    double max_frac = 0;
    const char *backend = "auto";

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = NULL;
        /* options taking a value accept "--opt value" and "--opt=value" */
        static const char *const with_value[] = {"--device", "--max-mem", "--backend"};
        const char *opt = a;
        char optbuf[32];
        for (size_t k = 0; k < 3; k++) {
            size_t l = strlen(with_value[k]);
            if (!strncmp(a, with_value[k], l) && (a[l] == '\0' || a[l] == '=')) {
                if (a[l] == '=') {
                    val = a + l + 1;
                } else {
                    if (i + 1 >= argc) return bad_usage("%s needs a value", a);
                    val = argv[++i];
                }
                snprintf(optbuf, sizeof optbuf, "%s", with_value[k]);
                opt = optbuf;
            }
        }
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(opt, "--quick")) {
            quick = true;
        } else if (!strcmp(opt, "--json")) {
            json = true;
        } else if (!strcmp(opt, "--device")) {
            if (!parse_device(val, &device))
                return bad_usage("--device: expected a device index (an integer >= 0), got '%s'", val);
        } else if (!strcmp(opt, "--max-mem")) {
            if (!parse_max_mem(val, &max_mem, &max_frac))
                return bad_usage("--max-mem: expected a size greater than 0 such as 8GiB or 512MiB, or a "
                                 "percentage of free memory in (0, 100] such as 50%%, got '%s'",
                                 val);
        } else if (!strcmp(opt, "--backend")) {
            if (strcmp(val, "auto") && strcmp(val, "cuda") && strcmp(val, "emu"))
                return bad_usage("--backend: expected auto, cuda or emu, got '%s'", val);
            backend = val;
        } else {
            return bad_usage("unknown argument '%s'", a);
        }
    }

    spw_probe_result r;
    spw_probe_result_init(&r);
    r.device = device;
    r.quick = quick;

    /* choose the backend */
    bool use_cuda = false;
#ifdef SPW_HAVE_CUDA
    char why[256] = "";
    if (strcmp(backend, "emu") != 0) {
        int count = spw_probe_cuda_count(why, sizeof why);
        if (count > 0) {
            if (device >= count) {
                fprintf(stderr, "spillway probe: --device %d: the CUDA runtime sees %d device%s (0..%d)\n", device,
                        count, count == 1 ? "" : "s", count - 1);
                return 2;
            }
            use_cuda = true;
        } else if (!strcmp(backend, "cuda")) {
            fprintf(stderr, "spillway probe: --backend cuda: no usable CUDA device: %s\n", why);
            return 1;
        } else {
            snprintf(r.backend_note, sizeof r.backend_note, "backend auto: no CUDA device (%.160s), so the emu backend", why);
        }
    }
#else
    if (!strcmp(backend, "cuda")) {
        fprintf(stderr, "spillway probe: --backend cuda: this spillway was built without CUDA\n");
        return 1;
    }
    if (!strcmp(backend, "auto"))
        snprintf(r.backend_note, sizeof r.backend_note, "backend auto: built without CUDA, so the emu backend");
#endif
    if (!use_cuda && device != 0) {
        fprintf(stderr, "spillway probe: --device %d: the emu backend has one device (0)\n", device);
        return 2;
    }
    r.backend = use_cuda ? "cuda" : "emu";
    r.emulated = !use_cuda;

    const spw_probe_ops *ops = NULL;
    spw_probe_dev *dev = NULL;
    spw_status st;
#ifdef SPW_HAVE_CUDA
    st = use_cuda ? spw_probe_cuda_open(&r, &ops, &dev) : spw_probe_emu_open(&r, &ops, &dev);
#else
    st = spw_probe_emu_open(&r, &ops, &dev);
#endif
    if (st) {
        spw_cli_fail(use_cuda ? "probe: opening the CUDA device" : "probe: opening the emu backend", st);
        return st == SPW_ERR_INVALID_ARGUMENT ? 2 : 1;
    }

    spw_probe_plan plan = plan_for(!use_cuda, quick);
    plan.max_mem = max_mem;
    if (max_frac > 0) plan.max_mem_fraction = max_frac;
    progress pr = {.tty = isatty(STDERR_FILENO) == 1};
    spw_probe_measure(ops, dev, &plan, &r, on_progress, &pr);
    on_progress(&pr, NULL, 0, 0);
#ifdef SPW_HAVE_CUDA
    if (use_cuda)
        spw_probe_cuda_close(dev);
    else
        spw_probe_emu_close(dev);
#else
    spw_probe_emu_close(dev);
#endif

    r.elapsed_s = (double)(spw__now_ns() - t_start) / 1e9;
    if (json)
        spw_probe_print_json(&r, stdout);
    else
        spw_probe_print_table(&r, stdout);
    fflush(stdout);
    int rc = r.ok ? 0 : 1;
    if (!r.ok) fprintf(stderr, "spillway probe: FAILED (see the report: a validation, a device call or the self-test)\n");
    spw_probe_result_free(&r);
    return rc;
}
