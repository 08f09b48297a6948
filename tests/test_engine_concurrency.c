/* The offload engine under threads (run under ThreadSanitizer in CI): several threads, each
 * with its own stream and buffers, plus read-only buffers shared by all, do random acquires,
 * releases (some in one call with the next acquire), prefetches, evictions, discards and host
 * reads under a budget that holds a fraction of the data, while another thread allocates with
 * spw_malloc (evicting buffers). Checks: every kernel sees the expected bytes, every buffer's
 * final bytes match its model, the budget holds after every operation. */
#include "test_util.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"

#define NT 4
#define OWN 3
#define SHARED 2
#define BSZ (256 * 1024)
#define OPS 250
#define RING 32

static spw_ctx *g_ctx;
static spw_buf *g_shared[SHARED];
static atomic_int g_bad, g_over, g_stop;

static uint8_t pat(uint8_t seed, uint8_t add, size_t i) { return (uint8_t)(((i * 5) ^ seed) + add); }

typedef struct karg {
    uint8_t *p;
    uint8_t seed, add;
    int op; /* 0 verify, 1 add one, 2 fill */
} karg;

static void kernel(void *a) {
    karg *k = a;
    if (k->op == 0) {
        for (size_t i = 0; i < BSZ; i += 97)
            if (k->p[i] != pat(k->seed, k->add, i)) {
                atomic_store(&g_bad, 1);
                return;
            }
    } else if (k->op == 1) {
        for (size_t i = 0; i < BSZ; i++) k->p[i] = (uint8_t)(k->p[i] + 1);
    } else {
        for (size_t i = 0; i < BSZ; i++) k->p[i] = pat(k->seed, 0, i);
    }
}

static void check_budget(void) {
    spw_stats st;
    if (spw_stats_get(g_ctx, &st) || (uint64_t)st.held.current > st.budget) atomic_store(&g_over, 1);
}

typedef struct worker_state {
    int id;
    spw_stream s;
    spw_buf *b[OWN];
    uint8_t seed[OWN], add[OWN];
    karg ring[RING];
    int nring;
    uint64_t rng;
    int failures;
} worker_state;

static karg *next_arg(worker_state *w) {
    if (w->nring == RING) {
        assert_ok(spw_stream_synchronize(g_ctx, w->s)); /* the ring's kernels are done */
        w->nring = 0;
    }
    return &w->ring[w->nring++];
}

static void *worker(void *arg) {
    worker_state *w = arg;
    uint8_t probe[256];
    for (int op = 0; op < OPS; op++) {
        int r = (int)(test_rand(&w->rng) % 100);
        int i = (int)(test_rand(&w->rng) % OWN);
        spw_buf *b = w->b[i];
        void *d;
        spw_status st = SPW_OK;
        if (r < 30) { /* read-modify-write an own buffer */
            if (!(st = spw_acquire(b, w->s, SPW_ACCESS_READ_WRITE, &d))) {
                karg *k = next_arg(w);
                *k = (karg){d, 0, 0, 1};
                assert_ok(spw_launch_host(g_ctx, w->s, kernel, k));
                w->add[i]++;
                assert_ok(spw_release(b, w->s));
            }
        } else if (r < 50) { /* verify an own buffer on the device */
            if (!(st = spw_acquire(b, w->s, SPW_ACCESS_READ, &d))) {
                karg *k = next_arg(w);
                *k = (karg){d, w->seed[i], w->add[i], 0};
                assert_ok(spw_launch_host(g_ctx, w->s, kernel, k));
                assert_ok(spw_release(b, w->s));
            }
        } else if (r < 65) { /* verify a shared read-only buffer, then (one time in two) an own
                              * buffer acquired by the call that releases the shared one */
            int j = (int)(test_rand(&w->rng) % SHARED);
            if (!(st = spw_acquire(g_shared[j], w->s, SPW_ACCESS_READ, &d))) {
                karg *k = next_arg(w);
                *k = (karg){d, (uint8_t)(100 + j), 0, 0};
                assert_ok(spw_launch_host(g_ctx, w->s, kernel, k));
                if (test_rand(&w->rng) % 2) {
                    assert_ok(spw_release(g_shared[j], w->s));
                } else if (!(st = spw_release_acquire(g_shared[j], w->s, b, w->s, SPW_ACCESS_READ, &d))) {
                    k = next_arg(w);
                    *k = (karg){d, w->seed[i], w->add[i], 0};
                    assert_ok(spw_launch_host(g_ctx, w->s, kernel, k));
                    assert_ok(spw_release(b, w->s));
                }
            }
        } else if (r < 72) {
            st = spw_prefetch(b, w->s);
        } else if (r < 80) {
            assert_ok(spw_evict(b));
        } else if (r < 88) { /* host read */
            assert_ok(spw_buf_read(b, 1000, probe, sizeof probe));
            for (size_t k = 0; k < sizeof probe; k++)
                if (probe[k] != pat(w->seed[i], w->add[i], 1000 + k)) atomic_store(&g_bad, 2);
        } else { /* discard, then overwrite on the device */
            assert_ok(spw_discard(b));
            if (!(st = spw_acquire(b, w->s, SPW_ACCESS_WRITE, &d))) {
                karg *k = next_arg(w);
                w->seed[i] = (uint8_t)test_rand(&w->rng);
                w->add[i] = 0;
                *k = (karg){d, w->seed[i], 0, 2};
                assert_ok(spw_launch_host(g_ctx, w->s, kernel, k));
                assert_ok(spw_release(b, w->s));
            } else {
                /* contents are dead until rewritten: write them from the host */
                uint8_t *tmp = malloc(BSZ);
                for (size_t k = 0; k < BSZ; k++) tmp[k] = pat(w->seed[i], w->add[i], k);
                assert_ok(spw_buf_write(b, 0, tmp, BSZ));
                free(tmp);
            }
        }
        /* everything pinned at once by other threads can exhaust the budget: a clean error */
        if (st && st != SPW_ERR_OUT_OF_MEMORY) fail_msg("op %d: %s: %s", r, spw_status_str(st), spw_last_error());
        if (st) w->failures++;
        check_budget();
    }
    assert_ok(spw_stream_synchronize(g_ctx, w->s));
    return NULL;
}

static void *allocator(void *arg) {
    (void)arg;
    spw_stream s;
    assert_ok(spw_stream_create(g_ctx, &s));
    while (!atomic_load(&g_stop)) {
        void *p = NULL;
        if (!spw_malloc(g_ctx, 512 * 1024, s, &p)) assert_ok(spw_free(g_ctx, p, s));
        check_budget();
    }
    assert_ok(spw_stream_synchronize(g_ctx, s));
    assert_ok(spw_stream_destroy(g_ctx, s));
    return NULL;
}

static void run(const char *conf) {
    g_ctx = test_ctx(conf);
    atomic_store(&g_bad, 0);
    atomic_store(&g_over, 0);
    atomic_store(&g_stop, 0);
    uint8_t *tmp = malloc(BSZ);
    for (int j = 0; j < SHARED; j++) {
        assert_ok(spw_buf_create(g_ctx, BSZ, SPW_BUF_READ_ONLY, &g_shared[j]));
        for (size_t k = 0; k < BSZ; k++) tmp[k] = pat((uint8_t)(100 + j), 0, k);
        assert_ok(spw_buf_write(g_shared[j], 0, tmp, BSZ));
    }
    static worker_state ws[NT];
    for (int t = 0; t < NT; t++) {
        memset(&ws[t], 0, sizeof ws[t]);
        ws[t].id = t;
        ws[t].rng = 0x9e3779b97f4a7c15ull * (uint64_t)(t + 1);
        assert_ok(spw_stream_create(g_ctx, &ws[t].s));
        for (int i = 0; i < OWN; i++) {
            assert_ok(spw_buf_create(g_ctx, BSZ, 0, &ws[t].b[i]));
            ws[t].seed[i] = (uint8_t)(t * 16 + i);
            for (size_t k = 0; k < BSZ; k++) tmp[k] = pat(ws[t].seed[i], 0, k);
            assert_ok(spw_buf_write(ws[t].b[i], 0, tmp, BSZ));
        }
    }
    pthread_t th[NT], at;
    assert_int_equal(pthread_create(&at, NULL, allocator, NULL), 0);
    for (int t = 0; t < NT; t++) assert_int_equal(pthread_create(&th[t], NULL, worker, &ws[t]), 0);
    for (int t = 0; t < NT; t++) pthread_join(th[t], NULL);
    atomic_store(&g_stop, 1);
    pthread_join(at, NULL);
    assert_int_equal(atomic_load(&g_bad), 0);
    assert_int_equal(atomic_load(&g_over), 0);
    for (int t = 0; t < NT; t++) {
        for (int i = 0; i < OWN; i++) {
            assert_ok(spw_buf_read(ws[t].b[i], 0, tmp, BSZ));
            for (size_t k = 0; k < BSZ; k++)
                if (tmp[k] != pat(ws[t].seed[i], ws[t].add[i], k)) fail_msg("thread %d buffer %d byte %zu lost", t, i, k);
            assert_ok(spw_buf_destroy(ws[t].b[i]));
        }
        assert_ok(spw_stream_destroy(g_ctx, ws[t].s));
    }
    spw_stats st;
    assert_ok(spw_stats_get(g_ctx, &st));
    assert_true(st.evictions_clean.total + st.evictions_dirty.total > 0);
    assert_int_equal(st.pinned.current, 0);
    free(tmp);
    spw_ctx_destroy(g_ctx); /* the shared buffers go with the context */
}

static void test_threads_explicit(void **state) {
    (void)state;
    TEST_REQUIRE_EMU(); /* host callbacks stand in for kernels: they touch device memory */
    run("budget=4MiB,grow_ahead=0");
}

static void test_threads_managed(void **state) {
    (void)state;
    run("budget=4MiB,grow_ahead=0,residency=managed");
}

typedef struct waiter {
    spw_buf *b;
    atomic_int started;
} waiter;

static void *acquire_release(void *arg) {
    waiter *w = arg;
    void *p;
    atomic_store(&w->started, 1);
    assert_ok(spw_acquire(w->b, NULL, SPW_ACCESS_READ, &p));
    assert_ok(spw_release(w->b, NULL));
    return NULL;
}

/* A buffer call that finds the context lock held counts one wait, with the time it waited; an
 * uncontended call counts none. */
static void test_lock_waits_are_counted(void **state) {
    (void)state;
    spw_ctx *ctx = test_ctx("budget=4MiB");
    waiter w = {.started = 0};
    assert_ok(spw_buf_create(ctx, 4096, 0, &w.b));
    acquire_release(&w);
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.lock_waits.total, 0);
    assert_int_equal(st.lock_wait_ns.total, 0);

    atomic_store(&w.started, 0);
    pthread_mutex_lock(&ctx->lock);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, acquire_release, &w), 0);
    while (!atomic_load(&w.started)) sched_yield();
    struct timespec d = {0, 50 * 1000 * 1000};
    nanosleep(&d, NULL);
    pthread_mutex_unlock(&ctx->lock);
    pthread_join(t, NULL);
    assert_ok(spw_stats_get(ctx, &st));
    assert_int_equal(st.lock_waits.total, 1);
    assert_true(st.lock_wait_ns.total >= 1000 * 1000);
    assert_ok(spw_buf_destroy(w.b));
    spw_ctx_destroy(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lock_waits_are_counted),
        cmocka_unit_test(test_threads_explicit),
        cmocka_unit_test(test_threads_managed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
