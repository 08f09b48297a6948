/* The offload engine on emu: every state transition, data integrity through eviction and
 * prefetch, budget and host-budget limits, managed residency, bad input, stats and the trace. */
#include "test_util.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine.h"

#define MiB SPW_MiB

/* ---- host "kernels" ---- */

static void add_cb(void *a) { /* read-modify-write: every byte += v */
    test_kfill *k = a;
    for (size_t i = 0; i < k->n; i++) k->p[i] = (uint8_t)(k->p[i] + k->v);
}
typedef struct kcopy {
    const uint8_t *src;
    uint8_t *dst;
    size_t n;
} kcopy;
static void copy_cb(void *a) {
    kcopy *k = a;
    memcpy(k->dst, k->src, k->n);
}

/* Copy b's device copy (uploaded by a READ acquire if need be) to out, as a kernel reading it
 * would, and wait for it. */
static void read_device(spw_ctx *ctx, spw_buf *b, uint8_t *out) {
    void *d = NULL;
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ, &d));
    kcopy kc = {d, out, spw_buf_size(b)};
    assert_ok(spw_launch_host(ctx, NULL, copy_cb, &kc));
    assert_ok(spw_release(b, NULL));
    assert_ok(spw_stream_synchronize(ctx, NULL));
}

static void assert_held_ok(spw_ctx *ctx) {
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    if ((uint64_t)st.held.current > st.budget)
        fail_msg("budget invariant: held %lld > budget %llu", (long long)st.held.current,
                 (unsigned long long)st.budget);
}

static void check_contents(spw_buf *b, uint8_t v) {
    size_t n = spw_buf_size(b);
    uint8_t *tmp = malloc(n);
    assert_ok(spw_buf_read(b, 0, tmp, n));
    for (size_t i = 0; i < n; i++)
        if (tmp[i] != v) fail_msg("byte %zu is %u, want %u", i, tmp[i], v);
    free(tmp);
}

/* ---- state transitions ---- */

static void test_states(void **state) {
    (void)state;
    TEST_REQUIRE_EMU(); /* host callbacks stand in for kernels: they touch device memory */
    spw_ctx *ctx = test_ctx("budget=64MiB");
    spw_buf *b;
    assert_ok(spw_buf_create(ctx, MiB, 0, &b));
    /* host (zeros) */
    assert_false(b->resident);
    assert_true(b->hv);
    check_contents(b, 0);
    test_fill_buf(b, 7);
    /* host -> clean (acquire READ uploads) */
    void *d = NULL;
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ, &d));
    assert_true(b->resident && b->dv && b->hv && b->acq == 1);
    uint8_t *out = malloc(MiB);
    kcopy kc = {d, out, MiB};
    assert_ok(spw_launch_host(ctx, NULL, copy_cb, &kc));
    assert_ok(spw_release(b, NULL));
    assert_ok(spw_stream_synchronize(ctx, NULL));
    for (size_t i = 0; i < MiB; i++) assert_int_equal(out[i], 7);
    /* clean -> dirty (READ_WRITE) */
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ_WRITE, &d));
    assert_false(b->hv);
    test_kfill kf = {d, MiB, 1, NULL};
    assert_ok(spw_launch_host(ctx, NULL, add_cb, &kf));
    assert_ok(spw_release(b, NULL));
    /* dirty -> host (write-back) */
    spw_stats s0, s1;
    assert_ok(spw_stats_get(ctx, &s0));
    assert_ok(spw_evict(b));
    assert_false(b->resident);
    assert_true(b->hv);
    assert_ok(spw_stats_get(ctx, &s1));
    assert_int_equal(s1.evictions_dirty.total - s0.evictions_dirty.total, 1);
    assert_int_equal(s1.bytes_d2h.total - s0.bytes_d2h.total, MiB);
    check_contents(b, 8);
    /* host -> dirty via WRITE (no upload), then spw_buf_read copies back (stays resident, clean) */
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_WRITE, &d));
    assert_ok(spw_stats_get(ctx, &s0));
    assert_int_equal(s0.bytes_h2d.total, s1.bytes_h2d.total); /* no upload */
    kf.p = d;
    kf.v = 9;
    assert_ok(spw_launch_host(ctx, NULL, test_kfill_cb, &kf));
    assert_ok(spw_release(b, NULL));
    check_contents(b, 9);
    assert_true(b->resident && b->hv && b->dv);
    /* clean -> host: eviction drops, no copy */
    assert_ok(spw_stats_get(ctx, &s0));
    assert_ok(spw_evict(b));
    assert_ok(spw_stats_get(ctx, &s1));
    assert_int_equal(s1.evictions_clean.total - s0.evictions_clean.total, 1);
    assert_int_equal(s1.bytes_d2h.total, s0.bytes_d2h.total);
    /* prefetch -> clean, then an acquire counts a prefetch hit */
    assert_ok(spw_prefetch(b, NULL));
    assert_true(b->resident && b->prefetched);
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b, NULL));
    assert_ok(spw_stats_get(ctx, &s0));
    assert_int_equal(s0.prefetch_hits.total - s1.prefetch_hits.total, 1);
    /* dead: discard a dirty buffer; eviction never writes it back; reading it is refused */
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ_WRITE, &d));
    assert_ok(spw_release(b, NULL));
    assert_ok(spw_discard(b));
    assert_status(spw_buf_read(b, 0, out, 1), SPW_ERR_STATE);
    assert_ok(spw_stats_get(ctx, &s0));
    assert_ok(spw_evict(b));
    assert_ok(spw_stats_get(ctx, &s1));
    assert_int_equal(s1.bytes_d2h.total, s0.bytes_d2h.total);
    assert_int_equal(s1.evictions_clean.total - s0.evictions_clean.total, 1);
    /* dead -> alive by WRITE acquire: no upload */
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_WRITE, &d));
    assert_ok(spw_stats_get(ctx, &s0));
    assert_int_equal(s0.bytes_h2d.total, s1.bytes_h2d.total);
    kf.p = d;
    kf.v = 3;
    assert_ok(spw_launch_host(ctx, NULL, test_kfill_cb, &kf));
    assert_ok(spw_release(b, NULL));
    check_contents(b, 3);
    /* partial host write into a dirty resident buffer keeps the rest */
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ_WRITE, &d));
    kf.p = d;
    kf.v = 1;
    assert_ok(spw_launch_host(ctx, NULL, add_cb, &kf));
    assert_ok(spw_release(b, NULL));
    uint8_t five[16];
    memset(five, 5, sizeof five);
    assert_ok(spw_buf_write(b, 100, five, sizeof five));
    assert_ok(spw_buf_read(b, 0, out, MiB));
    for (size_t i = 0; i < MiB; i++) assert_int_equal(out[i], (i >= 100 && i < 116) ? 5 : 4);
    /* ... and the device copy saw it too */
    memset(out, 0, MiB);
    read_device(ctx, b, out);
    for (size_t i = 0; i < MiB; i++) assert_int_equal(out[i], (i >= 100 && i < 116) ? 5 : 4);
    assert_ok(spw_buf_destroy(b));
    assert_held_ok(ctx);
    free(out);
    spw_ctx_destroy(ctx);
}

/* spw_buf_host_begin .. _end: the caller writes the host copy in place; meanwhile nothing
 * uploads it (prefetch moves nothing, acquire and the other calls are refused), a dirty device
 * copy is written back first, and after the end an acquire uploads the new contents. */
static void test_host_write_window(void **state) {
    (void)state;
    TEST_REQUIRE_EMU(); /* host callbacks stand in for kernels: they touch device memory */
    spw_ctx *ctx = test_ctx("budget=64MiB");
    spw_buf *b;
    void *d = NULL;
    uint8_t *out = malloc(MiB);
    assert_ok(spw_buf_create(ctx, MiB, 0, &b));
    test_fill_buf(b, 2);
    /* a dirty device copy (every byte 3) is written back by the begin, then dropped */
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ_WRITE, &d));
    test_kfill kf = {d, MiB, 1, NULL};
    assert_ok(spw_launch_host(ctx, NULL, add_cb, &kf));
    assert_ok(spw_release(b, NULL));
    assert_ok(spw_buf_host_begin(b));
    assert_false(b->resident);
    uint8_t *host = b->host;
    for (size_t i = 0; i < MiB; i++)
        if (host[i] != 3) fail_msg("byte %zu is %u after the begin, want the device's 3", i, host[i]);
    /* while open: no upload, every other call refused, the contents the caller's */
    spw_stats s0, s1;
    assert_ok(spw_stats_get(ctx, &s0));
    assert_ok(spw_prefetch(b, NULL));
    assert_false(b->resident);
    assert_status(spw_acquire(b, NULL, SPW_ACCESS_READ, &d), SPW_ERR_STATE);
    assert_non_null(strstr(spw_last_error(), "open for host writes"));
    assert_status(spw_evict(b), SPW_ERR_STATE);
    assert_status(spw_buf_read(b, 0, out, 1), SPW_ERR_STATE);
    assert_status(spw_buf_write(b, 0, out, 1), SPW_ERR_STATE);
    assert_status(spw_discard(b), SPW_ERR_STATE);
    assert_status(spw_buf_destroy(b), SPW_ERR_STATE);
    assert_status(spw_buf_host_begin(b), SPW_ERR_STATE);
    assert_ok(spw_stats_get(ctx, &s1));
    assert_int_equal(s1.bytes_h2d.total, s0.bytes_h2d.total);
    memset(host, 9, MiB);
    assert_ok(spw_buf_host_end(b));
    assert_status(spw_buf_host_end(b), SPW_ERR_STATE);
    /* the next acquire uploads what the caller wrote */
    read_device(ctx, b, out);
    for (size_t i = 0; i < MiB; i++) assert_int_equal(out[i], 9);
    /* an acquired buffer cannot be opened; a plain one opens and closes with nothing resident */
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ, &d));
    assert_status(spw_buf_host_begin(b), SPW_ERR_STATE);
    assert_ok(spw_release(b, NULL));
    assert_ok(spw_buf_host_begin(b));
    assert_ok(spw_buf_host_end(b));
    check_contents(b, 9);
    assert_status(spw_buf_host_begin(NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_host_end(NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(spw_buf_destroy(b));
    assert_held_ok(ctx);
    free(out);
    spw_ctx_destroy(ctx);
}

/* Nested acquires and two streams: pinned until the last release, chained last-use events. */
static void test_nested_and_streams(void **state) {
    (void)state;
    spw_ctx *ctx = test_ctx("budget=64MiB");
    spw_stream s1, s2;
    assert_ok(spw_stream_create(ctx, &s1));
    assert_ok(spw_stream_create(ctx, &s2));
    spw_buf *b;
    assert_ok(spw_buf_create(ctx, MiB, 0, &b));
    test_fill_buf(b, 2);
    void *d1, *d2;
    assert_ok(spw_acquire(b, s1, SPW_ACCESS_READ, &d1));
    assert_ok(spw_acquire(b, s2, SPW_ACCESS_READ, &d2));
    assert_ptr_equal(d1, d2);
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_true(st.pinned.current >= (int64_t)MiB);
    assert_ok(spw_release(b, s1));
    assert_status(spw_evict(b), SPW_ERR_STATE); /* still acquired once */
    assert_status(spw_buf_destroy(b), SPW_ERR_STATE);
    assert_ok(spw_release(b, s2));
    assert_status(spw_release(b, s2), SPW_ERR_STATE); /* released twice */
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.pinned.current, 0);
    assert_ok(spw_evict(b));
    check_contents(b, 2);
    assert_ok(spw_buf_destroy(b));
    assert_ok(spw_stream_destroy(ctx, s1));
    assert_ok(spw_stream_destroy(ctx, s2));
    spw_ctx_destroy(ctx);
}

/* A streamed buffer's cycle (upload, acquire and release on a caller's stream, eviction) costs
 * at most what a hand-written double buffer costs: one copy, one event record per transfer and
 * per release, one stream wait each way. The upload's record serves the host copy too: a host read
 * right after an upload on a slow link still waits for it. */
static void test_streaming_calls(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = test_ctx("budget=8MiB,policy=lru,emu_link_gbps=2");
    spw_stream s;
    assert_ok(spw_stream_create(ctx, &s));
    spw_buf *b[3];
    for (int i = 0; i < 3; i++) {
        assert_ok(spw_buf_create(ctx, 4 * MiB, SPW_BUF_READ_ONLY, &b[i]));
        test_fill_buf(b[i], (uint8_t)(10 + i));
    }
    spw_backend *be = ctx->backend;
    static const spw_call counted[] = {SPW_CALL_MEMCPY, SPW_CALL_EVENT_RECORD, SPW_CALL_STREAM_WAIT,
                                       SPW_CALL_EVENT_SYNC, SPW_CALL_STREAM_SYNC};
    static const unsigned long want[] = {1, 2, 2, 0, 0};
    unsigned long before[5];
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 3; i++) {
            for (int c = 0; c < 5; c++) before[c] = spw__emu_calls(be, counted[c]);
            void *d;
            assert_ok(spw_acquire(b[i], s, SPW_ACCESS_READ, &d));
            assert_ok(spw_release(b[i], s));
            if (round == 0) continue; /* the first round fills the device */
            /* at most: a wait on a victim's event that is already complete is not enqueued */
            for (int c = 0; c < 5; c++)
                if (spw__emu_calls(be, counted[c]) - before[c] > want[c] ||
                    (counted[c] == SPW_CALL_MEMCPY && spw__emu_calls(be, counted[c]) - before[c] != want[c]))
                    fail_msg("round %d buffer %d: %lu %s calls, want %lu", round, i,
                             spw__emu_calls(be, counted[c]) - before[c], spw__call_name(counted[c]), want[c]);
            assert_ok(spw_stream_synchronize(ctx, s));
            for (size_t k = 0; k < 4 * MiB; k += 4099)
                if (((uint8_t *)d)[k] != 10 + i) fail_msg("round %d buffer %d: device byte %zu wrong", round, i, k);
        }
    }
    /* evicted and uploaded again with nothing recorded since: the host waits on the upload */
    assert_ok(spw_evict(b[0]));
    assert_ok(spw_prefetch(b[0], s));
    check_contents(b[0], 10);
    test_fill_buf(b[0], 77); /* the host copy is rewritten while resident: the device copy follows */
    void *d;
    assert_ok(spw_acquire(b[0], s, SPW_ACCESS_READ, &d));
    assert_ok(spw_stream_synchronize(ctx, s));
    assert_int_equal(((uint8_t *)d)[4 * MiB - 1], 77);
    assert_ok(spw_release(b[0], s));
    for (int i = 0; i < 3; i++) assert_ok(spw_buf_destroy(b[i]));
    assert_ok(spw_stream_destroy(ctx, s));
    spw_ctx_destroy(ctx);
}

/* spw_release_acquire: the release, then the acquire, under one lock; a failed release acquires
 * nothing, a failed acquire keeps the release; another context's buffer is acquired on its own. */
static void test_release_acquire(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = test_ctx("budget=8MiB,policy=lru");
    spw_ctx *other = test_ctx("budget=8MiB,policy=lru");
    spw_buf *b[3], *far;
    for (int i = 0; i < 3; i++) {
        assert_ok(spw_buf_create(ctx, 4 * MiB, SPW_BUF_READ_ONLY, &b[i]));
        test_fill_buf(b[i], (uint8_t)(20 + i));
    }
    assert_ok(spw_buf_create(other, 4 * MiB, 0, &far));
    void *d;
    assert_ok(spw_release_acquire(NULL, NULL, b[0], NULL, SPW_ACCESS_READ, &d)); /* a plain acquire */
    for (int i = 1; i < 3; i++) {
        /* room for two: the third evicts the one released by the same call before it */
        assert_ok(spw_release_acquire(b[i - 1], NULL, b[i], NULL, SPW_ACCESS_READ, &d));
        assert_int_equal(test_stats(ctx).pinned.current, 4 * MiB);
        assert_ok(spw_stream_synchronize(ctx, NULL));
        for (size_t k = 0; k < 4 * MiB; k += 4099)
            if (((uint8_t *)d)[k] != 20 + i) fail_msg("buffer %d: device byte %zu wrong", i, k);
    }
    /* b[2] held: NULL and bad modes change nothing */
    assert_status(spw_release_acquire(b[2], NULL, NULL, NULL, SPW_ACCESS_READ, &d), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_release_acquire(b[2], NULL, b[0], NULL, (spw_access)9, &d), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_release_acquire(b[2], NULL, b[0], NULL, SPW_ACCESS_READ, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_int_equal(test_stats(ctx).pinned.current, 4 * MiB);
    /* a failed release (b[0] is not acquired) acquires nothing */
    assert_status(spw_release_acquire(b[0], NULL, b[1], NULL, SPW_ACCESS_READ, &d), SPW_ERR_STATE);
    assert_non_null(strstr(spw_last_error(), "not acquired"));
    assert_int_equal(test_stats(ctx).pinned.current, 4 * MiB);
    /* a failed acquire (WRITE on a read-only buffer) keeps the release */
    assert_status(spw_release_acquire(b[2], NULL, b[1], NULL, SPW_ACCESS_WRITE, &d), SPW_ERR_INVALID_ARGUMENT);
    assert_int_equal(test_stats(ctx).pinned.current, 0);
    /* another context's buffer */
    assert_ok(spw_acquire(b[0], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release_acquire(b[0], NULL, far, NULL, SPW_ACCESS_READ, &d));
    assert_int_equal(test_stats(ctx).pinned.current, 0);
    assert_int_equal(test_stats(other).pinned.current, 4 * MiB);
    assert_ok(spw_release(far, NULL));
    for (int i = 0; i < 3; i++) assert_ok(spw_buf_destroy(b[i]));
    assert_ok(spw_buf_destroy(far));
    spw_ctx_destroy(ctx);
    spw_ctx_destroy(other);
}

/* LRU eviction under pressure, the budget after every operation, everything acquired -> OOM
 * naming the pinned bytes, on_exhaust=fail, spw_malloc evicting buffers. */
static void test_pressure(void **state) {
    (void)state;
    TEST_REQUIRE_EMU(); /* host callbacks stand in for kernels: they touch device memory */
    spw_ctx *ctx = test_ctx("budget=4MiB,grow_ahead=0");
    enum { N = 8 };
    spw_buf *b[N];
    for (int i = 0; i < N; i++) {
        assert_ok(spw_buf_create(ctx, MiB, 0, &b[i]));
        test_fill_buf(b[i], (uint8_t)(i + 1));
    }
    void *d;
    for (int round = 0; round < 3; round++)
        for (int i = 0; i < N; i++) {
            assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ_WRITE, &d));
            test_kfill kf = {d, MiB, 1, NULL};
            assert_ok(spw_launch_host(ctx, NULL, add_cb, &kf));
            assert_ok(spw_release(b[i], NULL));
            assert_ok(spw_stream_synchronize(ctx, NULL)); /* kf lives on this frame */
            assert_held_ok(ctx);
        }
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_true(st.evictions_dirty.total >= N);
    for (int i = 0; i < N; i++) check_contents(b[i], (uint8_t)(i + 4));
    /* LRU order: after touching 0..3 in order, acquiring 4 evicts 0 first */
    for (int i = 0; i < N; i++) assert_ok(spw_evict(b[i]));
    for (int i = 0; i < 4; i++) {
        assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ, &d));
        assert_ok(spw_release(b[i], NULL));
    }
    assert_true(b[0]->resident && b[1]->resident && b[2]->resident && b[3]->resident);
    assert_ok(spw_acquire(b[4], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b[4], NULL));
    assert_false(b[0]->resident); /* the least recently released goes first */
    assert_true(b[1]->resident && b[2]->resident && b[3]->resident);
    /* spw_prefetch_free displaces nothing: with the budget full it moves nothing; into the room
     * an eviction left it uploads, contents intact */
    spw_stats before, after;
    assert_ok(spw_stats_get(ctx, &before));
    assert_ok(spw_prefetch_free(b[5], NULL));
    assert_ok(spw_stats_get(ctx, &after));
    assert_false(b[5]->resident);
    assert_true(b[1]->resident && b[2]->resident && b[3]->resident && b[4]->resident);
    assert_int_equal(after.bytes_h2d.total, before.bytes_h2d.total);
    assert_int_equal(after.evictions_clean.total + after.evictions_dirty.total,
                     before.evictions_clean.total + before.evictions_dirty.total);
    assert_ok(spw_evict(b[1]));
    assert_ok(spw_prefetch_free(b[5], NULL));
    assert_true(b[5]->resident && b[5]->prefetched);
    assert_true(b[2]->resident && b[3]->resident && b[4]->resident);
    assert_ok(spw_prefetch_free(b[5], NULL)); /* resident already: nothing to do */
    check_contents(b[5], (uint8_t)(5 + 4));
    /* everything acquired: OOM with the pinned bytes in the message, nothing changed */
    int held = 0;
    void *dd[N];
    spw_status s = SPW_OK;
    for (int i = 0; i < N && !s; i++) {
        s = spw_acquire(b[i], NULL, SPW_ACCESS_READ, &dd[i]);
        if (!s) held++;
    }
    assert_int_equal(s, SPW_ERR_OUT_OF_MEMORY);
    assert_non_null(strstr(spw_last_error(), "pinned"));
    assert_null(strstr(spw_last_error(), "pinned 0 B"));
    assert_false(b[held]->resident);
    void *p = NULL;
    assert_status(spw_malloc(ctx, MiB, NULL, &p), SPW_ERR_OUT_OF_MEMORY);
    for (int i = 0; i < held; i++) assert_ok(spw_release(b[i], NULL));
    /* spw_malloc evicts unpinned buffers */
    assert_ok(spw_malloc(ctx, 3 * MiB, NULL, &p));
    assert_held_ok(ctx);
    assert_ok(spw_free(ctx, p, NULL));
    for (int i = 0; i < N; i++) check_contents(b[i], (uint8_t)(i + 4));
    for (int i = 0; i < N; i++) assert_ok(spw_buf_destroy(b[i]));
    spw_ctx_destroy(ctx);

    /* on_exhaust=fail: never evicts */
    ctx = test_ctx("budget=2MiB,on_exhaust=fail,grow_ahead=0");
    assert_ok(spw_buf_create(ctx, MiB, 0, &b[0]));
    assert_ok(spw_buf_create(ctx, 2 * MiB, 0, &b[1]));
    assert_ok(spw_acquire(b[0], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b[0], NULL));
    assert_status(spw_acquire(b[1], NULL, SPW_ACCESS_READ, &d), SPW_ERR_OUT_OF_MEMORY);
    assert_non_null(strstr(spw_last_error(), "on_exhaust=fail"));
    assert_true(b[0]->resident);
    assert_false(b[1]->resident);
    spw_ctx_destroy(ctx); /* destroys live buffers too */
}

/* Host pool: slabs, not one host_alloc per buffer; host budget exhaustion names the numbers. */
static void test_host_pool(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = test_ctx("budget=64MiB,host_budget=80MiB");
    unsigned long a0 = spw__emu_calls(ctx->backend, SPW_CALL_HOST_ALLOC);
    spw_buf *b[16];
    for (int i = 0; i < 16; i++) assert_ok(spw_buf_create(ctx, MiB, 0, &b[i]));
    assert_int_equal(spw__emu_calls(ctx->backend, SPW_CALL_HOST_ALLOC) - a0, 1);
    spw_buf *big = NULL;
    assert_status(spw_buf_create(ctx, 70 * MiB, 0, &big), SPW_ERR_HOST_OUT_OF_MEMORY);
    assert_non_null(strstr(spw_last_error(), "host budget"));
    assert_null(big);
    for (int i = 0; i < 16; i++) assert_ok(spw_buf_destroy(b[i]));
    assert_ok(spw_buf_create(ctx, 70 * MiB, 0, &big)); /* the empty slab is returned first */
    check_contents(big, 0);
    assert_ok(spw_buf_destroy(big));
    /* registered caller memory: no pool memory, no copy */
    uint8_t *mine = malloc(MiB);
    memset(mine, 42, MiB);
    spw_buf *r;
    assert_ok(spw_buf_register_host(ctx, mine, MiB, SPW_BUF_READ_ONLY, &r));
    check_contents(r, 42);
    void *d;
    assert_ok(spw_acquire(r, NULL, SPW_ACCESS_READ, &d));
    assert_true(d != mine);
    assert_ok(spw_release(r, NULL));
    assert_ok(spw_buf_destroy(r));
    free(mine);
    spw_ctx_destroy(ctx);
}

/* Caller memory the system will not page-lock (emu_pin_limit, as WSL2 limits pinned memory)
 * is still a buffer, its copies from pageable memory; host_pageable counts it until destroyed. */
static void test_register_host_past_the_pin_limit(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = test_ctx("budget=64MiB,emu_pin_limit=3MiB");
    uint8_t *mem[2] = {malloc(2 * MiB), malloc(2 * MiB)};
    spw_buf *r[2];
    for (int i = 0; i < 2; i++) {
        memset(mem[i], 7 + i, 2 * MiB);
        assert_ok(spw_buf_register_host(ctx, mem[i], 2 * MiB, SPW_BUF_READ_ONLY, &r[i]));
    }
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.host_pageable.current, 2 * MiB); /* the second one: 2 + 2 > 3 MiB */
    spw_buf *again; /* memory already pinned (the first one's): not counted */
    assert_ok(spw_buf_register_host(ctx, mem[0], 2 * MiB, SPW_BUF_READ_ONLY, &again));
    check_contents(again, 7);
    assert_ok(spw_buf_destroy(again));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.host_pageable.current, 2 * MiB);
    check_contents(r[1], 8);
    void *d;
    assert_ok(spw_acquire(r[1], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_stream_synchronize(ctx, NULL));
    assert_int_equal(((uint8_t *)d)[2 * MiB - 1], 8);
    assert_ok(spw_release(r[1], NULL));
    assert_ok(spw_buf_destroy(r[1]));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.host_pageable.current, 0);
    assert_ok(spw_buf_destroy(r[0])); /* the page-locked one leaves the counter alone */
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.host_pageable.current, 0);
    assert_int_equal(st.host_pageable.peak, 2 * MiB);
    spw_ctx_destroy(ctx);
    /* host_register=off: none is page-locked (the pageable path, measured on purpose) */
    ctx = test_ctx("budget=64MiB,host_register=off");
    unsigned long regs = spw__emu_calls(ctx->backend, SPW_CALL_HOST_REGISTER);
    assert_ok(spw_buf_register_host(ctx, mem[0], 2 * MiB, SPW_BUF_READ_ONLY, &r[0]));
    assert_int_equal(spw__emu_calls(ctx->backend, SPW_CALL_HOST_REGISTER), regs);
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.host_pageable.current, 2 * MiB);
    check_contents(r[0], 7);
    assert_ok(spw_buf_destroy(r[0]));
    free(mem[0]);
    free(mem[1]);
    spw_ctx_destroy(ctx);
}

/* One step of the pin-share pattern: A and B stay on the device, C and D are uploaded and
 * evicted again; returns the bytes uploaded from pageable host copies during the step. */
static int64_t pin_share_step(spw_ctx *ctx, spw_buf **r) {
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    int64_t before = st.h2d_pageable.total;
    assert_ok(spw_step_begin(ctx));
    for (int i = 0; i < 4; i++) {
        void *d;
        assert_ok(spw_acquire(r[i], NULL, SPW_ACCESS_READ, &d));
        assert_ok(spw_stream_synchronize(ctx, NULL));
        assert_int_equal(((uint8_t *)d)[MiB - 1], 20 + i);
        assert_ok(spw_release(r[i], NULL));
        if (i >= 2) assert_ok(spw_evict(r[i]));
    }
    assert_ok(spw_stream_synchronize(ctx, NULL));
    assert_ok(spw_step_end(ctx));
    assert_ok(spw_stats_get(ctx, &st));
    return st.h2d_pageable.total - before;
}

/* Page-locked memory short (pin_limit, or a system's limit as emu_pin_limit emulates): the host
 * copies registered first got it, but the buffers that move are others. At the end of step 4
 * the host copies uploaded in the step are page-locked in place of those idle for two steps,
 * so from then on no upload reads pageable memory; contents stay whole. */
static void test_page_locked_memory_goes_to_the_buffers_that_move(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    const char *conf[] = {"budget=8MiB,pin_limit=2MiB", "budget=8MiB,emu_pin_limit=2MiB",
                          "budget=8MiB,pin_limit=2MiB,pin_rebalance=off"};
    for (int c = 0; c < 3; c++) {
        spw_ctx *ctx = test_ctx(conf[c]);
        uint8_t *mem[4];
        spw_buf *r[4];
        for (int i = 0; i < 4; i++) {
            mem[i] = malloc(MiB);
            memset(mem[i], 20 + i, MiB);
            assert_ok(spw_buf_register_host(ctx, mem[i], MiB, SPW_BUF_READ_ONLY, &r[i]));
            assert_true(r[i]->pageable == (i >= 2));
        }
        for (int step = 1; step <= 3; step++) assert_int_equal(pin_share_step(ctx, r), 2 * MiB);
        assert_int_equal(pin_share_step(ctx, r), 2 * MiB); /* step 4 uploads, then its end moves the locks */
        spw_stats st;
        assert_ok(spw_stats_get(ctx, &st));
        assert_int_equal(st.host_pageable.current, 2 * MiB); /* as many as before, other ones */
        if (c < 2) {
            assert_int_equal(st.repins.total, 4);
            for (int i = 0; i < 4; i++) assert_true(r[i]->pageable == (i < 2));
            for (int step = 5; step <= 8; step++) assert_int_equal(pin_share_step(ctx, r), 0);
            /* the unlocked ones are still whole: evicted, they come back from pageable memory */
            assert_ok(spw_evict(r[0]));
            check_contents(r[0], 20);
            assert_int_equal(pin_share_step(ctx, r), MiB);
        } else {
            assert_int_equal(st.repins.total, 0);
            assert_int_equal(pin_share_step(ctx, r), 2 * MiB);
        }
        for (int i = 0; i < 4; i++) assert_ok(spw_buf_destroy(r[i]));
        assert_ok(spw_stats_get(ctx, &st));
        assert_int_equal(st.host_pageable.current, 0);
        assert_int_equal(ctx->engine->pinned_user, 0);
        for (int i = 0; i < 4; i++) free(mem[i]);
        spw_ctx_destroy(ctx);
    }
}

/* Managed residency: same API, budget charged while resident; refused without concurrent
 * managed access with a message naming residency=explicit. */
static void test_managed(void **state) {
    (void)state;
    spw_ctx *ctx = test_ctx("budget=4MiB,residency=managed,grow_ahead=0");
    if (!ctx->dev.concurrent_managed_access) {
        spw_buf *b = NULL;
        assert_status(spw_buf_create(ctx, MiB, 0, &b), SPW_ERR_UNSUPPORTED);
        assert_non_null(strstr(spw_last_error(), "residency=explicit"));
        spw_ctx_destroy(ctx);
        return;
    }
    enum { N = 6 };
    spw_buf *b[N];
    for (int i = 0; i < N; i++) {
        assert_ok(spw_buf_create(ctx, MiB, i == 0 ? SPW_BUF_READ_ONLY : 0, &b[i]));
        assert_true(b[i]->managed);
        test_fill_buf(b[i], (uint8_t)(10 + i));
    }
    void *d;
    for (int r = 0; r < 2; r++)
        for (int i = 1; i < N; i++) {
            assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ_WRITE, &d));
            test_kfill kf = {d, MiB, 1, NULL};
            assert_ok(spw_launch_host(ctx, NULL, add_cb, &kf));
            assert_ok(spw_release(b[i], NULL));
            assert_ok(spw_stream_synchronize(ctx, NULL));
            assert_held_ok(ctx);
        }
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_true(st.evictions_dirty.total + st.evictions_clean.total > 0);
    for (int i = 1; i < N; i++) check_contents(b[i], (uint8_t)(12 + i));
    assert_status(spw_acquire(b[0], NULL, SPW_ACCESS_WRITE, &d), SPW_ERR_INVALID_ARGUMENT);
    for (int i = 0; i < N; i++) assert_ok(spw_buf_destroy(b[i]));
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.held.current - st.cached.current, 0); /* charges refunded */
    spw_ctx_destroy(ctx);

    if (!test_on_emu()) return;
    ctx = test_ctx("budget=4MiB");
    ctx->dev.concurrent_managed_access = 0; /* as on WSL2 */
    spw_buf *m = NULL;
    assert_status(spw_buf_create(ctx, MiB, SPW_BUF_MANAGED, &m), SPW_ERR_UNSUPPORTED);
    assert_non_null(strstr(spw_last_error(), "residency=explicit"));
    assert_ok(spw_buf_create(ctx, MiB, 0, &m)); /* explicit still works */
    spw_ctx_destroy(ctx);
}

/* A destroy that cannot wait for the buffer's transfers fails and frees nothing: the buffer
 * stays usable with its contents, and a later destroy frees everything. */
static void test_destroy_failure_keeps_buffer(void **state) {
    (void)state;
    TEST_REQUIRE_EMU();
    spw_ctx *ctx = test_ctx("budget=4MiB,grow_ahead=0");
    spw_buf *b = NULL;
    assert_ok(spw_buf_create(ctx, MiB, 0, &b));
    void *d;
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_WRITE, &d));
    test_kfill kf = {d, MiB, 0x5a, NULL};
    assert_ok(spw_launch_host(ctx, NULL, test_kfill_cb, &kf));
    assert_ok(spw_release(b, NULL));
    assert_ok(spw_evict(b)); /* write-back in flight (or done): the destroy must wait for it */
    spw__emu_inject(ctx->backend, SPW_CALL_EVENT_SYNC, 1, 1);
    assert_status(spw_buf_destroy(b), SPW_ERR_BACKEND);
    assert_non_null(strstr(spw_last_error(), "nothing freed"));
    spw__emu_clear_faults(ctx->backend);
    check_contents(b, 0x5a);
    assert_ok(spw_buf_destroy(b));
    assert_status(spw_buf_destroy(b), SPW_ERR_STATE); /* destroyed once only: use after destroy */
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.buffers_host.current + st.buffers_resident.current, 0);
    assert_int_equal(ctx->engine->events_live, 0);
    spw_ctx_destroy(ctx);
}

/* ---- read-only managed buffers: read-mostly replicas ---- */

static spw_stats stats_now(spw_ctx *ctx) {
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    return st;
}

/* Read-only managed buffers are made resident as read-mostly replicas and evicted without a
 * transfer: no bytes_d2h, the budget refunded at once, the replica collapsed (advice) only
 * after its last device use completed, a pending collapse cancelled by a new acquire (no
 * bytes moved), a failed collapse retried without losing data, destroy with a collapse
 * pending, and the read-write fallback when read-mostly is refused. Contents are checked by
 * the "kernels" and by host reads throughout. */
static void test_managed_read_only(void **state) {
    (void)state;
    TEST_REQUIRE_EMU(); /* fault injection, call counts, internal state */
    spw_ctx *ctx = test_ctx("budget=4MiB,residency=managed,grow_ahead=0");
    spw_backend *be = ctx->backend;
    enum { N = 6 };
    spw_buf *b[N];
    for (int i = 0; i < N; i++) {
        assert_ok(spw_buf_create(ctx, MiB, SPW_BUF_READ_ONLY, &b[i]));
        test_fill_buf(b[i], (uint8_t)(40 + i));
    }
    spw_stream s;
    assert_ok(spw_stream_create(ctx, &s));
    atomic_int gate, bad;
    atomic_init(&gate, 0);
    atomic_init(&bad, 0);
    test_kcheck k[64];
    int nk = 0;
    void *d;

    /* a use that is still running when the buffer is evicted */
    assert_ok(spw_acquire(b[0], s, SPW_ACCESS_READ, &d));
    assert_true(b[0]->adv_rm && b[0]->replica);
    k[nk] = (test_kcheck){d, MiB, 40, &gate, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &k[nk++]));
    assert_ok(spw_release(b[0], s));
    spw_stats s0 = stats_now(ctx);
    unsigned long adv0 = spw__emu_calls(be, SPW_CALL_MANAGED_ADVISE);
    unsigned long pf0 = spw__emu_calls(be, SPW_CALL_PREFETCH);
    assert_ok(spw_evict(b[0]));
    spw_stats s1 = stats_now(ctx);
    assert_false(b[0]->resident);
    assert_int_equal(s1.bytes_d2h.total - s0.bytes_d2h.total, 0);
    assert_int_equal(s1.evictions_clean.total - s0.evictions_clean.total, 1);
    assert_int_equal(s0.held.current - s1.held.current, (int64_t)MiB); /* refunded at once */
    assert_int_equal(spw__emu_calls(be, SPW_CALL_PREFETCH), pf0);      /* nothing moved */
    /* engine calls while the use runs: no advice yet */
    for (int i = 0; i < 3; i++) s1 = stats_now(ctx);
    assert_true(b[0]->collapsing && b[0]->adv_rm);
    assert_int_equal(s1.managed_collapses.total, s0.managed_collapses.total);
    assert_int_equal(spw__emu_calls(be, SPW_CALL_MANAGED_ADVISE), adv0);
    atomic_store(&gate, 1);
    assert_ok(spw_stream_synchronize(ctx, s));
    assert_ok(spw_step_begin(ctx)); /* the next engine call (any) collapses */
    assert_false(b[0]->collapsing || b[0]->replica);
    assert_true(b[0]->adv_rm); /* set again at once: the next acquire needs no advice */
    assert_ok(spw_step_end(ctx));
    s1 = stats_now(ctx);
    assert_int_equal(s1.managed_collapses.total - s0.managed_collapses.total, 1);
    assert_int_equal(spw__emu_calls(be, SPW_CALL_MANAGED_ADVISE) - adv0, 2); /* unset, set */
    assert_null(ctx->engine->c_first);

    /* acquire/evict cycles over more buffers than the budget holds; rounds 0 and 2 wait for
     * each use (every eviction's collapse is then due at the next call), round 1 runs ahead
     * of the "kernels" (collapses pending, some cancelled by the next acquire) */
    atomic_store(&gate, 1);
    for (int r = 0; r < 3; r++) {
        spw_stream rs = r == 1 ? s : NULL;
        s0 = stats_now(ctx);
        for (int i = 0; i < N; i++) {
            assert_ok(spw_acquire(b[i], rs, SPW_ACCESS_READ, &d));
            k[nk] = (test_kcheck){d, MiB, (uint8_t)(40 + i), NULL, &bad};
            assert_ok(spw_launch_host(ctx, rs, test_kcheck_cb, &k[nk++]));
            assert_ok(spw_release(b[i], rs));
            if (r != 1) assert_ok(spw_stream_synchronize(ctx, rs));
            assert_held_ok(ctx);
        }
        assert_ok(spw_stream_synchronize(ctx, rs));
        s1 = stats_now(ctx);
        assert_false(atomic_load(&bad));
        assert_int_equal(s1.bytes_d2h.total, 0);
        assert_int_equal(s1.evictions_dirty.total, 0);
        assert_true(s1.evictions_clean.total - s0.evictions_clean.total >= 2);
        if (r != 1)
            assert_int_equal(s1.managed_collapses.total - s0.managed_collapses.total,
                             s1.evictions_clean.total - s0.evictions_clean.total);
        assert_null(ctx->engine->c_first); /* every use done: nothing left pending */
    }
    for (int i = 0; i < N; i++) check_contents(b[i], (uint8_t)(40 + i));

    /* acquire again before the collapse ran: cancelled, the replica serves, nothing counted */
    assert_ok(spw_evict(b[1]));
    assert_ok(spw_acquire(b[1], s, SPW_ACCESS_READ, &d));
    atomic_store(&gate, 0);
    k[nk] = (test_kcheck){d, MiB, 41, &gate, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &k[nk++]));
    assert_ok(spw_release(b[1], s));
    assert_ok(spw_evict(b[1]));
    assert_true(b[1]->collapsing && b[1]->replica);
    s0 = stats_now(ctx);
    adv0 = spw__emu_calls(be, SPW_CALL_MANAGED_ADVISE);
    assert_ok(spw_acquire(b[1], s, SPW_ACCESS_READ, &d));
    assert_true(b[1]->resident && !b[1]->collapsing && b[1]->adv_rm);
    s1 = stats_now(ctx);
    assert_int_equal(s1.bytes_h2d.total - s0.bytes_h2d.total, 0);
    assert_int_equal(spw__emu_calls(be, SPW_CALL_MANAGED_ADVISE), adv0); /* advice in effect */
    k[nk] = (test_kcheck){d, MiB, 41, NULL, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &k[nk++]));
    assert_ok(spw_release(b[1], s));
    atomic_store(&gate, 1);
    assert_ok(spw_stream_synchronize(ctx, s));
    assert_false(atomic_load(&bad));
    assert_int_equal(stats_now(ctx).managed_collapses.total, s0.managed_collapses.total);

    /* a failed collapse stays pending, data intact, and is retried */
    assert_ok(spw_evict(b[1]));
    spw__emu_inject(be, SPW_CALL_MANAGED_ADVISE, 1, 1);
    s0 = stats_now(ctx);
    check_contents(b[1], 41);
    assert_true(b[1]->collapsing && b[1]->adv_rm);
    spw__emu_clear_faults(be);
    s1 = stats_now(ctx);
    assert_false(b[1]->collapsing);
    assert_true(b[1]->adv_rm); /* read-mostly set again after the collapse */
    assert_int_equal(s1.managed_collapses.total - s0.managed_collapses.total, 1);
    /* ... and when setting read-mostly again fails: collapsed, plain managed from then on */
    assert_ok(spw_acquire(b[1], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b[1], NULL));
    assert_ok(spw_evict(b[1]));
    assert_ok(spw_stream_synchronize(ctx, NULL));
    assert_true(b[1]->collapsing && b[1]->adv_rm && b[1]->adv_dev);
    int64_t c0 = ctx->stats.managed_collapses.total; /* read without an engine call */
    spw__emu_inject(be, SPW_CALL_MANAGED_ADVISE, 2, 0); /* unset passes, setting again fails */
    check_contents(b[1], 41); /* an engine call: collapses */
    assert_false(b[1]->collapsing || b[1]->adv_rm);
    assert_true(b[1]->adv_dev); /* the host stays the preferred location */
    assert_int_equal(stats_now(ctx).managed_collapses.total - c0, 1);
    spw__emu_clear_faults(be);

    /* destroy with a collapse pending leaves nothing listed */
    assert_ok(spw_acquire(b[2], s, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b[2], s));
    assert_ok(spw_evict(b[2]));
    spw__emu_inject(be, SPW_CALL_MANAGED_ADVISE, 1, 1);
    assert_ok(spw_stream_synchronize(ctx, s));
    (void)stats_now(ctx);
    assert_true(b[2]->collapsing);
    assert_ok(spw_buf_destroy(b[2]));
    assert_null(ctx->engine->c_first);
    spw__emu_clear_faults(be);

    /* read-mostly refused: the read-write way (migration to the host, counted) */
    spw__emu_inject(be, SPW_CALL_MANAGED_ADVISE, 2, 0); /* the collapse's re-set fails */
    assert_ok(spw_evict(b[3]));
    (void)stats_now(ctx); /* its last use is done: collapsed */
    assert_false(b[3]->resident || b[3]->adv_rm);
    spw__emu_clear_faults(be);
    spw__emu_inject(be, SPW_CALL_MANAGED_ADVISE, 1, 1);
    assert_ok(spw_acquire(b[3], NULL, SPW_ACCESS_READ, &d));
    spw__emu_clear_faults(be);
    assert_false(b[3]->adv_rm);
    assert_ok(spw_release(b[3], NULL));
    s0 = stats_now(ctx);
    assert_ok(spw_evict(b[3]));
    s1 = stats_now(ctx);
    assert_int_equal(s1.bytes_d2h.total - s0.bytes_d2h.total, (int64_t)MiB);
    assert_false(b[3]->collapsing);
    check_contents(b[3], 43);

    /* a host write invalidates the replica: its next prefetch moves (and counts) the bytes */
    assert_ok(spw_acquire(b[5], NULL, SPW_ACCESS_READ, &d));
    assert_ok(spw_release(b[5], NULL));
    assert_ok(spw_stream_synchronize(ctx, NULL));
    test_fill_buf(b[5], 77);
    atomic_store(&gate, 0);
    assert_ok(spw_acquire(b[5], s, SPW_ACCESS_READ, &d));
    k[nk] = (test_kcheck){d, MiB, 77, &gate, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &k[nk++]));
    assert_ok(spw_release(b[5], s));
    assert_ok(spw_evict(b[5]));
    assert_true(b[5]->collapsing && !b[5]->replica);
    s0 = stats_now(ctx);
    assert_ok(spw_acquire(b[5], s, SPW_ACCESS_READ, &d));
    assert_int_equal(stats_now(ctx).bytes_h2d.total - s0.bytes_h2d.total, (int64_t)MiB);
    assert_ok(spw_release(b[5], s));
    atomic_store(&gate, 1);
    assert_ok(spw_stream_synchronize(ctx, s));
    assert_false(atomic_load(&bad));
    check_contents(b[5], 77);
    test_fill_buf(b[5], 45);

    /* context destroy with a collapse pending (its use still running at the eviction) */
    for (int i = 0; i < N; i++)
        if (i != 2) check_contents(b[i], (uint8_t)(40 + i));
    atomic_store(&gate, 0);
    assert_ok(spw_acquire(b[4], s, SPW_ACCESS_READ, &d));
    k[nk] = (test_kcheck){d, MiB, 44, &gate, &bad};
    assert_ok(spw_launch_host(ctx, s, test_kcheck_cb, &k[nk++]));
    assert_ok(spw_release(b[4], s));
    assert_ok(spw_evict(b[4]));
    assert_true(b[4]->collapsing);
    atomic_store(&gate, 1);
    assert_ok(spw_stream_destroy(ctx, s));
    assert_false(atomic_load(&bad));
    spw_ctx_destroy(ctx);
}

/* Bad input: clear errors, nothing changes. */
static void test_bad_input(void **state) {
    (void)state;
    spw_ctx *ctx = test_ctx("budget=64MiB");
    spw_buf *b = NULL, *ro = NULL;
    void *d = NULL;
    uint8_t x[8] = {0};
    assert_status(spw_buf_create(NULL, 1, 0, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_create(ctx, 1, 0, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_create(ctx, 0, 0, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(spw_last_error(), "size 0"));
    assert_status(spw_buf_create(ctx, SIZE_MAX, 0, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_create(ctx, 1, 0x80, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_create(ctx, 1, SPW_BUF_MANAGED | SPW_BUF_EXPLICIT, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_null(b);
    assert_status(spw_buf_register_host(ctx, NULL, 8, 0, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_register_host(ctx, (void *)(UINTPTR_MAX - 4), 8, 0, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_register_host(ctx, x, 8, SPW_BUF_MANAGED, &b), SPW_ERR_UNSUPPORTED);
    assert_status(spw_acquire(NULL, NULL, SPW_ACCESS_READ, &d), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_release(NULL, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_prefetch_free(NULL, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(spw_last_error(), "spw_prefetch_free: buffer is NULL"));
    assert_status(spw_buf_destroy(NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_step_begin(NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_int_equal(spw_buf_size(NULL), 0);
    /* not a buffer */
    uint64_t junk[32] = {0};
    assert_status(spw_evict((spw_buf *)junk), SPW_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(spw_last_error(), "not a spillway buffer"));

    assert_ok(spw_buf_create(ctx, 4096, SPW_BUF_READ_ONLY, &ro));
    assert_ok(spw_buf_create(ctx, 4096, 0, &b));
    /* write to a read-only buffer on the device */
    assert_status(spw_acquire(ro, NULL, SPW_ACCESS_WRITE, &d), SPW_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(spw_last_error(), "read-only"));
    assert_status(spw_acquire(ro, NULL, SPW_ACCESS_READ_WRITE, &d), SPW_ERR_INVALID_ARGUMENT);
    assert_false(ro->resident);
    assert_status(spw_acquire(b, NULL, (spw_access)0, &d), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_acquire(b, NULL, (spw_access)7, &d), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_acquire(b, NULL, SPW_ACCESS_READ, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_false(b->resident);
    /* sizes and offsets */
    assert_status(spw_buf_write(b, 0, NULL, 8), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_write(b, 0, x, 0), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_write(b, 4090, x, 8), SPW_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(spw_last_error(), "outside the buffer"));
    assert_status(spw_buf_write(b, SIZE_MAX, x, 8), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_buf_read(b, 8, x, SIZE_MAX - 4), SPW_ERR_INVALID_ARGUMENT);
    check_contents(b, 0);
    /* release without acquire */
    assert_status(spw_release(b, NULL), SPW_ERR_STATE);
    assert_non_null(strstr(spw_last_error(), "released twice"));
    /* host I/O and discard while acquired */
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_WRITE, &d));
    assert_status(spw_buf_write(b, 0, x, 8), SPW_ERR_STATE);
    assert_status(spw_buf_read(b, 0, x, 8), SPW_ERR_STATE);
    assert_status(spw_discard(b), SPW_ERR_STATE);
    assert_ok(spw_release(b, NULL));
    /* use after destroy */
    assert_ok(spw_buf_destroy(b));
    assert_status(spw_acquire(b, NULL, SPW_ACCESS_READ, &d), SPW_ERR_STATE);
    assert_non_null(strstr(spw_last_error(), "destroyed"));
    assert_status(spw_buf_destroy(b), SPW_ERR_STATE);
    assert_status(spw_buf_read(b, 0, x, 1), SPW_ERR_STATE);
    assert_int_equal(spw_buf_size(b), 0);
    assert_int_equal(spw_buf_size(ro), 4096);
    spw_ctx_destroy(ctx);
}

/* Options, stats in the summary, the Chrome trace file. */
static void test_options_stats_trace(void **state) {
    (void)state;
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    assert_status(spw_config_set(cfg, "residency", "unified"), SPW_ERR_CONFIG);
    assert_non_null(strstr(spw_last_error(), "explicit|managed"));
    assert_status(spw_config_set(cfg, "policy", "fifo"), SPW_ERR_CONFIG);
    assert_status(spw_config_set(cfg, "host_budget", "0"), SPW_ERR_CONFIG);
    assert_ok(spw_config_set(cfg, "host_budget", "25%"));
    char v[64];
    assert_ok(spw_config_get(cfg, "policy", v, sizeof v));
    assert_string_equal(v, "lru");
    spw_config_destroy(cfg);

    char path[] = "/tmp/spw_trace_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    char conf[128];
    snprintf(conf, sizeof conf, "budget=2MiB,grow_ahead=0,trace=%s", path);
    spw_ctx *ctx = test_ctx(conf);
    spw_buf *b[3];
    void *d;
    for (int i = 0; i < 3; i++) assert_ok(spw_buf_create(ctx, MiB, 0, &b[i]));
    assert_ok(spw_step_begin(ctx));
    for (int i = 0; i < 3; i++) {
        assert_ok(spw_acquire(b[i], NULL, SPW_ACCESS_READ_WRITE, &d));
        assert_ok(spw_release(b[i], NULL));
    }
    assert_ok(spw_step_end(ctx));
    char *text = test_summary(ctx, 1);
    assert_non_null(strstr(text, "\"bytes_h2d\":{"));
    assert_non_null(strstr(text, "\"evictions_dirty\":{"));
    assert_non_null(strstr(text, "\"stall_ns\":{"));
    free(text);
    spw_ctx_destroy(ctx);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char all[65536];
    size_t n = fread(all, 1, sizeof all - 1, f);
    all[n] = 0;
    fclose(f);
    unlink(path);
    assert_non_null(strstr(all, "\"traceEvents\":["));
    assert_non_null(strstr(all, "\"name\":\"upload\""));
    assert_non_null(strstr(all, "write-back"));
    assert_non_null(strstr(all, "evict (write-back)"));
    assert_non_null(strstr(all, "]}"));

    spw_config_create(&cfg);
    spw_config_set(cfg, "backend", "emu");
    spw_config_set(cfg, "trace", "/nonexistent-dir/x.json");
    ctx = NULL;
    assert_status(spw_ctx_create(cfg, &ctx), SPW_ERR_IO);
    assert_non_null(strstr(spw_last_error(), "/nonexistent-dir/x.json"));
    spw_config_destroy(cfg);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_states),         cmocka_unit_test(test_nested_and_streams),
        cmocka_unit_test(test_host_write_window),
        cmocka_unit_test(test_streaming_calls), cmocka_unit_test(test_release_acquire),
        cmocka_unit_test(test_pressure),       cmocka_unit_test(test_host_pool),
        cmocka_unit_test(test_register_host_past_the_pin_limit),
        cmocka_unit_test(test_page_locked_memory_goes_to_the_buffers_that_move),
        cmocka_unit_test(test_managed),        cmocka_unit_test(test_managed_read_only),
        cmocka_unit_test(test_destroy_failure_keeps_buffer),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_options_stats_trace),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
