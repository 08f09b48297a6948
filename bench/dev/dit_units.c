/*
 * Where a DiT's units land in the device arena, step after step, on the emu backend: Flux's
 * transformer at 1/32 scale (an embedder of 2 MiB, 19 blocks of 20 MiB, 38 of 8 MiB, a head of
 * 2 MiB; whole 2 MiB pages) under 256 MiB (8 GiB / 32), policy plan with its pipeline forced. Over
 * steps 10-39 it counts how often a unit came back at another address than at its last acquire,
 * and at an address it never had (each of those costs spillway.torch's hooks a new set of device
 * tensors: the "re-pointed" count of the offload's summary). A development probe (internal
 * headers, emu only), not a test or a benchmark of record:
 *   gcc -std=gnu11 -O2 -D_GNU_SOURCE -Isrc -Iinclude -Ibench/dev -I/usr/local/cuda/include \
 *       bench/dev/dit_units.c build/libspillway_static.a -L/usr/local/cuda/lib64 -lcudart \
 *       -lpthread -lz -lm -ldl -Wl,-rpath,/usr/local/cuda/lib64 -o /tmp/dit_units
 *   /tmp/dit_units MODE [BUDGET [OPTIONS]]
 *     MODE: -1 no prefetch, 0 double buffer, -2 static split, -3 split with one slot
 * Environment: DIT_SCALE=S multiplies the blocks (S=8: a quarter of Flux, 162 and 67.5 MiB, for
 * a budget of 2GiB); DIT_HEAD_MIB and DIT_TAIL_MIB give the first and last units other sizes than
 * 2 MiB (Flux's embedders as one unit and its output layers: 62 and 36 MiB, scaled);
 * DIT_HALVES=1 makes each double block two units of half its size (a partition's cap below it).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe_ctx.h"

#define MiB ((size_t)1 << 20)

enum { NMAX = 78, K = 32, STEPS = 40, FROM = 10 };

int main(int argc, char **argv) {
    int mode = argc > 1 ? atoi(argv[1]) : 0;
    const char *budget = argc > 2 ? argv[2] : "256MiB";
    const char *extra = argc > 3 ? argv[3] : "";
    char conf[512];
    snprintf(conf, sizeof conf,
             "backend=emu,budget=%s,policy=plan,prefetch=on,vmm=on,vmm_large_page=2MiB,prefetch_early=0%s%s", budget,
             *extra ? "," : "", extra);
    spw_ctx *ctx = probe_ctx("dit_units", conf, false, mode);
    if (!ctx) return 1;
    spw_buf *b[NMAX];
    size_t size[NMAX];
    const char *sc = getenv("DIT_SCALE"), *head = getenv("DIT_HEAD_MIB"), *tail = getenv("DIT_TAIL_MIB");
    const char *halves = getenv("DIT_HALVES");
    int per = halves && atoi(halves) ? 2 : 1, N = 2 + 19 * per + 38;
    double scale = sc ? atof(sc) : 0;
    size[0] = head ? (size_t)(atof(head) * MiB) / 512 * 512 : 2 * MiB;
    size[N - 1] = tail ? (size_t)(atof(tail) * MiB) / 512 * 512 : 2 * MiB;
    for (int i = 1; i <= 19 * per; i++)
        size[i] = (scale > 0 ? (size_t)(20.25 * scale * MiB) / 512 * 512 : 20 * MiB) / (size_t)per / 512 * 512;
    for (int i = 1 + 19 * per; i < N - 1; i++) size[i] = scale > 0 ? (size_t)(8.44 * scale * MiB) / 512 * 512 : 8 * MiB;
    spw_stream s;
    for (int i = 0; i < N; i++)
        if (spw_buf_create(ctx, size[i], SPW_BUF_READ_ONLY, &b[i])) goto fail;
    if (spw_stream_create(ctx, &s)) goto fail;
    static void *seen[NMAX][K]; /* each unit's addresses so far, up to K (the hooks keep as many sets) */
    int nseen[NMAX] = {0};
    void *last[NMAX] = {0};
    long acquires = 0, moved = 0, fresh = 0;
    for (int step = 0; step < STEPS; step++) {
        if (spw_step_begin(ctx)) goto fail;
        for (int i = 0; i < N; i++) {
            void *d;
            if (spw_acquire(b[i], s, SPW_ACCESS_READ, &d) || spw_release(b[i], s)) goto fail;
            bool known = false;
            for (int k = 0; k < nseen[i]; k++) known |= seen[i][k] == d;
            if (!known && nseen[i] < K) seen[i][nseen[i]++] = d;
            if (step >= FROM) {
                acquires++;
                fresh += !known;
                moved += last[i] != d;
            }
            last[i] = d;
        }
        if (spw_step_end(ctx) || spw_stream_synchronize(ctx, s)) goto fail;
    }
    spw_stats x;
    if (spw_stats_get(ctx, &x)) goto fail;
    int distinct = 0;
    for (int i = 0; i < N; i++) distinct += nseen[i];
    printf("pipeline %d, steps %d-%d: %ld acquires, at another address than the last %ld, at an address never "
           "seen %ld; %.1f addresses a unit; trims %lld; %lld MiB uploaded a step\n",
           mode, FROM, STEPS - 1, acquires, moved, fresh, (double)distinct / N, (long long)x.trim_syncs.total,
           (long long)(x.bytes_h2d.total / MiB / STEPS));
    for (int i = 0; i < N; i++) spw_buf_destroy(b[i]);
    spw_stream_destroy(ctx, s);
    return spw_ctx_destroy(ctx) != SPW_OK;
fail:
    fprintf(stderr, "dit_units: %s\n", spw_last_error());
    return 1;
}
