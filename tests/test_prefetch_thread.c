/* The prefetch worker (prefetch_thread=on): policy=plan's after-acquire prefetches issued from a
 * thread of the library. The contents every acquire sees, the prefetches it made, other threads
 * using the context meanwhile, teardown while it polls or holds a prefetch, and the records of
 * releases it makes (a use still running when its buffer is evicted or destroyed). emu only (the
 * byte checks read device memory on the host); a ThreadSanitizer target. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "test_util.h"

#define MiB ((size_t)1 << 20)
enum { NB = 8 };
static const size_t SZ = MiB;

/* 8 buffers of 1 MiB, each filled with its own byte, under room for 6 (a double buffer) */
static spw_ctx *worker_ctx(spw_buf **b, const char *extra) {
    char conf[256];
    snprintf(conf, sizeof conf, "budget=6MiB,policy=plan,prefetch=on,prefetch_early=0,grow_ahead=0,"
                                "prefetch_thread=on%s%s", extra ? "," : "", extra ? extra : "");
    spw_ctx *ctx = test_ctx(conf);
    for (int i = 0; i < NB; i++) {
        assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
        test_fill_buf(b[i], (uint8_t)(0x40 + i));
    }
    return ctx;
}

/* `steps` cyclic steps over b, every byte of every acquisition checked on the stream, gap_us
 * between acquisitions (a framework enqueuing the work that uses each: the worker's time) */
static void run_steps_gap(spw_ctx *ctx, spw_buf **b, int steps, atomic_int *bad, long gap_us) {
    const struct timespec gap = {0, gap_us * 1000};
    test_kcheck k[NB];
    for (int s = 0; s < steps; s++) {
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < NB; i++) {
            test_checked_read(ctx, b[i], (uint8_t)(0x40 + i), &k[i], bad);
            nanosleep(&gap, NULL);
        }
        assert_ok(spw_step_end(ctx));
        assert_ok(spw_stream_synchronize(ctx, NULL));
    }
}

static void run_steps(spw_ctx *ctx, spw_buf **b, int steps, atomic_int *bad) { run_steps_gap(ctx, b, steps, bad, 100); }

/* worker_ctx after `steps` checked steps (a plan learned: acquires now post prefetches) */
static spw_ctx *learned_ctx(spw_buf **b, int steps, atomic_int *bad) {
    spw_ctx *ctx = worker_ctx(b, NULL);
    atomic_init(bad, 0);
    run_steps(ctx, b, steps, bad);
    assert_int_equal(atomic_load(bad), 0);
    return ctx;
}

static void worker_prefetches_the_plan(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_buf *b[NB];
    spw_ctx *ctx = worker_ctx(b, "emu_link_gbps=4");
    atomic_int bad;
    atomic_init(&bad, 0);
    run_steps(ctx, b, 12, &bad);
    assert_int_equal(atomic_load(&bad), 0);
    /* the acquires handed their prefetches over, and the worker made them */
    assert_true(spw__pf_runs(ctx) > 0);
    spw_stats st = test_stats(ctx);
    assert_true(st.plan_prefetch_bytes.total > 0);
    assert_true(st.prefetch_hits.total > 0);
    assert_int_equal(st.plan_divergences.total, 0);
    assert_ok(spw__arena_check(ctx->large));
    spw_ctx_destroy(ctx);

    /* off: the acquiring call prefetches, and no worker exists */
    ctx = test_ctx("budget=6MiB,policy=plan,prefetch=on,prefetch_early=0,grow_ahead=0");
    for (int i = 0; i < NB; i++) {
        assert_ok(spw_buf_create(ctx, SZ, SPW_BUF_READ_ONLY, &b[i]));
        test_fill_buf(b[i], (uint8_t)(0x40 + i));
    }
    run_steps(ctx, b, 6, &bad);
    assert_null(ctx->engine->pf);
    assert_int_equal(spw__pf_runs(ctx), 0);
    assert_true(test_stats(ctx).plan_prefetch_bytes.total > 0);
    spw_ctx_destroy(ctx);

    spw_config *cfg = NULL;
    assert_ok(spw_config_create(&cfg));
    assert_status(spw_config_parse(cfg, "prefetch_thread=maybe"), SPW_ERR_CONFIG);
    assert_non_null(strstr(spw_last_error(), "off|on"));
    spw_config_destroy(cfg);
}

/* The static split's ring with the worker: the prefetches the worker makes are placed by the
 * ring as the acquiring call's would be, and every byte read is right. */
static void the_ring_with_the_worker(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_buf *b[NB];
    spw_ctx *ctx = worker_ctx(b, "pipeline=split,ring=on,vmm=on,small_limit=64KiB,vmm_page=1MiB,"
                                 "vmm_large_page=1MiB,emu_link_gbps=4");
    atomic_int bad;
    atomic_init(&bad, 0);
    run_steps(ctx, b, 10, &bad);
    assert_int_equal(atomic_load(&bad), 0);
    spw_stats st = test_stats(ctx);
    assert_true(spw__pf_runs(ctx) > 0);
    assert_true(st.ring_uploads.total >= 10);
    assert_true(st.plan_prefetch_bytes.total > 0);
    assert_int_equal(st.plan_divergences.total, 0);
    assert_ok(spw__arena_check(ctx->large));
    spw_ctx_destroy(ctx);
}

typedef struct reader_arg {
    spw_ctx *ctx;
    spw_buf *buf;
    atomic_int *stop;
    atomic_int *bad;
} reader_arg;

/* another thread on the same context: host reads of its own buffer and statistics */
static void *reader(void *p) {
    reader_arg *a = p;
    uint8_t *tmp = malloc(SZ);
    while (!atomic_load(a->stop)) {
        spw_stats st;
        if (spw_buf_read(a->buf, 0, tmp, SZ) != SPW_OK || spw_stats_get(a->ctx, &st) != SPW_OK) {
            atomic_fetch_add(a->bad, 1);
            break;
        }
        for (size_t i = 0; i < SZ; i += 4093)
            if (tmp[i] != 0x7e) atomic_fetch_add(a->bad, 1);
    }
    free(tmp);
    return NULL;
}

static void other_threads_meanwhile(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_buf *b[NB], *own;
    spw_ctx *ctx = worker_ctx(b, NULL);
    assert_ok(spw_buf_create(ctx, SZ, 0, &own));
    test_fill_buf(own, 0x7e);
    atomic_int bad, stop;
    atomic_init(&bad, 0);
    atomic_init(&stop, 0);
    reader_arg a = {ctx, own, &stop, &bad};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, reader, &a), 0);
    run_steps(ctx, b, 10, &bad);
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    assert_int_equal(atomic_load(&bad), 0);
    assert_true(spw__pf_runs(ctx) > 0);
    spw_ctx_destroy(ctx);
}

static void teardown_while_polling_or_pending(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_buf *b[NB];
    atomic_int bad;
    spw_ctx *ctx = learned_ctx(b, 4, &bad);
    /* a step left open (the worker polls), buffers destroyed right after an acquire posted one */
    assert_ok(spw_step_begin(ctx));
    void *d;
    assert_ok(spw_acquire(b[0], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b[0], NULL));
    for (int i = 1; i < NB; i++) assert_ok(spw_buf_destroy(b[i]));
    assert_ok(spw_acquire(b[0], NULL, SPW_ACCESS_READ, &d));
    test_kcheck k = {d, SZ, 0x40, NULL, &bad};
    assert_ok(spw_launch_host(ctx, NULL, test_kcheck_cb, &k));
    assert_ok(spw_release(b[0], NULL));
    assert_ok(spw_stream_synchronize(ctx, NULL));
    assert_int_equal(atomic_load(&bad), 0);
    spw_ctx_destroy(ctx); /* joins the polling worker */

    ctx = worker_ctx(b, NULL); /* destroyed with a prefetch posted and the step still open */
    run_steps(ctx, b, 3, &bad);
    assert_ok(spw_step_begin(ctx));
    assert_ok(spw_acquire(b[0], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b[0], NULL));
    spw_ctx_destroy(ctx);
    assert_int_equal(atomic_load(&bad), 0);
}

static void releases_leave_their_record_to_the_worker(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_buf *b[NB];
    atomic_int bad;
    spw_ctx *ctx = learned_ctx(b, 6, &bad);
    assert_true(spw__pf_marked(ctx) > 0); /* the worker recorded the releases' last uses */

    /* A write still running on another stream when its buffer is evicted right after the
     * release (the mark maybe not yet recorded): the write-back waits for the write, and the
     * host reads what it wrote. Destroyed right after a release, too. */
    spw_stream s;
    assert_ok(spw_stream_create(ctx, &s));
    spw_buf *w;
    assert_ok(spw_buf_create(ctx, SZ, 0, &w));
    test_fill_buf(w, 0x11);
    uint8_t *tmp = malloc(SZ);
    assert_non_null(tmp);
    for (int round = 0; round < 20; round++) {
        atomic_int gate;
        atomic_init(&gate, 0);
        void *d;
        assert_ok(spw_step_begin(ctx));
        assert_ok(spw_acquire(w, s, SPW_ACCESS_READ_WRITE, &d));
        test_kfill f = {d, SZ, (uint8_t)(0x20 + round), &gate};
        assert_ok(spw_launch_host(ctx, s, test_kfill_cb, &f));
        assert_ok(spw_release(w, s));
        assert_ok(spw_evict(w));
        atomic_store(&gate, 1);
        assert_ok(spw_step_end(ctx));
        assert_ok(spw_buf_read(w, 0, tmp, SZ));
        for (size_t i = 0; i < SZ; i += 4093) assert_int_equal(tmp[i], 0x20 + round);
        assert_ok(spw_stream_synchronize(ctx, s));
    }
    free(tmp);
    atomic_int gate;
    atomic_init(&gate, 0);
    void *d;
    assert_ok(spw_acquire(w, s, SPW_ACCESS_READ_WRITE, &d));
    test_kfill f = {d, SZ, 0x33, &gate};
    assert_ok(spw_launch_host(ctx, s, test_kfill_cb, &f));
    assert_ok(spw_release(w, s));
    atomic_store(&gate, 1);
    assert_ok(spw_buf_destroy(w));
    assert_ok(spw_stream_synchronize(ctx, s));
    assert_ok(spw_stream_destroy(ctx, s));
    assert_ok(spw__arena_check(ctx->large));
    assert_ok(spw__arena_check(ctx->small));
    spw_ctx_destroy(ctx);
}

/* What an acquire of b would find (taking the lock, as a test may): not resident (a demand load
 * follows), no upload outstanding, an upload the worker saw complete, or one it has not. */
enum { B_ABSENT, B_NO_XFER, B_SEEN, B_PENDING };
static int upload_state(spw_ctx *ctx, spw_buf *b) {
    pthread_mutex_lock(&ctx->lock);
    int st = !b->resident ? B_ABSENT : !b->xfer ? B_NO_XFER : b->dev_rec && b->dev_done ? B_SEEN : B_PENDING;
    pthread_mutex_unlock(&ctx->lock);
    return st;
}

/* The worker watches the uploads it enqueued: one seen complete lets its acquire skip both the
 * driver's question and the stream's wait (no stall); one not yet seen complete is waited on.
 * Either way every byte each acquisition reads is the buffer's (1 MiB uploads take 250 us at
 * 4 GB/s). Timing-free: before each acquire the test waits (up to 5 s) until the worker has
 * seen the buffer's upload, if it has one outstanding. */
static void uploads_seen_complete_need_no_wait(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_buf *b[NB];
    atomic_int bad;
    atomic_init(&bad, 0);
    spw_ctx *ctx = worker_ctx(b, "emu_link_gbps=4");
    run_steps_gap(ctx, b, 4, &bad, 0); /* the plan is learned; uploads still running at acquire */
    assert_int_equal(atomic_load(&bad), 0); /* the waits held every read after its upload */

    uint64_t seen0 = spw__pf_seen(ctx);
    const struct timespec poll = {0, 200000}, gap = {0, 2000000};
    test_kcheck k[NB];
    int seen_acquires = 0;
    for (int s = 0; s < 6; s++) {
        assert_ok(spw_step_begin(ctx));
        for (int i = 0; i < NB; i++) {
            int st = upload_state(ctx, b[i]);
            for (int t = 0; st == B_PENDING && t < 25000; t++) {
                nanosleep(&poll, NULL);
                st = upload_state(ctx, b[i]);
            }
            assert_int_not_equal(st, B_PENDING); /* the worker asks while the step is open */
            int64_t stalls = test_stats(ctx).stalls.total;
            test_checked_read(ctx, b[i], (uint8_t)(0x40 + i), &k[i], &bad);
            if (st == B_SEEN) {
                seen_acquires++;
                assert_int_equal(test_stats(ctx).stalls.total, stalls); /* no wait (a release never stalls) */
            }
            nanosleep(&gap, NULL); /* room for the worker's prefetch of the next buffer */
        }
        assert_ok(spw_step_end(ctx));
        assert_ok(spw_stream_synchronize(ctx, NULL));
    }
    assert_int_equal(atomic_load(&bad), 0);
    assert_true(seen_acquires >= 3); /* the plan streams 2-3 of the 8 buffers a step */
    assert_true(spw__pf_seen(ctx) - seen0 >= (uint64_t)seen_acquires);
    assert_ok(spw__arena_check(ctx->large));
    spw_ctx_destroy(ctx); /* with watches left: nothing leaks (ASan), nothing is read after free */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(worker_prefetches_the_plan),
        cmocka_unit_test(the_ring_with_the_worker),
        cmocka_unit_test(other_threads_meanwhile),
        cmocka_unit_test(teardown_while_polling_or_pending),
        cmocka_unit_test(releases_leave_their_record_to_the_worker),
        cmocka_unit_test(uploads_seen_complete_need_no_wait),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
