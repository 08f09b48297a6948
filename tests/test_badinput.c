/* Bad input gets a clear error and changes nothing: each case snapshots the statistics (and the
 * configuration where relevant) before and after the call. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static spw_ctx *ctx;
static void *live_ptr;

static int setup(void **state) {
    (void)state;
    ctx = test_ctx("budget=256MiB,emu_capacity=1GiB");
    assert_ok(spw_malloc(ctx, 1 << 20, NULL, &live_ptr));
    return 0;
}

static int teardown(void **state) {
    (void)state;
    spw_free(ctx, live_ptr, NULL);
    spw_ctx_destroy(ctx);
    return 0;
}

static spw_stats snap(void) {
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    return st;
}

static void assert_unchanged(const spw_stats *a) {
    spw_stats b = snap();
    assert_memory_equal(a, &b, sizeof b);
}

#define assert_msg_has(text) \
    do { if (!strstr(spw_last_error(), text)) fail_msg("message lacks '%s': %s", text, spw_last_error()); } while (0)

static void malloc_null_ctx(void **s) {
    (void)s;
    void *p = NULL;
    assert_status(spw_malloc(NULL, 64, NULL, &p), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("context is NULL");
    assert_null(p);
}

static void malloc_null_out(void **s) {
    (void)s;
    spw_stats a = snap();
    assert_status(spw_malloc(ctx, 64, NULL, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("out is NULL");
    assert_unchanged(&a);
}

static void malloc_zero(void **s) {
    (void)s;
    spw_stats a = snap();
    void *p = (void *)0x1;
    assert_status(spw_malloc(ctx, 0, NULL, &p), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("size 0");
    assert_ptr_equal(p, (void *)0x1);
    assert_unchanged(&a);
}

static void malloc_size_max(void **s) {
    (void)s;
    spw_stats a = snap();
    void *p = (void *)0x1;
    assert_status(spw_malloc(ctx, SIZE_MAX, NULL, &p), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("exceeds");
    assert_status(spw_malloc(ctx, SIZE_MAX - 511, NULL, &p), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_malloc(ctx, SIZE_MAX / 2 + 1, NULL, &p), SPW_ERR_INVALID_ARGUMENT);
    assert_ptr_equal(p, (void *)0x1);
    assert_unchanged(&a);
}

static void malloc_over_budget(void **s) {
    (void)s;
    spw_stats a = snap();
    void *p = (void *)0x1;
    assert_status(spw_malloc(ctx, (size_t)1 << 40, NULL, &p), SPW_ERR_OUT_OF_MEMORY);
    assert_msg_has("budget 256.00 MiB");
    assert_ptr_equal(p, (void *)0x1);
    spw_stats b = snap();
    assert_int_equal(b.live.current, a.live.current);
    assert_int_equal(b.ooms.total, a.ooms.total + 1);
}

static void free_null_ctx(void **s) {
    (void)s;
    assert_status(spw_free(NULL, live_ptr, NULL), SPW_ERR_INVALID_ARGUMENT);
}

static void free_null_ptr(void **s) {
    (void)s;
    spw_stats a = snap();
    assert_status(spw_free(ctx, NULL, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_unchanged(&a);
}

static void double_free(void **s) {
    (void)s;
    void *p;
    assert_ok(spw_malloc(ctx, 4096, NULL, &p));
    assert_ok(spw_free(ctx, p, NULL));
    spw_stats a = snap();
    assert_status(spw_free(ctx, p, NULL), SPW_ERR_STATE);
    assert_msg_has("double free");
    assert_unchanged(&a);
}

static void foreign_pointer(void **s) {
    (void)s;
    int on_stack;
    void *heap = malloc(64);
    spw_stats a = snap();
    assert_status(spw_free(ctx, &on_stack, NULL), SPW_ERR_NOT_FOUND);
    assert_msg_has("not allocated by this context");
    assert_status(spw_free(ctx, heap, NULL), SPW_ERR_NOT_FOUND);
    assert_unchanged(&a);
    free(heap);
}

static void interior_pointer(void **s) {
    (void)s;
    spw_stats a = snap();
    assert_status(spw_free(ctx, (char *)live_ptr + 512, NULL), SPW_ERR_STATE);
    assert_unchanged(&a);
}

static void pointer_of_other_context(void **s) {
    (void)s;
    spw_ctx *other = test_ctx("budget=64MiB,emu_capacity=256MiB");
    void *p;
    assert_ok(spw_malloc(other, 4096, NULL, &p));
    spw_stats a = snap();
    spw_status st = spw_free(ctx, p, NULL);
    assert_true(st == SPW_ERR_NOT_FOUND || st == SPW_ERR_STATE);
    assert_unchanged(&a);
    assert_ok(spw_free(other, p, NULL));
    spw_ctx_destroy(other);
}

static void config_unknown_key(void **s) {
    (void)s;
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    assert_status(spw_config_set(cfg, "budgte", "1GiB"), SPW_ERR_CONFIG);
    assert_msg_has("unknown option 'budgte'");
    assert_msg_has("budget"); /* lists the known keys */
    spw_config_destroy(cfg);
}

static void config_bad_values(void **s) {
    (void)s;
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    char before[64], after[64];
    assert_ok(spw_config_get(cfg, "budget", before, sizeof before));
    static const char *const bad[][2] = {
        {"budget", "12XB"},   {"budget", "150%"},  {"budget", "-1GiB"}, {"budget", ""},
        {"budget", "0"},      {"budget", "GiB"},   {"budget", "1e30"},  {"budget", "0%"},
        {"backend", "opencl"}, {"on_exhaust", "maybe"}, {"device", "-1"}, {"device", "x"},
        {"frag_slack", "abc"}, {"vmm", "yes"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        spw_status st = spw_config_set(cfg, bad[i][0], bad[i][1]);
        if (st != SPW_ERR_CONFIG) fail_msg("%s=%s accepted", bad[i][0], bad[i][1]);
        char want[64];
        snprintf(want, sizeof want, "'%s'", bad[i][0]);
        assert_msg_has(want); /* the message names the key */
    }
    assert_ok(spw_config_get(cfg, "budget", after, sizeof after));
    assert_string_equal(before, after);
    spw_config_destroy(cfg);
}

static void config_list_all_or_nothing(void **s) {
    (void)s;
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    char before[64], after[64];
    assert_ok(spw_config_get(cfg, "budget", before, sizeof before));
    assert_status(spw_config_parse(cfg, "budget=1GiB,bogus=1"), SPW_ERR_CONFIG);
    assert_msg_has("bogus");
    assert_status(spw_config_parse(cfg, "budget=1GiB,on_exhaust"), SPW_ERR_CONFIG);
    assert_msg_has("key=value");
    assert_ok(spw_config_get(cfg, "budget", after, sizeof after));
    assert_string_equal(before, after);
    spw_config_destroy(cfg);
}

static void config_env_bad(void **s) {
    (void)s;
    setenv("SPILLWAY_CONF", "backend=emu,budget=lots", 1);
    spw_ctx *c = (spw_ctx *)0x1;
    assert_status(spw_ctx_create(NULL, &c), SPW_ERR_CONFIG);
    assert_msg_has("SPILLWAY_CONF");
    assert_msg_has("'budget'");
    assert_ptr_equal(c, (spw_ctx *)0x1);
    unsetenv("SPILLWAY_CONF");
}

static void null_handles_elsewhere(void **s) {
    (void)s;
    spw_stats st;
    assert_status(spw_stats_get(NULL, &st), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_stats_get(ctx, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_empty_cache(NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_summary(NULL, stdout), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_ctx_create(NULL, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_stream_destroy(ctx, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_config_set(NULL, "budget", "1GiB"), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_launch_host(ctx, NULL, NULL, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(spw_ctx_destroy(NULL));
    assert_string_equal(spw_status_str((spw_status)999), "SPW_ERR_UNKNOWN");
}

/* A percentage budget that resolves to a few bytes is honoured exactly: nothing fits. */
static void tiny_percent_budget(void **s) {
    (void)s;
    TEST_REQUIRE_EMU();
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    assert_ok(spw_config_parse(cfg, "backend=emu,emu_capacity=1GiB,budget=0.00001%"));
    spw_ctx *c;
    assert_ok(spw_ctx_create(cfg, &c));
    assert_int_equal(spw_ctx_budget(c), 107);
    void *p = NULL;
    assert_status(spw_malloc(c, 64, NULL, &p), SPW_ERR_OUT_OF_MEMORY);
    assert_msg_has("budget 107 B");
    spw_ctx_destroy(c);
    spw_config_destroy(cfg);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(malloc_null_ctx),     cmocka_unit_test(malloc_null_out),
        cmocka_unit_test(malloc_zero),         cmocka_unit_test(malloc_size_max),
        cmocka_unit_test(malloc_over_budget),  cmocka_unit_test(free_null_ctx),
        cmocka_unit_test(free_null_ptr),       cmocka_unit_test(double_free),
        cmocka_unit_test(foreign_pointer),     cmocka_unit_test(interior_pointer),
        cmocka_unit_test(pointer_of_other_context), cmocka_unit_test(config_unknown_key),
        cmocka_unit_test(config_bad_values),   cmocka_unit_test(config_list_all_or_nothing),
        cmocka_unit_test(config_env_bad),      cmocka_unit_test(null_handles_elsewhere),
        cmocka_unit_test(tiny_percent_budget),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
