/* Model-based randomized test of the allocator: threads on their own streams allocate and free
 * at random (sometimes freeing on another stream); a reference model of live ranges checks that
 * no two live blocks overlap, that contents survive, and that the statistics match the model.
 * The budget invariant is checked after every operation. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define NTHREADS 4
#define OPS_PER_THREAD 25000 /* 100,000 operations in all */
#define SYNC_EVERY 1000
#define MAX_LIVE 48
#define BUDGET ((size_t)768 << 20)

typedef struct range {
    uintptr_t addr;
    size_t size; /* rounded to 512 as the allocator does */
    size_t req;
    uint64_t tag;
} range;

static struct {
    pthread_mutex_t mu;
    range live[NTHREADS * MAX_LIVE];
    int n;
    int64_t live_bytes;
    int64_t requested;
    long allocs, frees, ooms;
} model = {.mu = PTHREAD_MUTEX_INITIALIZER};

static spw_ctx *ctx;
static spw_stream streams[NTHREADS];
static pthread_barrier_t barrier;
static int on_emu;

static void model_add(uintptr_t addr, size_t req, uint64_t tag) {
    size_t size = (req + 511) / 512 * 512;
    pthread_mutex_lock(&model.mu);
    for (int i = 0; i < model.n; i++) {
        const range *r = &model.live[i];
        if (addr < r->addr + r->size && r->addr < addr + size)
            fail_msg("overlap: new [%#lx,+%zu) with live [%#lx,+%zu)", (unsigned long)addr, size,
                     (unsigned long)r->addr, r->size);
    }
    model.live[model.n++] = (range){addr, size, req, tag};
    model.live_bytes += (int64_t)size;
    model.requested += (int64_t)req;
    model.allocs++;
    pthread_mutex_unlock(&model.mu);
}

static void model_remove(uintptr_t addr) {
    pthread_mutex_lock(&model.mu);
    for (int i = 0; i < model.n; i++) {
        if (model.live[i].addr == addr) {
            model.live_bytes -= (int64_t)model.live[i].size;
            model.requested -= (int64_t)model.live[i].req;
            model.live[i] = model.live[--model.n];
            model.frees++;
            pthread_mutex_unlock(&model.mu);
            return;
        }
    }
    pthread_mutex_unlock(&model.mu);
    fail_msg("free of %#lx not in the model", (unsigned long)addr);
}

static size_t random_size(uint64_t *rng) {
    /* log-uniform 1 B .. 32 MiB, so both arenas and many bins are exercised */
    int bits = (int)(test_rand(rng) % 26);
    size_t base = (size_t)1 << bits;
    return base + test_rand(rng) % base;
}

static void stamp(void *p, size_t req, uint64_t tag) {
    if (!on_emu) return;
    size_t n = req < 8 ? req : 8;
    memcpy(p, &tag, n);
    if (req >= 16) memcpy((char *)p + req - 8, &tag, 8);
}

static void verify(const void *p, size_t req, uint64_t tag) {
    if (!on_emu) return;
    size_t n = req < 8 ? req : 8;
    if (memcmp(p, &tag, n) || (req >= 16 && memcmp((const char *)p + req - 8, &tag, 8)))
        fail_msg("contents of %p (%zu B) were overwritten while live", p, req);
}

static void check_budget(void) {
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    if ((size_t)st.held.current > BUDGET)
        fail_msg("budget broken: held %lld > budget %zu", (long long)st.held.current, BUDGET);
}

/* All threads stopped: the allocator's view must equal the model's. */
static void check_against_model(void) {
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    pthread_mutex_lock(&model.mu);
    assert_int_equal(st.live.current, model.live_bytes);
    assert_int_equal(st.requested.current, model.requested);
    assert_int_equal(st.allocs.total, model.allocs);
    assert_int_equal(st.frees.total, model.frees);
    assert_int_equal(st.ooms.total, model.ooms);
    pthread_mutex_unlock(&model.mu);
    assert_int_equal(st.cached.current, st.held.current - st.live.current);
    pthread_mutex_lock(&ctx->lock);
    spw_status s1 = spw__arena_check(ctx->small), s2 = spw__arena_check(ctx->large);
    size_t arena_held = spw__arena_held(ctx->small) + spw__arena_held(ctx->large);
    pthread_mutex_unlock(&ctx->lock);
    assert_ok(s1);
    assert_ok(s2);
    assert_int_equal((int64_t)arena_held, st.held.current);
    if (on_emu) assert_int_equal((int64_t)spw__emu_used(ctx->backend), st.held.current);
}

typedef struct slot {
    void *p;
    size_t req;
    uint64_t tag;
} slot;

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(id + 1);
    slot live[MAX_LIVE];
    int n = 0;
    for (int op = 0; op < OPS_PER_THREAD; op++) {
        bool do_alloc = n == 0 || (n < MAX_LIVE && test_rand(&rng) % 100 < 55);
        if (do_alloc) {
            size_t req = random_size(&rng);
            void *p = NULL;
            spw_status st = spw_malloc(ctx, req, streams[id], &p);
            if (st == SPW_ERR_OUT_OF_MEMORY) {
                if (!strstr(spw_last_error(), "budget")) fail_msg("OOM message lacks the budget: %s", spw_last_error());
                if (p != NULL) fail_msg("failed spw_malloc wrote its out pointer");
                pthread_mutex_lock(&model.mu);
                model.ooms++;
                pthread_mutex_unlock(&model.mu);
            } else {
                assert_ok(st);
                assert_int_equal((uintptr_t)p % 512, 0);
                uint64_t tag = test_rand(&rng);
                model_add((uintptr_t)p, req, tag);
                stamp(p, req, tag);
                live[n++] = (slot){p, req, tag};
            }
        } else {
            int k = (int)(test_rand(&rng) % (uint64_t)n);
            slot s = live[k];
            live[k] = live[--n];
            verify(s.p, s.req, s.tag);
            model_remove((uintptr_t)s.p);
            /* one free in ten is ordered on another stream: its pool moves there */
            spw_stream fs = test_rand(&rng) % 10 == 0 ? streams[(id + 1) % NTHREADS] : streams[id];
            if (fs != streams[id] && streams[id]) assert_ok(spw_stream_synchronize(ctx, streams[id]));
            assert_ok(spw_free(ctx, s.p, fs));
        }
        check_budget();
        if ((op + 1) % SYNC_EVERY == 0) {
            pthread_barrier_wait(&barrier);
            if (id == 0) check_against_model();
            pthread_barrier_wait(&barrier);
        }
    }
    for (int k = 0; k < n; k++) {
        verify(live[k].p, live[k].req, live[k].tag);
        model_remove((uintptr_t)live[k].p);
        assert_ok(spw_free(ctx, live[k].p, streams[id]));
    }
    return NULL;
}

static void randomized_against_model(void **state) {
    (void)state;
    on_emu = test_on_emu();
    char conf[128];
    snprintf(conf, sizeof conf, "budget=%zu,emu_capacity=2GiB", BUDGET);
    ctx = test_ctx(conf);
    for (int i = 0; i < NTHREADS; i++) assert_ok(spw_stream_create(ctx, &streams[i]));
    pthread_barrier_init(&barrier, NULL, NTHREADS);
    pthread_t th[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&barrier);
    check_against_model();
    assert_int_equal(model.n, 0);
    assert_true(model.allocs > 40000);

    /* Everything is free: the whole budget is available again in one block, and one byte past
     * what the budget can hold is refused. */
    void *p;
    assert_ok(spw_malloc(ctx, BUDGET - (4u << 20), NULL, &p));
    void *q = NULL;
    assert_status(spw_malloc(ctx, 8u << 20, NULL, &q), SPW_ERR_OUT_OF_MEMORY);
    assert_null(q);
    assert_ok(spw_free(ctx, p, NULL));
    check_budget();
    for (int i = 0; i < NTHREADS; i++) assert_ok(spw_stream_destroy(ctx, streams[i]));
    spw_ctx_destroy(ctx);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(randomized_against_model)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
