/* The PyTorch pluggable-allocator entry points (spw_torch_*) on emu: sizes, streams, NULL and
 * double free, the per-device budgets and messages, record_stream ordering, reset, memory
 * fraction, configuration, and eviction of offload buffers by a torch allocation. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "spillway_torch.h"
#include "test_util.h"

#define MiB ((size_t)1 << 20)
#define CONF "backend=emu,emu_capacity=256MiB,budget=0:8MiB;1:16MiB"

#define assert_msg_has(text)                                                                   \
    do {                                                                                       \
        if (!strstr(spw_last_error(), text)) fail_msg("message lacks '%s': %s", text, spw_last_error()); \
    } while (0)

static int setup(void **state) {
    (void)state;
    unsetenv("SPILLWAY_CONF");
    assert_ok(spw_torch_shutdown());
    assert_ok(spw_torch_configure(CONF));
    return 0;
}

static int teardown(void **state) {
    (void)state;
    assert_ok(spw_torch_shutdown());
    return 0;
}

static spw_ctx *ctx_of(int device) {
    spw_ctx *c = NULL;
    assert_ok(spw_torch_context(device, 1, &c));
    return c;
}

static void sizes(void **s) {
    (void)s;
    void *a = spw_torch_alloc(1, 0, NULL);
    void *b = spw_torch_alloc(513, 0, NULL);
    void *c = spw_torch_alloc(3 * MiB, 0, NULL);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(c);
    assert_true(a != b && b != c && a != c);
    assert_int_equal((uintptr_t)a % 512, 0);
    assert_int_equal((uintptr_t)b % 512, 0);
    assert_int_equal((uintptr_t)c % 512, 0);
    spw_stats st = test_stats(ctx_of(0));
    assert_int_equal(st.requested.current, 1 + 513 + 3 * MiB);
    assert_null(spw_torch_alloc(0, 0, NULL));
    assert_msg_has("size 0");
    /* a size other than the allocated one frees nothing */
    spw_torch_free(c, 3 * MiB - 1, 0, NULL);
    assert_msg_has("allocated with 3145728 B, freed with 3145727 B");
    assert_int_equal(test_stats(ctx_of(0)).live.current, st.live.current);
    spw_torch_free(a, 1, 0, NULL);
    spw_torch_free(b, 513, 0, NULL);
    spw_torch_free(c, 3 * MiB, 0, NULL);
    st = test_stats(ctx_of(0));
    assert_int_equal(st.live.current, 0);
    assert_int_equal(st.frees.total, 3);
}

static void per_device_contexts(void **s) {
    (void)s;
    void *p0 = spw_torch_alloc(MiB, 0, NULL);
    void *p1 = spw_torch_alloc(MiB, 1, NULL);
    void *p2 = spw_torch_alloc(MiB, 2, NULL);
    assert_non_null(p0);
    assert_non_null(p1);
    assert_non_null(p2);
    spw_ctx *c0 = ctx_of(0), *c1 = ctx_of(1), *c2 = ctx_of(2);
    assert_true(c0 != c1 && c1 != c2);
    assert_int_equal(spw_ctx_budget(c0), 8 * MiB);
    assert_int_equal(spw_ctx_budget(c1), 16 * MiB);
    assert_int_equal(spw_ctx_budget(c2), (size_t)(256 * MiB * 0.9)); /* not listed: the default 90% */
    assert_int_equal(c0->cfg.device, 0);
    assert_int_equal(c1->cfg.device, 1);
    assert_int_equal(c0->cfg.grow_ahead == 0, 1);
    assert_int_equal(c0->cfg.vmm, SPW_TRI_OFF); /* plain segments unless asked */
    /* a pointer of device 1 is not device 0's */
    spw_torch_free(p1, MiB, 0, NULL);
    assert_msg_has("was not allocated by this context");
    assert_int_equal(test_stats(c1).live.current, (int64_t)MiB);
    spw_torch_free(p0, MiB, 0, NULL);
    spw_torch_free(p1, MiB, 1, NULL);
    spw_torch_free(p2, MiB, 2, NULL);
    assert_null(spw_torch_alloc(MiB, -1, NULL));
    assert_msg_has("device -1 is out of range");
    assert_null(spw_torch_alloc(MiB, 64, NULL));
    assert_msg_has("device 64 is out of range");
    /* no context yet: not created by a query without create */
    spw_ctx *c5 = NULL;
    assert_status(spw_torch_context(5, 0, &c5), SPW_ERR_NOT_FOUND);
    assert_null(c5);
}

/* The reclaim hook: a refusal first asks it for memory (here: a "cache" of the caller's own
 * segments, freed by the hook, as PyTorch's pool would be) and tries again; the hook runs with no
 * spillway lock held (it frees), is not re-entered by its own allocations, and is not called when
 * the allocation fits. */
static void *g_cached[4];
static size_t g_cached_n;
static int g_calls, g_nested;

static int reclaim_cache(int device) {
    g_calls++;
    if (spw_torch_alloc(7 * MiB, device, NULL) == NULL) g_nested++; /* refused plainly, no recursion */
    size_t n = g_cached_n;
    for (size_t i = 0; i < g_cached_n; i++) spw_torch_free(g_cached[i], 2 * MiB, device, NULL);
    g_cached_n = 0;
    return n > 0;
}

static void reclaim_hook(void **s) {
    (void)s;
    spw_torch_set_reclaim(reclaim_cache);
    g_calls = g_nested = 0;
    for (g_cached_n = 0; g_cached_n < 3; g_cached_n++) {
        g_cached[g_cached_n] = spw_torch_alloc(2 * MiB, 0, NULL);
        assert_non_null(g_cached[g_cached_n]);
    }
    assert_int_equal(g_calls, 0); /* fits: the hook is not asked */
    void *big = spw_torch_alloc(6 * MiB, 0, NULL); /* 6 MiB held of 8: refused, reclaimed, retried */
    assert_non_null(big);
    assert_int_equal(g_calls, 1);
    assert_int_equal(g_nested, 1);
    assert_int_equal(spw_torch_oom_pending(0), 0);
    assert_null(spw_torch_alloc(4 * MiB, 0, NULL)); /* nothing left to reclaim: refused */
    assert_int_equal(g_calls, 2);
    assert_int_equal(spw_torch_oom_count(0), 3); /* the two nested refusals and this one */
    spw_torch_set_reclaim(NULL);
    assert_null(spw_torch_alloc(4 * MiB, 0, NULL));
    assert_int_equal(g_calls, 2); /* unset */
    spw_torch_free(big, 6 * MiB, 0, NULL);
    assert_int_equal(test_stats(ctx_of(0)).live.current, 0);
}

static void budget_and_oom_message(void **s) {
    (void)s;
    void *a = spw_torch_alloc(6 * MiB, 0, NULL);
    assert_non_null(a);
    assert_int_equal(spw_torch_oom_count(0), 0);
    assert_null(spw_torch_alloc(6 * MiB, 0, NULL));
    assert_int_equal(spw_torch_oom_count(0), 1);
    assert_int_equal(spw_torch_oom_pending(0), 1);
    assert_int_equal(spw_torch_oom_count(1), 0);
    char msg[1024];
    assert_ok(spw_torch_oom_message(0, msg, sizeof msg));
    static const char *const want[] = {"device 0", "requested 6.00 MiB", "budget 8.00 MiB", "held",
                                       "live 6.00 MiB", "cached", "raise it"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(msg, want[i])) fail_msg("OOM message lacks '%s': %s", want[i], msg);
    spw_stats st = test_stats(ctx_of(0));
    assert_true((size_t)st.held.peak <= 8 * MiB); /* never past the budget */
    spw_torch_free(a, 6 * MiB, 0, NULL);
    a = spw_torch_alloc(6 * MiB, 0, NULL); /* fits again */
    assert_non_null(a);
    assert_int_equal(spw_torch_oom_pending(0), 0); /* a success clears it */
    assert_int_equal(spw_torch_oom_count(0), 1);
    spw_torch_free(a, 6 * MiB, 0, NULL);
    /* device 1 has its own, larger budget */
    void *b = spw_torch_alloc(12 * MiB, 1, NULL);
    assert_non_null(b);
    spw_torch_free(b, 12 * MiB, 1, NULL);
}

static void null_and_double_free(void **s) {
    (void)s;
    spw_torch_free(NULL, 0, 0, NULL); /* ignored */
    void *p = spw_torch_alloc(MiB, 0, NULL);
    assert_non_null(p);
    spw_torch_free(p, MiB, 0, NULL);
    spw_stats a = test_stats(ctx_of(0));
    spw_torch_free(p, MiB, 0, NULL);
    assert_msg_has("not a live allocation");
    spw_stats b = test_stats(ctx_of(0));
    assert_int_equal(a.frees.total, b.frees.total);
    assert_int_equal(a.cached.current, b.cached.current);
    spw_torch_free(p, MiB, 7, NULL); /* a device without a context */
    assert_msg_has("device 7 has no context");
}

/* spw_torch_call_stats counts every call of the entry points per device, refused ones too, and
 * spw_torch_shutdown starts the counts over. */
static void call_stats(void **s) {
    (void)s;
    uint64_t c[4] = {9, 9, 9, 9};
    spw_torch_call_stats(0, c);
    assert_true(c[0] == 0 && c[1] == 0 && c[2] == 0 && c[3] == 0);
    void *p = spw_torch_alloc(MiB, 0, NULL);
    assert_non_null(p);
    assert_null(spw_torch_alloc(64 * MiB, 0, NULL)); /* past the 8 MiB budget: counted */
    spw_torch_free(p, MiB, 0, NULL);
    void *q = spw_torch_alloc(MiB, 1, NULL);
    assert_non_null(q);
    spw_torch_call_stats(0, c);
    assert_int_equal(c[0], 2);
    assert_int_equal(c[2], 1);
    assert_true(c[1] > 0 && c[3] > 0);
    spw_torch_call_stats(1, c);
    assert_int_equal(c[0], 1);
    assert_int_equal(c[2], 0);
    c[0] = 5;
    spw_torch_call_stats(-1, c); /* a bad device: zeros */
    assert_int_equal(c[0], 0);
    spw_torch_call_stats(0, NULL);
    spw_torch_free(q, MiB, 1, NULL);
    assert_ok(spw_torch_shutdown());
    spw_torch_call_stats(0, c);
    assert_int_equal(c[0], 0);
    assert_ok(spw_torch_configure(CONF));
}

static void stream_reuse(void **s) {
    (void)s;
    spw_ctx *c = ctx_of(0);
    spw_stream a, b;
    assert_ok(spw_stream_create(c, &a));
    assert_ok(spw_stream_create(c, &b));
    void *p = spw_torch_alloc(MiB, 0, a);
    spw_torch_free(p, MiB, 0, a);
    void *q = spw_torch_alloc(MiB, 0, a); /* same stream: reused at once */
    assert_ptr_equal(p, q);
    spw_torch_free(q, MiB, 0, a);
    void *r = spw_torch_alloc(MiB, 0, b); /* other stream: reused only behind an event */
    spw_stats st = test_stats(c);
    if (r == p) assert_true(st.cross_stream_waits.total >= 1);
    spw_torch_free(r, MiB, 0, b);
    assert_ok(spw_stream_destroy(c, a));
    assert_ok(spw_stream_destroy(c, b));
}

static atomic_int side_done;
static atomic_int seen_at_reuse;

static void slow_side_work(void *arg) {
    (void)arg;
    struct timespec ts = {0, 150 * 1000 * 1000};
    nanosleep(&ts, NULL);
    atomic_store(&side_done, 1);
}

static void reuse_work(void *arg) {
    (void)arg;
    atomic_store(&seen_at_reuse, atomic_load(&side_done));
}

/* p is used on side stream b; freed on its allocation stream a; reallocated on a; the work on
 * the reallocated block sees the side work finished only if the free waited for b. */
static int side_then_reuse(int record) {
    spw_ctx *c = ctx_of(0);
    spw_stream a, b;
    assert_ok(spw_stream_create(c, &a));
    assert_ok(spw_stream_create(c, &b));
    atomic_store(&side_done, 0);
    atomic_store(&seen_at_reuse, -1);
    void *p = spw_torch_alloc(MiB, 0, a);
    assert_non_null(p);
    if (record) spw_torch_record_stream(p, b);
    assert_ok(spw_launch_host(c, b, slow_side_work, NULL));
    spw_torch_free(p, MiB, 0, a);
    void *q = spw_torch_alloc(MiB, 0, a);
    assert_ptr_equal(p, q); /* the same block: the case that needs the ordering */
    assert_ok(spw_launch_host(c, a, reuse_work, NULL));
    assert_ok(spw_stream_synchronize(c, a));
    assert_ok(spw_stream_synchronize(c, b));
    spw_torch_free(q, MiB, 0, a);
    assert_ok(spw_stream_destroy(c, a));
    assert_ok(spw_stream_destroy(c, b));
    return atomic_load(&seen_at_reuse);
}

static void record_stream_orders_reuse(void **s) {
    (void)s;
    assert_int_equal(side_then_reuse(1), 1);
    /* without record_stream the reuse does not wait (so the check above can fail) */
    assert_int_equal(side_then_reuse(0), 0);
    /* a pointer that is not live */
    int x;
    spw_torch_record_stream(&x, NULL);
    assert_msg_has("is not a live allocation");
    spw_torch_record_stream(NULL, NULL);
    assert_msg_has("pointer is NULL");
}

static void reset_returns_cache(void **s) {
    (void)s;
    void *p = spw_torch_alloc(4 * MiB, 0, NULL);
    void *q = spw_torch_alloc(4 * MiB, 1, NULL);
    spw_torch_free(p, 4 * MiB, 0, NULL);
    spw_torch_free(q, 4 * MiB, 1, NULL);
    assert_true(test_stats(ctx_of(0)).held.current > 0);
    assert_true(test_stats(ctx_of(1)).held.current > 0);
    spw_torch_reset();
    assert_int_equal(test_stats(ctx_of(0)).held.current, 0);
    assert_int_equal(test_stats(ctx_of(1)).held.current, 0);
}

static void memory_fraction(void **s) {
    (void)s;
    spw_torch_memory_fraction(0.25, 3); /* before the context: replaces the budget */
    void *p = spw_torch_alloc(MiB, 3, NULL);
    assert_non_null(p);
    spw_ctx *c = ctx_of(3);
    assert_int_equal(spw_ctx_budget(c), 64 * MiB);
    spw_torch_memory_fraction(0.125, 3); /* after: lowered */
    assert_int_equal(spw_ctx_budget(c), 32 * MiB);
    assert_null(spw_torch_alloc(40 * MiB, 3, NULL));
    spw_torch_memory_fraction(0.5, 3); /* above the creation budget: refused */
    assert_msg_has("budget the context was created with");
    assert_int_equal(spw_ctx_budget(c), 32 * MiB);
    spw_torch_memory_fraction(1.5, 3);
    assert_msg_has("not in (0, 1]");
    assert_int_equal(spw_ctx_budget(c), 32 * MiB);
    spw_torch_free(p, MiB, 3, NULL);
}

static void configuration(void **s) {
    (void)s;
    assert_ok(spw_torch_shutdown());
    assert_status(spw_torch_configure("backend=emu,no_such_key=1"), SPW_ERR_CONFIG);
    assert_msg_has("no_such_key");
    assert_status(spw_torch_configure("backend=emu,budget=0:4MiB;0:8MiB"), SPW_ERR_CONFIG);
    assert_msg_has("device 0 is given twice");
    assert_status(spw_torch_configure("backend=emu,budget=0:4MiB;x:8MiB"), SPW_ERR_CONFIG);
    assert_msg_has("bad per-device entry");
    assert_status(spw_torch_configure("backend=emu,budget=1:lots"), SPW_ERR_CONFIG);
    assert_msg_has("budget' for device 1");
    assert_status(spw_torch_configure("backend=emu,device=1"), SPW_ERR_CONFIG);
    assert_msg_has("chosen by PyTorch");
    /* SPILLWAY_CONF first, then the configured list */
    setenv("SPILLWAY_CONF", "backend=emu,emu_capacity=128MiB,budget=0:4MiB;1:6MiB", 1);
    assert_ok(spw_torch_configure("budget=1:10MiB,vmm=auto"));
    void *p0 = spw_torch_alloc(MiB, 0, NULL), *p1 = spw_torch_alloc(MiB, 1, NULL);
    assert_int_equal(spw_ctx_budget(ctx_of(0)), 4 * MiB);
    assert_int_equal(spw_ctx_budget(ctx_of(1)), 10 * MiB);
    assert_int_equal(ctx_of(0)->cfg.vmm, SPW_TRI_AUTO); /* the list overrides the vmm=off default */
    /* options apply at creation: refused once a context exists */
    assert_status(spw_torch_configure("budget=1GiB"), SPW_ERR_STATE);
    assert_msg_has("already exists");
    /* shutdown refuses while memory is live */
    assert_status(spw_torch_shutdown(), SPW_ERR_STATE);
    assert_msg_has("device 0 still has");
    spw_torch_free(p0, MiB, 0, NULL);
    spw_torch_free(p1, MiB, 1, NULL);
    unsetenv("SPILLWAY_CONF");
    /* a bad SPILLWAY_CONF is reported at the first allocation, naming the variable */
    assert_ok(spw_torch_shutdown());
    setenv("SPILLWAY_CONF", "backend=emu,budget=0:nope", 1);
    assert_null(spw_torch_alloc(MiB, 0, NULL));
    assert_msg_has("SPILLWAY_CONF");
    unsetenv("SPILLWAY_CONF");
    assert_ok(spw_torch_configure(CONF));
}

static void init_device_count(void **s) {
    (void)s;
    spw_torch_init(2);
    assert_null(spw_torch_alloc(MiB, 2, NULL));
    assert_msg_has("device 2 is out of range (0 .. 1)");
    void *p = spw_torch_alloc(MiB, 1, NULL);
    assert_non_null(p);
    spw_torch_free(p, MiB, 1, NULL);
    spw_torch_init(-3);
    assert_msg_has("device count -3");
}

/* One budget: a torch allocation that does not fit evicts an unpinned offload buffer first. */
static void evicts_buffers_before_failing(void **s) {
    (void)s;
    spw_ctx *c = ctx_of(0); /* 8 MiB */
    spw_buf *w;
    assert_ok(spw_buf_create(c, 4 * MiB, SPW_BUF_READ_ONLY, &w));
    void *dev;
    assert_ok(spw_acquire(w, NULL, SPW_ACCESS_READ, &dev));
    /* pinned: an allocation that needs its room fails */
    assert_null(spw_torch_alloc(6 * MiB, 0, NULL));
    assert_ok(spw_release(w, NULL));
    void *p = spw_torch_alloc(6 * MiB, 0, NULL); /* now it evicts the weights */
    assert_non_null(p);
    spw_stats st = test_stats(c);
    assert_int_equal(st.evictions_clean.total + st.evictions_dirty.total, 1);
    assert_int_equal(st.buffers_resident.current, 0);
    spw_torch_free(p, 6 * MiB, 0, NULL);
    assert_ok(spw_buf_destroy(w));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(sizes, setup, teardown),
        cmocka_unit_test_setup_teardown(per_device_contexts, setup, teardown),
        cmocka_unit_test_setup_teardown(budget_and_oom_message, setup, teardown),
        cmocka_unit_test_setup_teardown(reclaim_hook, setup, teardown),
        cmocka_unit_test_setup_teardown(null_and_double_free, setup, teardown),
        cmocka_unit_test_setup_teardown(call_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(stream_reuse, setup, teardown),
        cmocka_unit_test_setup_teardown(record_stream_orders_reuse, setup, teardown),
        cmocka_unit_test_setup_teardown(reset_returns_cache, setup, teardown),
        cmocka_unit_test_setup_teardown(memory_fraction, setup, teardown),
        cmocka_unit_test_setup_teardown(configuration, setup, teardown),
        cmocka_unit_test_setup_teardown(init_device_count, setup, teardown),
        cmocka_unit_test_setup_teardown(evicts_buffers_before_failing, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
