/*
 * A denoiser step on the emu backend: units of many sizes (a UNet's partition, scaled), each
 * acquired, "computed" (a host function on the caller's stream that sleeps in proportion to the
 * unit's bytes) and released, with host time spent between units as a launch-bound caller
 * does. Prints per pipeline the steady step time against its bounds (the kernels alone, the
 * host alone, the link alone for the bytes moved), trims and uploads a step. A development probe
 * (internal headers, emu only), not a test or a benchmark of record:
 *   gcc -std=gnu11 -O1 -D_GNU_SOURCE -Isrc -Iinclude -I/usr/local/cuda/include \
 *       bench/dev/sim_units.c build/libspillway_static.a -L/usr/local/cuda/lib64 -lcudart \
 *       -lpthread -lz -lm -ldl -Wl,-rpath,/usr/local/cuda/lib64 -o /tmp/sim_units
 *   /tmp/sim_units [-b BUDGET_FRACTION] [-m MODE] [-k KERNEL_MS] [-h HOST_MS] [-l LINK_GBPS] [-c CONF] [SIZES]
 *     MODE: auto (the policy's timing), -1 no prefetch, 0 double buffer, -2 static split, -3 split
 *     with one slot; SIZES: MiB per unit in order of use, comma separated (default: a UNet's
 *     pattern); KERNEL_MS, HOST_MS: a step's kernel and host time, spread over the units by bytes
 *     and evenly.
 *   /tmp/sim_units -t TIMELINE [-s BYTES_DIV] [-l LINK_GBPS] [-m MODE] [-h HOST_MS] [-c CONF]
 *     replays a recorded resident step (bench/dev/schedule_sim.py --dump): each interval
 *     acquires the units it needs, "computes" for its recorded time (spinning on the compute
 *     stream's thread) and releases them; bytes divided by BYTES_DIV, the emulated link a whole
 *     LINK_GBPS (the emulator's grain), and the times stretched by what that makes of the
 *     recorded link, so that the step compares with schedule_sim.py's ("unscaled").
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "probe_ctx.h"

#define MiB ((double)(1 << 20))

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void sleep_ms(void *arg) {
    double ms = *(double *)arg;
    struct timespec t = {(time_t)(ms / 1e3), (long)(ms * 1e6) % 1000000000L};
    nanosleep(&t, NULL);
}

static void spin_ms(double ms) {
    double end = now_ms() + ms;
    while (now_ms() < end) {
    }
}

static void spin_fn(void *arg) { spin_ms(*(double *)arg); }

/* A recorded timeline (schedule_sim.py --dump): "room BYTES", "link BYTES_PER_MS", a "size BYTES"
 * line per unit, then an "item MS U..." line per interval (the units it needs). */
enum { MAX_UNITS = 1024, MAX_ITEMS = 4096, MAX_NEED = 8 };
static double tl_room, tl_link, tl_size[MAX_UNITS], tl_ms[MAX_ITEMS];
static int tl_units, tl_items, tl_nneed[MAX_ITEMS], tl_need[MAX_ITEMS][MAX_NEED];

static int read_timeline(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return perror(path), -1;
    char word[16];
    while (fscanf(f, "%15s", word) == 1) {
        if (!strcmp(word, "room")) {
            if (fscanf(f, "%lf", &tl_room) != 1) break;
        } else if (!strcmp(word, "link")) {
            if (fscanf(f, "%lf", &tl_link) != 1) break;
        } else if (!strcmp(word, "size") && tl_units < MAX_UNITS) {
            if (fscanf(f, "%lf", &tl_size[tl_units++]) != 1) break;
        } else if (!strcmp(word, "item") && tl_items < MAX_ITEMS) {
            int i = tl_items++;
            if (fscanf(f, "%lf", &tl_ms[i]) != 1) break;
            int c;
            while ((c = fgetc(f)) != '\n' && c != EOF) {
                if (c == ' ' || c == '\t') continue;
                ungetc(c, f);
                int u;
                if (fscanf(f, "%d", &u) != 1 || tl_nneed[i] >= MAX_NEED || u < 0 || u >= tl_units) {
                    fprintf(stderr, "%s: a bad item %d\n", path, i);
                    fclose(f);
                    return -1;
                }
                tl_need[i][tl_nneed[i]++] = u;
            }
        }
    }
    fclose(f);
    if (!tl_units || !tl_items || tl_room <= 0 || tl_link <= 0) return fprintf(stderr, "%s: incomplete\n", path), -1;
    return 0;
}

/* The timeline's steps on the engine: returns nonzero on a library error. */
static int replay(const char *mode_s, double div, double gbps, double host_ms, const char *extra) {
    bool tune = !strcmp(mode_s, "auto");
    double mul = tl_link / 1e6 / div / gbps;
    double total = 0, res_ms = 0;
    for (int i = 0; i < tl_units; i++) total += tl_size[i] / div;
    for (int i = 0; i < tl_items; i++) res_ms += tl_ms[i] * mul;
    char conf[512];
    snprintf(conf, sizeof conf, "backend=emu,budget=%zu,policy=plan,prefetch=on,emu_link_gbps=%.0f,prefetch_early=%s%s%s",
             (size_t)(tl_room / div), gbps, tune ? "auto" : "0", *extra ? "," : "", extra);
    spw_ctx *ctx = probe_ctx("sim_units", conf, tune, tune ? 0 : atoi(mode_s));
    if (!ctx) return 1;
    spw_buf *b[MAX_UNITS];
    double kms[MAX_ITEMS];
    spw_stream s;
    for (int i = 0; i < tl_units; i++)
        if (spw_buf_create(ctx, (size_t)(tl_size[i] / div), SPW_BUF_READ_ONLY, &b[i])) return 1;
    for (int i = 0; i < tl_items; i++) kms[i] = tl_ms[i] * mul;
    if (spw_stream_create(ctx, &s)) return 1;
    enum { STEPS = 40, FROM = 25 };
    double sum_ms = 0;
    int64_t h2d0 = 0, trims0 = 0, stalls0 = 0, ring0 = 0, win0 = 0;
    spw_stats x;
    for (int step = 0; step < STEPS; step++) {
        if (step == FROM) {
            if (spw_stats_get(ctx, &x)) return 1;
            h2d0 = x.bytes_h2d.total, trims0 = x.trim_syncs.total, stalls0 = x.stalls.total;
            ring0 = x.ring_uploads.total, win0 = x.window_evictions.total;
        }
        double t0 = now_ms();
        if (spw_step_begin(ctx)) return 1;
        for (int i = 0; i < tl_items; i++) {
            void *d;
            for (int j = 0; j < tl_nneed[i]; j++)
                if (spw_acquire(b[tl_need[i][j]], s, SPW_ACCESS_READ, &d)) goto fail;
            if (spw_launch_host(ctx, s, spin_fn, &kms[i])) goto fail;
            for (int j = 0; j < tl_nneed[i]; j++)
                if (spw_release(b[tl_need[i][j]], s)) goto fail;
            if (host_ms > 0) spin_ms(host_ms / tl_items);
        }
        if (spw_step_end(ctx) || spw_stream_synchronize(ctx, s)) return 1;
        if (step >= FROM) sum_ms += now_ms() - t0;
    }
    if (spw_stats_get(ctx, &x)) return 1;
    int steps = STEPS - FROM;
    double up = (double)(x.bytes_h2d.total - h2d0) / steps;
    char desc[512] = "";
    if (ctx->engine->pops->describe) ctx->engine->pops->describe(ctx->engine->pol, desc, sizeof desc);
    printf("mode %s: %.2f ms a step, %.2f unscaled (compute %.2f, link for the bytes moved %.2f unscaled); "
           "%.0f KiB up a step (%.2f of the weights), stalls %.1f, trims %.1f, ring %.1f, windows %.1f\n  %s\n",
           mode_s, sum_ms / steps, sum_ms / steps / mul, res_ms / mul, up / (gbps * 1e6) / mul, up / 1024, up / total,
           (double)(x.stalls.total - stalls0) / steps, (double)(x.trim_syncs.total - trims0) / steps,
           (double)(x.ring_uploads.total - ring0) / steps, (double)(x.window_evictions.total - win0) / steps, desc);
    for (int i = 0; i < tl_units; i++) spw_buf_destroy(b[i]);
    spw_stream_destroy(ctx, s);
    return spw_ctx_destroy(ctx) != SPW_OK;
fail:
    fprintf(stderr, "sim_units: %s\n", spw_last_error());
    return 1;
}

/* SD 1.5's UNet at 1/16 scale, roughly: down blocks growing, a mid block, up blocks larger than
 * the down blocks (skip inputs), small convs and norms between. */
static const double UNET[] = {0.05, 1.3, 1.3, 0.3, 2.1, 2.1, 0.9, 5.4, 5.4, 2.2, 4.4, 4.4, 6.2, 6.2, 7.5, 7.5, 7.5,
                              3.1, 8.2, 8.2, 8.2, 3.1, 4.6, 4.6, 4.6, 1.0, 1.9, 1.9, 1.9, 0.2, 0.05};

int main(int argc, char **argv) {
    double frac = 0.40, kernel_ms = 12, host_ms = 30, link = 4, div = 16;
    const char *mode_s = "auto", *extra = "", *timeline = NULL;
    int opt;
    while ((opt = getopt(argc, argv, "b:m:k:h:l:c:t:s:")) != -1) {
        if (opt == 'b') frac = atof(optarg);
        else if (opt == 'm') mode_s = optarg;
        else if (opt == 'k') kernel_ms = atof(optarg);
        else if (opt == 'h') host_ms = atof(optarg);
        else if (opt == 'l') link = atof(optarg);
        else if (opt == 'c') extra = optarg;
        else if (opt == 't') timeline = optarg;
        else if (opt == 's') div = atof(optarg);
    }
    if (timeline) return read_timeline(timeline) || replay(mode_s, div, link, host_ms, extra);
    double sizes[512];
    int n = 0;
    if (optind < argc) {
        for (char *t = strtok(argv[optind], ","); t && n < 512; t = strtok(NULL, ",")) sizes[n++] = atof(t);
    } else {
        n = (int)(sizeof UNET / sizeof UNET[0]);
        memcpy(sizes, UNET, sizeof UNET);
    }
    double total = 0;
    for (int i = 0; i < n; i++) total += sizes[i];
    bool tune = !strcmp(mode_s, "auto");
    char conf[512];
    snprintf(conf, sizeof conf, "backend=emu,budget=%zu,policy=plan,prefetch=on,emu_link_gbps=%.0f,prefetch_early=%s%s%s",
             (size_t)(total * frac * MiB), link, tune ? "auto" : "0", *extra ? "," : "", extra);
    spw_ctx *ctx = probe_ctx("sim_units", conf, tune, tune ? 0 : atoi(mode_s));
    if (!ctx) return 1;
    spw_buf **b = calloc((size_t)n, sizeof *b);
    double *kms = calloc((size_t)n, sizeof *kms);
    spw_stream s;
    for (int i = 0; i < n; i++) {
        if (spw_buf_create(ctx, (size_t)(sizes[i] * MiB) + 512, SPW_BUF_READ_ONLY, &b[i])) return 1;
        kms[i] = kernel_ms * sizes[i] / total;
    }
    if (spw_stream_create(ctx, &s)) return 1;
    enum { STEPS = 60, FROM = 40 };
    double sum_ms = 0;
    int64_t trims0 = 0, h2d0 = 0, win0 = 0, allocs0 = 0;
    spw_stats x;
    for (int step = 0; step < STEPS; step++) {
        if (step == FROM) {
            if (spw_stats_get(ctx, &x)) return 1;
            trims0 = x.trim_syncs.total;
            h2d0 = x.bytes_h2d.total;
            win0 = x.window_evictions.total;
            allocs0 = x.backend_allocs.total;
        }
        double t0 = now_ms();
        if (spw_step_begin(ctx)) return 1;
        for (int i = 0; i < n; i++) {
            void *d;
            if (spw_acquire(b[i], s, SPW_ACCESS_READ, &d) || spw_launch_host(ctx, s, sleep_ms, &kms[i]) ||
                spw_release(b[i], s)) {
                fprintf(stderr, "sim_units: %s\n", spw_last_error());
                return 1;
            }
            spin_ms(host_ms / n);
        }
        if (spw_step_end(ctx) || spw_stream_synchronize(ctx, s)) return 1;
        if (step >= FROM) sum_ms += now_ms() - t0;
    }
    if (spw_stats_get(ctx, &x)) return 1;
    int steps = STEPS - FROM;
    double up = (double)(x.bytes_h2d.total - h2d0) / steps;
    char desc[512] = "";
    if (ctx->engine->pops->describe) ctx->engine->pops->describe(ctx->engine->pol, desc, sizeof desc);
    printf("mode %s: %.2f ms a step (kernels %.1f, host %.1f, link for the bytes moved %.1f, for the bound %.1f); "
           "trims %.1f, windows %.1f, maps %.1f, uploads %.1f MiB a step of %.1f\n  %s\n",
           mode_s, sum_ms / steps, kernel_ms, host_ms, up / (link * 1e6), total * (1 - frac) * MiB / (link * 1e6),
           (double)(x.trim_syncs.total - trims0) / steps, (double)(x.window_evictions.total - win0) / steps,
           (double)(x.backend_allocs.total - allocs0) / steps, up / MiB, total, desc);
    for (int i = 0; i < n; i++) spw_buf_destroy(b[i]);
    spw_stream_destroy(ctx, s);
    free(b);
    free(kms);
    return spw_ctx_destroy(ctx) != SPW_OK;
}
