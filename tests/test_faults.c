/* Fault-injection sweep over the allocation path: for every backend call kind the allocator
 * uses, fail its 1st, 2nd, ... call (once, then persistently) during a fixed workload. Every
 * operation must either succeed or return an error with a message; the statistics must agree
 * with the backend after every operation; and once the faults are cleared, everything can be
 * freed and returned, leaving the emulated device empty (no leak). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define MiB ((size_t)1 << 20)
#define MAX_PTRS 64

typedef struct run {
    spw_ctx *ctx;
    spw_stream sa, sb;
    void *ptr[MAX_PTRS];
    size_t size[MAX_PTRS];
    int errors;
} run;

/* The bytes an allocation of `bytes` holds live: 512-byte rounding, or with plain segments
 * (vmm=off) a large block's whole segment, in 2 MiB pages. */
static int64_t charged(const spw_ctx *ctx, size_t bytes) {
    size_t n = (bytes + 511) / 512 * 512;
    if (ctx->cfg.vmm == SPW_TRI_OFF && bytes > ctx->cfg.small_limit) n = SPW_ALIGN_UP(n, 2 * SPW_MiB);
    return (int64_t)n;
}

static void invariants(run *r) {
    spw_ctx *ctx = r->ctx;
    assert_ok(spw__arena_check(ctx->small));
    assert_ok(spw__arena_check(ctx->large));
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    int64_t live = 0;
    for (int i = 0; i < MAX_PTRS; i++)
        if (r->ptr[i]) live += charged(ctx, r->size[i]);
    assert_int_equal(st.live.current, live);
    assert_int_equal((size_t)st.held.current, spw__arena_held(ctx->small) + spw__arena_held(ctx->large));
    assert_int_equal((size_t)st.held.current, spw__emu_used(ctx->backend));
    assert_true((size_t)st.held.current <= ctx->budget);
    assert_int_equal(st.cached.current, st.held.current - st.live.current);
}

static void do_alloc(run *r, int slot, size_t bytes, spw_stream s) {
    if (r->ptr[slot]) return;
    void *p = (void *)0x1;
    spw_status st = spw_malloc(r->ctx, bytes, s, &p);
    if (st == SPW_OK) {
        r->ptr[slot] = p;
        r->size[slot] = bytes;
    } else {
        assert_ptr_equal(p, (void *)0x1); /* untouched on failure */
        assert_true(strlen(spw_last_error()) > 0);
        r->errors++;
    }
    invariants(r);
}

static void do_free(run *r, int slot, spw_stream s) {
    if (!r->ptr[slot]) return;
    assert_ok(spw_free(r->ctx, r->ptr[slot], s)); /* free never calls the backend */
    r->ptr[slot] = NULL;
    invariants(r);
}

static void do_empty(run *r) {
    spw_status st = spw_empty_cache(r->ctx);
    if (st) {
        assert_true(strlen(spw_last_error()) > 0);
        r->errors++;
    }
    invariants(r);
}

/* A workload touching growth, reuse, cross-stream adoption, trimming at the budget and
 * emptying the cache. */
static void workload(run *r) {
    for (int i = 0; i < 8; i++) do_alloc(r, i, (size_t)(i + 1) * 3 * MiB + 100, r->sa);
    for (int i = 8; i < 16; i++) do_alloc(r, i, 4096u * (unsigned)(i + 1), r->sa);
    for (int i = 0; i < 16; i += 2) do_free(r, i, r->sa);
    for (int i = 16; i < 20; i++) do_alloc(r, i, 5 * MiB, r->sb); /* cross-stream reuse */
    for (int i = 20; i < 24; i++) do_alloc(r, i, 2048, r->sb);
    do_alloc(r, 24, 40 * MiB, r->sa); /* beyond the cache: trims, then maps */
    for (int i = 1; i < 16; i += 2) do_free(r, i, r->sb);
    do_alloc(r, 25, 30 * MiB, r->sb);
    do_empty(r);
    for (int i = 26; i < 30; i++) do_alloc(r, i, 7 * MiB, r->sa);
}

static run *start(const char *conf) {
    static run r;
    memset(&r, 0, sizeof r);
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    assert_ok(spw_config_parse(cfg, "backend=emu,budget=96MiB,emu_capacity=1GiB"));
    if (conf) assert_ok(spw_config_parse(cfg, conf));
    assert_ok(spw_ctx_create(cfg, &r.ctx));
    spw_config_destroy(cfg);
    assert_ok(spw_stream_create(r.ctx, &r.sa));
    assert_ok(spw_stream_create(r.ctx, &r.sb));
    return &r;
}

static void finish(run *r) {
    spw__emu_clear_faults(r->ctx->backend);
    for (int i = 0; i < MAX_PTRS; i++) do_free(r, i, r->sa);
    assert_ok(spw_empty_cache(r->ctx));
    spw_stats st;
    assert_ok(spw_stats_get(r->ctx, &st));
    assert_int_equal(st.held.current, 0);
    assert_int_equal(spw__emu_used(r->ctx->backend), 0);
    assert_ok(spw_stream_destroy(r->ctx, r->sa));
    assert_ok(spw_stream_destroy(r->ctx, r->sb));
    spw_ctx_destroy(r->ctx);
}

static void sweep(const char *conf, spw_call call, int *errors_seen) {
    run *r = start(conf);
    unsigned long base = spw__emu_calls(r->ctx->backend, call);
    workload(r);
    unsigned long calls = spw__emu_calls(r->ctx->backend, call) - base;
    finish(r);
    if (getenv("SPW_TEST_VERBOSE")) printf("  %s: %lu calls in the workload\n", spw__call_name(call), calls);
    for (int persistent = 0; persistent <= 1; persistent++) {
        for (unsigned long n = 1; n <= calls; n++) {
            r = start(conf);
            spw__emu_inject(r->ctx->backend, call, n, persistent);
            workload(r);
            *errors_seen += r->errors;
            finish(r);
        }
    }
}

static void sweep_vmm(void **state) {
    (void)state;
    const spw_call calls[] = {SPW_CALL_MAP, SPW_CALL_UNMAP, SPW_CALL_EVENT_CREATE, SPW_CALL_EVENT_RECORD,
                              SPW_CALL_STREAM_WAIT, SPW_CALL_STREAM_SYNC};
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        int errors = 0;
        sweep("grow_ahead=0", calls[i], &errors);
        /* a failed map, unmap or sync surfaces as an error; event failures are absorbed by
         * growing instead of reusing another stream's block */
        if (calls[i] == SPW_CALL_MAP || calls[i] == SPW_CALL_UNMAP || calls[i] == SPW_CALL_STREAM_SYNC)
            assert_true(errors > 0);
    }
}

static void sweep_segments(void **state) {
    (void)state;
    const spw_call calls[] = {SPW_CALL_DEV_ALLOC, SPW_CALL_DEV_FREE, SPW_CALL_STREAM_SYNC};
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        int errors = 0;
        sweep("vmm=off", calls[i], &errors);
        assert_true(errors > 0);
    }
}

/* A context whose address-space reservation fails is not created, and says why. */
static void create_fails_cleanly(void **state) {
    (void)state;
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    /* emu capacity beyond twice the budget's reservation is fine; an absurd reservation fails */
    assert_ok(spw_config_parse(cfg, "backend=emu,budget=100%,emu_capacity=100TiB"));
    spw_ctx *ctx = (spw_ctx *)0x1;
    spw_status st = spw_ctx_create(cfg, &ctx);
    if (st != SPW_OK) {
        assert_ptr_equal(ctx, (spw_ctx *)0x1);
        assert_non_null(strstr(spw_last_error(), "address space"));
    } else {
        spw_ctx_destroy(ctx); /* the machine could reserve 200 TiB: nothing to check */
    }
    spw_config_destroy(cfg);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(sweep_vmm),
        cmocka_unit_test(sweep_segments),
        cmocka_unit_test(create_fails_cleanly),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
