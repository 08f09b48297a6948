/*
 * Uploads that start while the previous occupant of their room is still read: a buffer evicted
 * to make room for an upload frees its block owing a wait on its last use (arena owed waits);
 * the upload copies the bytes that owe nothing first, then waits, then copies the rest. A
 * single slot of room plus a little more then overlaps each transfer with the work on the
 * buffer before it, as two whole slots would.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "test_util.h"

#define MiB ((size_t)1 << 20)

static bool all_equal(const volatile uint8_t *p, size_t n, uint8_t v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return false;
    return true;
}

/* Wait up to 5 s for n bytes at p to read v. */
static bool becomes(const volatile uint8_t *p, size_t n, uint8_t v) {
    for (int i = 0; i < 5000; i++) {
        if (all_equal(p, n, v)) return true;
        usleep(1000);
    }
    return false;
}

/* Room for one 4 MiB buffer and 2 MiB more, two read-only 4 MiB buffers (a filled with 0x11, b
 * with 0x22) and a stream. */
typedef struct pair {
    spw_ctx *ctx;
    spw_buf *a, *b;
    spw_stream s;
} pair;

static pair pair_make(void) {
    pair p;
    p.ctx = test_ctx("budget=6MiB,vmm=on,vmm_large_page=2MiB,grow_ahead=0");
    assert_ok(spw_buf_create(p.ctx, 4 * MiB, SPW_BUF_READ_ONLY, &p.a));
    assert_ok(spw_buf_create(p.ctx, 4 * MiB, SPW_BUF_READ_ONLY, &p.b));
    test_fill_buf(p.a, 0x11);
    test_fill_buf(p.b, 0x22);
    assert_ok(spw_stream_create(p.ctx, &p.s));
    return p;
}

/* Check the arena and free everything. */
static void pair_free(pair *p) {
    assert_ok(spw__arena_check(p->ctx->large));
    assert_ok(spw_buf_destroy(p->a));
    assert_ok(spw_buf_destroy(p->b));
    assert_ok(spw_stream_destroy(p->ctx, p->s));
    assert_ok(spw_ctx_destroy(p->ctx));
}

/* B's upload evicts A while A's reader (a gated host function) still runs: the 2 MiB of B that
 * do not overlap A arrive before the reader ends, A's bytes stay intact under it, and B's other
 * half arrives once it is done. */
static void test_upload_overlaps_last_use(void **state) {
    (void)state;
    TEST_REQUIRE_EMU(); /* device memory readable by the host */
    pair p = pair_make();
    spw_ctx *ctx = p.ctx;
    spw_buf *a = p.a, *b = p.b;
    spw_stream s = p.s;
    atomic_int gate, bad;
    atomic_init(&gate, 0);
    atomic_init(&bad, 0);
    void *da, *db;
    assert_ok(spw_acquire(a, s, SPW_ACCESS_READ, &da));
    test_kcheck ka = {da, 4 * MiB, 0x11, &gate, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &ka));
    assert_ok(spw_release(a, s));

    assert_ok(spw_acquire(b, s, SPW_ACCESS_READ, &db)); /* evicts a: 6 MiB hold one and a half */
    assert_false(a->resident);
    const volatile uint8_t *pb = db;
    uintptr_t lo = (uintptr_t)db, hi = lo + 4 * MiB, alo = (uintptr_t)da, ahi = alo + 4 * MiB;
    assert_true(lo > alo && lo < ahi && hi > ahi); /* placed past a's start, into the room beside it */
    size_t fresh = (size_t)(hi - ahi);               /* b's bytes beyond a's block */
    assert_int_equal(fresh, 2 * MiB);
    assert_true(becomes(pb + (ahi - lo), fresh, 0x22)); /* copied while a's reader waits */
    assert_true(all_equal((const volatile uint8_t *)da, 4 * MiB, 0x11)); /* a untouched under it */
    assert_int_equal(atomic_load(&gate), 0);
    atomic_store(&gate, 1);
    test_kcheck kb = {db, 4 * MiB, 0x22, NULL, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &kb));
    assert_ok(spw_release(b, s));
    assert_ok(spw_stream_synchronize(ctx, s));
    assert_int_equal(atomic_load(&bad), 0);
    assert_ok(spw__arena_check(ctx->large));
    spw_stats st = test_stats(ctx);
    assert_true((size_t)st.held.peak <= 6 * MiB);

    /* and back: a's upload evicts b the same way, from the other end of the room */
    atomic_store(&gate, 0);
    assert_ok(spw_acquire(b, s, SPW_ACCESS_READ, &db));
    kb = (test_kcheck){db, 4 * MiB, 0x22, &gate, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &kb));
    assert_ok(spw_release(b, s));
    assert_ok(spw_acquire(a, s, SPW_ACCESS_READ, &da));
    lo = (uintptr_t)da;
    uintptr_t blo = (uintptr_t)db;
    assert_true(lo < blo && lo + 4 * MiB > blo); /* before b, overlapping half of it */
    assert_true(becomes((const volatile uint8_t *)da, (size_t)(blo - lo), 0x11));
    assert_true(all_equal((const volatile uint8_t *)db, 4 * MiB, 0x22));
    atomic_store(&gate, 1);
    ka = (test_kcheck){da, 4 * MiB, 0x11, NULL, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &ka));
    assert_ok(spw_release(a, s));
    assert_ok(spw_stream_synchronize(ctx, s));
    assert_int_equal(atomic_load(&bad), 0);
    pair_free(&p);
}

/* The same eviction with the victim's reader already done: the wait it owed orders nothing, so
 * the upload is one copy and enqueues no stream wait, and its bytes are right. */
static void test_upload_after_a_finished_last_use_is_one_copy(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    pair p = pair_make();
    spw_ctx *ctx = p.ctx;
    spw_buf *a = p.a, *b = p.b;
    spw_stream s = p.s;
    atomic_int bad;
    atomic_init(&bad, 0);
    void *da, *db;
    assert_ok(spw_acquire(a, s, SPW_ACCESS_READ, &da));
    test_kcheck ka = {da, 4 * MiB, 0x11, NULL, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &ka));
    assert_ok(spw_release(a, s));
    assert_ok(spw_stream_synchronize(ctx, s)); /* a's last use is complete */
    spw_backend *be = ctx->backend;
    unsigned long copies = spw__emu_calls(be, SPW_CALL_MEMCPY), waits = spw__emu_calls(be, SPW_CALL_STREAM_WAIT);
    assert_ok(spw_acquire(b, s, SPW_ACCESS_READ, &db)); /* evicts a, into part of whose bytes b goes */
    assert_false(a->resident);
    uintptr_t lo = (uintptr_t)db, alo = (uintptr_t)da;
    assert_true(lo > alo && lo < alo + 4 * MiB);
    /* one copy, not two around a wait (with the wait owed: two copies and one stream wait more) */
    assert_int_equal(spw__emu_calls(be, SPW_CALL_MEMCPY) - copies, 1);
    assert_true(spw__emu_calls(be, SPW_CALL_STREAM_WAIT) - waits <= 2);
    test_kcheck kb = {db, 4 * MiB, 0x22, NULL, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &kb));
    assert_ok(spw_release(b, s));
    assert_ok(spw_stream_synchronize(ctx, s));
    assert_int_equal(atomic_load(&bad), 0);
    pair_free(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_upload_overlaps_last_use),
        cmocka_unit_test(test_upload_after_a_finished_last_use_is_one_copy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
