/* Fault-injection sweep over the offload engine (emu): a fixed scenario of acquires, releases,
 * prefetches, evictions, discards, host reads and spw_malloc pressure on three streams is run
 * with the Nth call of each backend call kind failing (once, and from then on). Each run checks:
 * every "kernel" saw the expected bytes, every live buffer's bytes survive (read back after the
 * faults are cleared), the budget holds after every operation, an error was returned where the
 * fault fired on a call whose failure cannot be absorbed, and nothing leaks (events, host pool,
 * device memory back to the baseline). */
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

#include "engine.h"

#define NBUF 5
#define BSZ (512 * 1024)
#define MAXOPS 384 /* kernels a run enqueues: 10 steps of the scenario at most */

typedef struct model {
    uint8_t seed, add;
    int unknown; /* contents undefined (WRITE acquire whose kernel never ran, or discarded) */
} model;

static uint8_t pattern(const model *m, size_t i) { return (uint8_t)(((i * 7) ^ m->seed) + m->add); }

typedef struct karg {
    uint8_t *p;
    model m;
    int op;           /* 0 verify, 1 add 1, 2 fill with new seed */
    atomic_int *bad;  /* verify: set on mismatch */
} karg;

static void kernel(void *a) {
    karg *k = a;
    if (k->op == 0) {
        for (size_t i = 0; i < BSZ; i++)
            if (k->p[i] != pattern(&k->m, i)) {
                atomic_store(k->bad, 1);
                return;
            }
    } else if (k->op == 1) {
        for (size_t i = 0; i < BSZ; i++) k->p[i] = (uint8_t)(k->p[i] + 1);
    } else {
        for (size_t i = 0; i < BSZ; i++) k->p[i] = pattern(&k->m, i);
    }
}

typedef struct run {
    spw_ctx *ctx;
    spw_stream s[3];
    spw_buf *b[NBUF];
    model m[NBUF];
    karg args[MAXOPS];
    int nargs;
    atomic_int bad;
    int errors;
} run;

static void budget_ok(run *r) {
    spw_stats st;
    assert_ok(spw_stats_get(r->ctx, &st));
    if ((uint64_t)st.held.current > st.budget) fail_msg("held %lld > budget", (long long)st.held.current);
}

/* acquire buffer i in mode on stream si, run the kernel for the mode, release */
static void use(run *r, int i, int si, spw_access mode) {
    void *d;
    spw_stream s = r->s[si];
    if (spw_acquire(r->b[i], s, mode, &d)) {
        r->errors++;
        budget_ok(r);
        return;
    }
    karg *k = &r->args[r->nargs++];
    k->p = d;
    k->bad = &r->bad;
    if (mode == SPW_ACCESS_READ) {
        k->op = 0;
        k->m = r->m[i];
    } else if (mode == SPW_ACCESS_READ_WRITE) {
        k->op = 1;
    } else {
        k->op = 2;
        k->m.seed = (uint8_t)(r->nargs * 13 + i);
        k->m.add = 0;
    }
    int skip_verify = mode == SPW_ACCESS_READ && r->m[i].unknown;
    if (skip_verify) k->op = 3; /* nothing to check: contents undefined */
    if (spw_launch_host(r->ctx, s, kernel, k)) {
        r->errors++;
        if (mode == SPW_ACCESS_WRITE) r->m[i].unknown = 1; /* promised overwrite never happened */
    } else if (mode == SPW_ACCESS_READ_WRITE) {
        r->m[i].add++;
    } else if (mode == SPW_ACCESS_WRITE) {
        r->m[i] = k->m;
    }
    if (spw_release(r->b[i], s)) {
        r->errors++;
        spw__emu_clear_faults(r->ctx->backend);
        assert_ok(spw_release(r->b[i], s));
    }
    budget_ok(r);
}

static void setup(run *r, const char *conf) {
    memset(r, 0, sizeof *r);
    atomic_init(&r->bad, 0);
    r->ctx = test_ctx(conf);
    r->s[0] = NULL;
    assert_ok(spw_stream_create(r->ctx, &r->s[1]));
    assert_ok(spw_stream_create(r->ctx, &r->s[2]));
    uint8_t *tmp = malloc(BSZ);
    for (int i = 0; i < NBUF; i++) {
        assert_ok(spw_buf_create(r->ctx, BSZ, i == 0 ? SPW_BUF_READ_ONLY : 0, &r->b[i]));
        r->m[i].seed = (uint8_t)(i * 31 + 1);
        for (size_t k = 0; k < BSZ; k++) tmp[k] = pattern(&r->m[i], k);
        assert_ok(spw_buf_write(r->b[i], 0, tmp, BSZ));
    }
    free(tmp);
}

/* The operations under test. */
static void scenario(run *r) {
    const spw_access R = SPW_ACCESS_READ, RW = SPW_ACCESS_READ_WRITE, W = SPW_ACCESS_WRITE;
    use(r, 0, 0, R);
    use(r, 1, 1, RW);
    use(r, 2, 2, W);
    use(r, 3, 0, RW);
    use(r, 4, 1, R); /* budget 4 blocks: from here on acquires evict */
    use(r, 1, 2, R);
    if (spw_prefetch(r->b[2], r->s[0])) r->errors++;
    budget_ok(r);
    use(r, 2, 0, RW);
    if (spw_evict(r->b[3])) r->errors++;
    budget_ok(r);
    use(r, 0, 2, R);
    use(r, 3, 1, RW);
    if (spw_discard(r->b[4]) == SPW_OK) r->m[4].unknown = 1;
    use(r, 4, 0, W);
    use(r, 1, 1, RW);
    /* host read of a dirty buffer: write-back without eviction */
    uint8_t probe[64];
    if (spw_buf_read(r->b[1], 100, probe, sizeof probe)) r->errors++;
    else if (!r->m[1].unknown)
        for (size_t k = 0; k < sizeof probe; k++)
            if (probe[k] != pattern(&r->m[1], 100 + k)) fail_msg("buf_read byte %zu wrong", k);
    /* spw_malloc pressure evicts buffers */
    void *p = NULL;
    if (spw_malloc(r->ctx, 1536 * 1024, r->s[1], &p)) r->errors++;
    else assert_ok(spw_free(r->ctx, p, r->s[1]));
    budget_ok(r);
    use(r, 2, 2, R);
    use(r, 3, 0, R);
    use(r, 4, 1, RW);
    if (spw_evict(r->b[4])) r->errors++;
    if (spw_prefetch(r->b[4], r->s[2])) r->errors++;
    use(r, 4, 2, R);
    budget_ok(r);
}

/* Faults off: the data check, then the leak check. */
static void finish(run *r) {
    spw_ctx *ctx = r->ctx;
    spw__emu_clear_faults(ctx->backend);
    for (int i = 0; i < 3; i++) assert_ok(spw_stream_synchronize(ctx, r->s[i]));
    if (atomic_load(&r->bad)) fail_msg("a kernel saw wrong bytes");
    uint8_t *tmp = malloc(BSZ);
    for (int i = 0; i < NBUF; i++) {
        if (r->m[i].unknown) continue;
        assert_ok(spw_buf_read(r->b[i], 0, tmp, BSZ));
        for (size_t k = 0; k < BSZ; k++)
            if (tmp[k] != pattern(&r->m[i], k))
                fail_msg("buffer %d byte %zu: %u, want %u (data lost)", i, k, tmp[k], pattern(&r->m[i], k));
    }
    free(tmp);
    for (int i = 0; i < NBUF; i++) assert_ok(spw_buf_destroy(r->b[i]));
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.pinned.current, 0);
    assert_int_equal(st.live.current, 0);
    assert_int_equal(st.buffers_resident.current, 0);
    assert_int_equal(st.buffers_host.current, 0);
    assert_int_equal(ctx->engine->events_live, 0);
    pthread_mutex_lock(&ctx->lock);
    spw__hostpool_trim(ctx->engine->hp);
    pthread_mutex_unlock(&ctx->lock);
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.host_held.current, 0);
    assert_ok(spw_empty_cache(ctx));
    assert_int_equal(spw__emu_used(ctx->backend), 0);
    assert_ok(spw_stream_destroy(ctx, r->s[1]));
    assert_ok(spw_stream_destroy(ctx, r->s[2]));
    spw_ctx_destroy(ctx);
}

/* Kinds whose failure must surface as an error of some call in the scenario: always (the
 * engine's own copies), or mostly (the arena absorbs failures of its cross-stream reuse by
 * growing instead; map/dev_alloc fail as out of memory, which eviction absorbs). */
static int must_error(spw_call c) { return c == SPW_CALL_MEMCPY || c == SPW_CALL_PREFETCH; }
static int mostly_error(spw_call c) {
    return c == SPW_CALL_EVENT_RECORD || c == SPW_CALL_STREAM_WAIT || c == SPW_CALL_EVENT_SYNC;
}

/* The scenario once, or `steps` times as steps of policy=plan (learning, the move to its start
 * state, the timed pipelines). */
static void scenario_steps(run *r, int steps) {
    if (steps <= 1) {
        scenario(r);
        return;
    }
    for (int k = 0; k < steps; k++) {
        if (spw_step_begin(r->ctx)) r->errors++;
        scenario(r);
        if (spw_step_end(r->ctx)) r->errors++;
    }
    /* buffer 2 is overwritten first in every step: once the plan is confirmed it may drop the
     * contents the last step left (a host read of them is then an error: test_plan) */
    r->m[2].unknown = 1;
}

/* Sweep the scenario with the Nth call of each kind failing. With steps > 1 the faults are spread
 * over the whole run (every stride-th call), and the error-count rules are not applied: the
 * plan's own prefetches are hints whose failures it absorbs; data, budget and leaks are checked
 * as always. */
static void sweep_steps(const char *conf, int steps) {
    static run r;
    /* dry run: how many calls of each kind the scenario makes */
    unsigned long counts[SPW_CALL_COUNT_];
    setup(&r, conf);
    unsigned long before[SPW_CALL_COUNT_];
    for (int c = 0; c < SPW_CALL_COUNT_; c++) before[c] = spw__emu_calls(r.ctx->backend, (spw_call)c);
    scenario_steps(&r, steps);
    assert_int_equal(r.errors, 0);
    for (int c = 0; c < SPW_CALL_COUNT_; c++) counts[c] = spw__emu_calls(r.ctx->backend, (spw_call)c) - before[c];
    finish(&r);
    int runs = 0, fired = 0;
    for (int c = 0; c < SPW_CALL_COUNT_; c++) {
        int k_fired = 0, k_err = 0;
        unsigned long n_max = counts[c] > 60 ? 60 : counts[c];
        unsigned long stride = steps > 1 && counts[c] > 20 ? counts[c] / 20 : 1;
        if (steps > 1 && n_max > 20) n_max = 20;
        for (unsigned long j = 1; j <= n_max; j++) {
            unsigned long n = 1 + (j - 1) * stride;
            for (int persist = 0; persist < 2; persist++) {
                if (persist && j != 1 && j != n_max / 2) continue;
                setup(&r, conf);
                unsigned long c0 = spw__emu_calls(r.ctx->backend, (spw_call)c);
                spw__emu_inject(r.ctx->backend, (spw_call)c, n, persist);
                scenario_steps(&r, steps);
                int hit = spw__emu_calls(r.ctx->backend, (spw_call)c) - c0 >= n;
                if (hit) fired++, k_fired++;
                if (hit && r.errors) k_err++;
                if (steps <= 1 && hit && must_error((spw_call)c) && r.errors == 0)
                    fail_msg("%s: fault in %s call #%lu%s returned no error", conf, spw__call_name((spw_call)c), n,
                             persist ? " (persistent)" : "");
                finish(&r);
                runs++;
            }
        }
        if (steps <= 1 && mostly_error((spw_call)c) && k_fired && k_err * 2 < k_fired)
            fail_msg("%s: faults in %s fired %d times but only %d returned an error", conf,
                     spw__call_name((spw_call)c), k_fired, k_err);
    }
    assert_true(fired > 50);
    print_message("%s: %d fault runs, %d fired\n", conf, runs, fired);
}

static void sweep(const char *conf) { sweep_steps(conf, 1); }

static void test_sweep_explicit(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    sweep("budget=2MiB,grow_ahead=0");
}

static void test_sweep_explicit_novmm(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    sweep("budget=2MiB,grow_ahead=0,vmm=off");
}

/* policy=plan over 10 steps of the scenario with prefetch on: the first plan's move to its start
 * state and each timed pipeline (no prefetch, the double buffer, STATIC) run under the faults. */
static void test_sweep_plan(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    sweep_steps("budget=2MiB,grow_ahead=0,policy=plan,prefetch=on", 10);
}

/* The static split's ring (pipeline=split, ring=on; buffers in the large arena's pages) over 8
 * steps of the scenario, whose writes make dirty victims the ring must write back: every upload
 * of a streamed buffer is placed by the ring, under the faults. */
static void test_sweep_ring(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    const char *conf = "budget=2MiB,grow_ahead=0,policy=plan,prefetch=on,pipeline=split,ring=on,vmm=on,"
                       "small_limit=64KiB,vmm_page=128KiB,vmm_large_page=128KiB";
    static run r;
    setup(&r, conf);
    scenario_steps(&r, 8);
    assert_int_equal(r.errors, 0);
    spw_stats st;
    assert_ok(spw_stats_get(r.ctx, &st));
    assert_true(st.ring_uploads.total > 8); /* the ring runs in this scenario */
    finish(&r);
    sweep_steps(conf, 8);
}

static void test_sweep_managed(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    sweep("budget=2MiB,grow_ahead=0,residency=managed");
}

/* Host budget and pinning failures at creation leave nothing behind. */
static void test_create_faults(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_call kinds[] = {SPW_CALL_HOST_ALLOC, SPW_CALL_EVENT_CREATE, SPW_CALL_STREAM_CREATE, SPW_CALL_MANAGED_ALLOC};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        for (unsigned long n = 1; n <= 2; n++) {
            spw_ctx *ctx = test_ctx(kinds[k] == SPW_CALL_MANAGED_ALLOC ? "residency=managed" : NULL);
            unsigned long c0 = spw__emu_calls(ctx->backend, kinds[k]);
            spw__emu_inject(ctx->backend, kinds[k], n, 0);
            spw_buf *a = NULL, *b = NULL;
            spw_status s1 = spw_buf_create(ctx, 4096, 0, &a);
            spw_status s2 = spw_buf_create(ctx, 4096, 0, &b);
            if (spw__emu_calls(ctx->backend, kinds[k]) - c0 >= n) assert_true(s1 != SPW_OK || s2 != SPW_OK);
            else assert_true(n > 1); /* the first call of each kind always happens */
            if (kinds[k] == SPW_CALL_HOST_ALLOC && s1) assert_int_equal(s1, SPW_ERR_HOST_OUT_OF_MEMORY);
            spw__emu_clear_faults(ctx->backend);
            if (!s1) assert_ok(spw_buf_destroy(a));
            if (!s2) assert_ok(spw_buf_destroy(b));
            assert_int_equal(ctx->engine->events_live, 0);
            spw_ctx_destroy(ctx);
        }
    }
    /* host_register may fail: the buffer still works, unpinned */
    spw_ctx *ctx = test_ctx("budget=64MiB");
    static uint8_t mem[8192];
    memset(mem, 9, sizeof mem);
    spw__emu_inject(ctx->backend, SPW_CALL_HOST_REGISTER, 1, 0);
    spw_buf *r;
    assert_ok(spw_buf_register_host(ctx, mem, sizeof mem, 0, &r));
    assert_false(r->registered);
    uint8_t x[8];
    assert_ok(spw_buf_read(r, 8000, x, 8));
    assert_int_equal(x[3], 9);
    assert_ok(spw_buf_destroy(r));
    spw_ctx_destroy(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sweep_explicit),
        cmocka_unit_test(test_sweep_explicit_novmm),
        cmocka_unit_test(test_sweep_plan),
        cmocka_unit_test(test_sweep_ring),
        cmocka_unit_test(test_sweep_managed),
        cmocka_unit_test(test_create_faults),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
