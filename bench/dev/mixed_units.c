/*
 * Device-memory trims a step under each plan pipeline, for units of two sizes on the emu backend:
 * 32 layers of 13 MiB + 16 KiB between two 7.8 MiB embeddings (a Llama-shaped model's 416.02 and
 * 250 MiB, scaled by 1/32), 2 MiB pages. Each trim synchronizes the streams; on the H200 the
 * split with one slot trimmed about twice a decode step for the real model. A development probe
 * (internal headers, emu only), not a test or a benchmark of record:
 *   gcc -std=gnu11 -O1 -D_GNU_SOURCE -Isrc -Iinclude -I/usr/local/cuda/include \
 *       bench/dev/mixed_units.c build/libspillway_static.a -L/usr/local/cuda/lib64 -lcudart \
 *       -lpthread -lz -lm -ldl -Wl,-rpath,/usr/local/cuda/lib64 -o /tmp/mixed_units
 *   /tmp/mixed_units BUDGET MODE [LAYER_KIB EMB_KIB]
 *     e.g. 192MiB -3; MODE: -1 no prefetch, 0 double buffer, -2 static split, -3 split with one
 *     slot, auto: the policy's own trials on a link of 4 GB/s (about 55 GB/s scaled by 1/16); layers
 *     of whole pages at 1/16 scale: 384MiB -3 26624 16000
 * Prints per step the trims, the bytes uploaded so far, the fixed set's size and the pipeline;
 * then, over steps 10-29, how often a buffer came back at another device address than at its
 * last acquire, and how often at one of its last 2 or 4 addresses (what the offload's hooks
 * would re-point with no cache of device tensors, or with one of 2 or 4 addresses per unit).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe_ctx.h"

#define MiB ((size_t)1 << 20)

int main(int argc, char **argv) {
    const char *budget = argc > 1 ? argv[1] : "192MiB";
    bool tune = argc > 2 && !strcmp(argv[2], "auto");
    int mode = argc > 2 && !tune ? atoi(argv[2]) : PF_SLOT;
    char conf[256];
    snprintf(conf, sizeof conf, "backend=emu,budget=%s,policy=plan,prefetch=on,vmm=on,vmm_large_page=2MiB,%s",
             budget, tune ? "emu_link_gbps=4" : "prefetch_early=0");
    spw_ctx *ctx = probe_ctx("mixed_units", conf, tune, mode);
    if (!ctx) return 1;
    enum { N = 34 };
    const size_t L = argc > 3 ? (size_t)atol(argv[3]) * 1024 : 13 * MiB + 16384;
    const size_t E = argc > 4 ? (size_t)atol(argv[4]) * 1024 : 8 * MiB - 192 * 1024;
    spw_buf *b[N];
    spw_stream s;
    for (int i = 0; i < N; i++)
        if (spw_buf_create(ctx, (i == 0 || i == N - 1) ? E : L, SPW_BUF_READ_ONLY, &b[i])) return 1;
    if (spw_stream_create(ctx, &s)) return 1;
    int64_t t0 = 0;
    enum { K = 4 };
    void *seen[N][K] = {{0}}; /* each buffer's last K addresses, newest first */
    long acq = 0, moved = 0, miss2 = 0, miss4 = 0;
    for (int step = 0; step < 30; step++) {
        if (spw_step_begin(ctx)) return 1;
        for (int i = 0; i < N; i++) {
            void *d;
            if (spw_acquire(b[i], s, SPW_ACCESS_READ, &d) || spw_release(b[i], s)) {
                fprintf(stderr, "mixed_units: %s\n", spw_last_error());
                return 1;
            }
            int at = K;
            for (int k = 0; k < K; k++)
                if (seen[i][k] == d) at = k;
            if (step >= 10) {
                acq++;
                moved += at != 0;
                miss2 += at >= 2;
                miss4 += at >= 4;
            }
            for (int k = (at < K ? at : K - 1); k > 0; k--) seen[i][k] = seen[i][k - 1];
            seen[i][0] = d;
        }
        spw_stats x;
        if (spw_step_end(ctx) || spw_stream_synchronize(ctx, s) || spw_stats_get(ctx, &x)) return 1;
        int fixed = 0;
        for (int i = 0; i < N; i++) fixed += kb_of(b[i])->fixed;
        printf("step %2d trims %3lld uploaded %6lld MiB fixed %2d pipeline %d\n", step,
               (long long)(x.trim_syncs.total - t0), (long long)(x.bytes_h2d.total / MiB), fixed,
               ctx->engine->pol->early_max);
        t0 = x.trim_syncs.total;
    }
    printf("steps 10-29: %ld acquires, at another address than the last %ld, not among the last 2 "
           "%ld, not among the last 4 %ld\n", acq, moved, miss2, miss4);
    for (int i = 0; i < N; i++) spw_buf_destroy(b[i]);
    spw_stream_destroy(ctx, s);
    return spw_ctx_destroy(ctx) != SPW_OK;
}
