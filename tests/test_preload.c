/* The interposer's accounting, configuration and routing (preload/ledger.c, route.c), without a
 * GPU. The interposition itself is tested against a fake driver by test_preload_fake. */
#include <string.h>

#include "ledger.h"
#include "test_util.h"

#define GiB (1ull << 30)

static void sizes(void **state) {
    (void)state;
    static const struct {
        const char *text;
        unsigned long long bytes;
    } ok[] = {{"1", 1},           {"512B", 512},          {"4K", 4096},          {"4KiB", 4096},
              {"2M", 2u << 20},   {"6GiB", 6 * GiB},      {"6gib", 6 * GiB},     {"1.5GiB", 3 * GiB / 2},
              {"1T", 1ull << 40}, {"2TiB", 2ull << 40},   {"0.5K", 512}, {"1GB", GiB}, {"1 GiB", GiB}, {" 6 gb ", 6 * GiB}};
    char err[256];
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        spwp_size s;
        if (spwp_parse_size(ok[i].text, false, &s, err, sizeof err)) fail_msg("%s: %s", ok[i].text, err);
        assert_false(s.is_percent);
        assert_int_equal(s.bytes, ok[i].bytes);
    }
    static const char *const bad[] = {"", "GiB", "-1", "1.3B", "1 GiB x", "4X", "0", "0B", "1e9", "99999999999T",
                                      "18446744073709551616", "50%"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        spwp_size s;
        err[0] = '\0';
        if (!spwp_parse_size(bad[i], false, &s, err, sizeof err)) fail_msg("'%s' accepted", bad[i]);
        assert_true(strlen(err) > 0);
    }
    spwp_size s;
    assert_int_equal(spwp_parse_size("50%", true, &s, err, sizeof err), 0);
    assert_true(s.is_percent);
    assert_true(s.percent == 50.0);
    assert_int_equal(spwp_parse_size("100%", true, &s, err, sizeof err), 0);
    assert_int_equal(spwp_parse_size("0%", true, &s, err, sizeof err), -1);
    assert_int_equal(spwp_parse_size("101%", true, &s, err, sizeof err), -1);
    assert_int_equal(spwp_parse_size("50%x", true, &s, err, sizeof err), -1);
    /* the message quotes the text */
    spwp_parse_size("4X", false, &s, err, sizeof err);
    assert_non_null(strstr(err, "'4X'"));
}

static void budgets(void **state) {
    (void)state;
    spwp_config c;
    char err[256];
    memset(&c, 0, sizeof c);
    assert_int_equal(spwp_parse_budget("4GiB", &c, err, sizeof err), 0);
    assert_true(c.budget_default.set);
    assert_int_equal(c.budget_default.bytes, 4 * GiB);
    assert_int_equal(spwp_parse_budget("0:4GiB;1:8GiB", &c, err, sizeof err), 0);
    assert_false(c.budget_default.set);
    assert_int_equal(c.budget_dev[0].bytes, 4 * GiB);
    assert_int_equal(c.budget_dev[1].bytes, 8 * GiB);
    assert_false(c.budget_dev[2].set);
    assert_int_equal(spwp_parse_budget("2GiB;3:50%", &c, err, sizeof err), 0);
    assert_int_equal(c.budget_default.bytes, 2 * GiB);
    assert_true(c.budget_dev[3].is_percent);
    static const char *const bad[] = {"", ";", "4GiB;", "0:4GiB;0:5GiB", "4GiB;5GiB", "64:1GiB", "-1:1GiB",
                                      "x:1GiB", ":1GiB", "0:", "0:1XB", "1:2:3GiB"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        spwp_config before = c;
        if (!spwp_parse_budget(bad[i], &c, err, sizeof err)) fail_msg("'%s' accepted", bad[i]);
        assert_memory_equal(&before, &c, sizeof c); /* unchanged on error */
        assert_non_null(strstr(err, "bad budget"));
    }
}

static void environment(void **state) {
    (void)state;
    spwp_config c;
    char err[512];
    assert_int_equal(spwp_config_load(&c, NULL, NULL, NULL, NULL, err, sizeof err), 0);
    assert_false(c.budget_default.set);
    assert_false(c.report);
    assert_true(c.charge_managed);
    /* SPILLWAY_CONF: the shim's keys, other library keys left alone */
    assert_int_equal(spwp_config_load(&c, "budget=6GiB,policy=plan,report=1,charge_managed=0", NULL, NULL, NULL, err,
                                      sizeof err),
                     0);
    assert_int_equal(c.budget_default.bytes, 6 * GiB);
    assert_true(c.report);
    assert_false(c.charge_managed);
    /* dedicated variables win */
    assert_int_equal(spwp_config_load(&c, "budget=6GiB,report=1", "0:1GiB;1:2GiB", "0", "yes", err, sizeof err), 0);
    assert_false(c.budget_default.set);
    assert_int_equal(c.budget_dev[1].bytes, 2 * GiB);
    assert_false(c.report);
    assert_true(c.charge_managed);
    /* errors name the variable */
    assert_int_equal(spwp_config_load(&c, NULL, "lots", NULL, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "SPILLWAY_BUDGET"));
    assert_false(c.budget_default.set);
    assert_int_equal(spwp_config_load(&c, "budget=4GiB,report=maybe", NULL, NULL, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, "SPILLWAY_CONF"));
    assert_non_null(strstr(err, "report"));
    assert_int_equal(spwp_config_load(&c, "budget", NULL, NULL, NULL, err, sizeof err), -1);
    assert_int_equal(spwp_config_load(&c, NULL, NULL, NULL, "2", err, sizeof err), -1);
    assert_non_null(strstr(err, "SPILLWAY_CHARGE_MANAGED"));
}

static spwp_ledger *ledger_with(const char *budget) {
    static spwp_ledger l;
    spwp_config c;
    char err[256];
    if (spwp_config_load(&c, NULL, budget, NULL, NULL, err, sizeof err)) fail_msg("%s", err);
    spwp_ledger_init(&l, &c);
    return &l;
}

static void charge_and_refund(void **state) {
    (void)state;
    spwp_ledger *l = ledger_with("4GiB");
    spwp_refusal why;
    for (int i = 0; i < 4; i++) {
        assert_true(spwp_ledger_reserve(l, 0, GiB, &why));
        assert_true(spwp_ledger_track(l, SPWP_KIND_PTR, 0x1000 + (uint64_t)i, 0, GiB));
    }
    /* the fifth is refused, names the numbers, and charges nothing */
    assert_false(spwp_ledger_reserve(l, 0, GiB, &why));
    assert_int_equal(why.requested, GiB);
    assert_int_equal(why.charged, 4 * GiB);
    assert_int_equal(why.budget, 4 * GiB);
    spwp_devstate s = spwp_ledger_state(l, 0);
    assert_int_equal(s.charged, 4 * GiB);
    assert_int_equal(s.refusals, 1);
    assert_int_equal(s.peak, 4 * GiB);
    /* a huge request cannot wrap around */
    assert_false(spwp_ledger_reserve(l, 0, UINT64_MAX, &why));
    /* untrack + refund */
    int dev;
    uint64_t bytes;
    assert_true(spwp_ledger_untrack(l, SPWP_KIND_PTR, 0x1002, &dev, &bytes));
    assert_int_equal(dev, 0);
    assert_int_equal(bytes, GiB);
    assert_false(spwp_ledger_untrack(l, SPWP_KIND_PTR, 0x1002, &dev, &bytes)); /* double free: untracked */
    assert_false(spwp_ledger_untrack(l, SPWP_KIND_HANDLE, 0x1001, &dev, &bytes)); /* kinds apart */
    spwp_ledger_refund(l, 0, bytes);
    assert_true(spwp_ledger_reserve(l, 0, GiB, &why));
    /* zero bytes: accepted, nothing charged */
    assert_true(spwp_ledger_reserve(l, 0, 0, &why));
    /* devices out of range are never charged */
    assert_true(spwp_ledger_reserve(l, -1, 100 * GiB, &why));
    assert_true(spwp_ledger_reserve(l, SPWP_MAX_DEVICES, 100 * GiB, &why));
    /* other devices have their own count under the default budget */
    assert_true(spwp_ledger_reserve(l, 1, 4 * GiB, &why));
    assert_false(spwp_ledger_reserve(l, 1, 1, &why));
    spwp_ledger_destroy(l);
}

static void many_entries(void **state) {
    (void)state;
    spwp_ledger *l = ledger_with("1TiB");
    spwp_refusal why;
    /* grow the table through several rehashes, with frees interleaved (tombstones) */
    for (uint64_t i = 0; i < 20000; i++) {
        assert_true(spwp_ledger_reserve(l, 0, 4096, &why));
        assert_true(spwp_ledger_track(l, SPWP_KIND_PTR, 0x7f0000000000ull + i * 4096, 0, 4096));
        if (i % 3 == 0) {
            int d;
            uint64_t b;
            assert_true(spwp_ledger_untrack(l, SPWP_KIND_PTR, 0x7f0000000000ull + i * 4096, &d, &b));
            spwp_ledger_refund(l, d, b);
        }
    }
    uint64_t live = 20000 - (20000 + 2) / 3;
    assert_int_equal(spwp_ledger_state(l, 0).charged, live * 4096);
    assert_int_equal(l->count, live);
    for (uint64_t i = 0; i < 20000; i++) {
        int d;
        uint64_t b;
        bool t = spwp_ledger_untrack(l, SPWP_KIND_PTR, 0x7f0000000000ull + i * 4096, &d, &b);
        assert_int_equal(t, i % 3 != 0);
        if (t) spwp_ledger_refund(l, d, b);
    }
    assert_int_equal(spwp_ledger_state(l, 0).charged, 0);
    spwp_ledger_destroy(l);
}

static void percent_and_per_device(void **state) {
    (void)state;
    spwp_ledger *l = ledger_with("50%;1:2GiB");
    /* a percentage is unknown until the device's size is */
    assert_true(spwp_ledger_needs_physical(l, 0));
    assert_int_equal(spwp_ledger_budget(l, 0), SPWP_UNLIMITED);
    spwp_ledger_set_physical(l, 0, 80 * GiB);
    spwp_ledger_set_physical(l, 0, 10 * GiB); /* ignored: the budget never moves */
    assert_false(spwp_ledger_needs_physical(l, 0));
    assert_int_equal(spwp_ledger_budget(l, 0), 40 * GiB);
    assert_int_equal(spwp_ledger_budget(l, 1), 2 * GiB);
    assert_int_equal(spwp_ledger_budget(l, 2), SPWP_UNLIMITED); /* 50% of an unknown device */
    spwp_ledger_destroy(l);
    l = ledger_with("0:1GiB");
    assert_int_equal(spwp_ledger_budget(l, 1), SPWP_UNLIMITED); /* no entry, no default: uncapped */
    spwp_ledger_destroy(l);
}

static void reporting(void **state) {
    (void)state;
    uint64_t f, t;
    /* total = min(budget, physical), free = min(physical free, total - charged) */
    spwp_view_math(4 * GiB, GiB, 70 * GiB, 80 * GiB, &f, &t);
    assert_int_equal(t, 4 * GiB);
    assert_int_equal(f, 3 * GiB);
    spwp_view_math(4 * GiB, GiB, 2 * GiB, 80 * GiB, &f, &t); /* others use the device */
    assert_int_equal(f, 2 * GiB);
    spwp_view_math(100 * GiB, 0, 80 * GiB, 80 * GiB, &f, &t); /* budget above the device */
    assert_int_equal(t, 80 * GiB);
    spwp_view_math(4 * GiB, 5 * GiB, 70 * GiB, 80 * GiB, &f, &t); /* charged above total: 0 free */
    assert_int_equal(f, 0);
    spwp_view_math(SPWP_UNLIMITED, 10 * GiB, 70 * GiB, 80 * GiB, &f, &t);
    assert_int_equal(t, 80 * GiB);
    assert_int_equal(f, 70 * GiB);

    spwp_ledger *l = ledger_with("25%");
    spwp_refusal why;
    /* NVML's total does not fix the percentage base; CUDA's does */
    spwp_ledger_view(l, 0, 90 * GiB, 100 * GiB, false, &f, &t);
    assert_int_equal(t, 25 * GiB);
    assert_true(spwp_ledger_needs_physical(l, 0));
    spwp_ledger_view(l, 0, 70 * GiB, 80 * GiB, true, &f, &t);
    assert_int_equal(t, 20 * GiB);
    assert_true(spwp_ledger_reserve(l, 0, 5 * GiB, &why));
    spwp_ledger_view(l, 0, 70 * GiB, 80 * GiB, true, &f, &t);
    assert_int_equal(f, 15 * GiB);
    spwp_ledger_view(l, 77, 1, 2, true, &f, &t); /* out of range: the driver's numbers */
    assert_int_equal(f, 1);
    assert_int_equal(t, 2);
    spwp_ledger_destroy(l);
}

static void arrays(void **state) {
    (void)state;
    /* 1024 x 1024 float4 = 16 MiB */
    assert_int_equal(spwp_array_bytes(1024, 1024, 0, 2 * 16, 1, false), 16u << 20);
    /* BC1: half a byte per texel */
    assert_int_equal(spwp_array_bytes(256, 256, 1, 1, 1, false), 32768);
    /* full mip chain of a 256^2 RGBA8: sum of squares 256^2..1 times 4 */
    uint64_t want = 0;
    for (uint64_t e = 256; e >= 1; e /= 2) want += e * e * 4;
    assert_int_equal(spwp_array_bytes(256, 256, 0, 8, 9, false), want);
    /* layered: depth stays */
    assert_int_equal(spwp_array_bytes(4, 4, 6, 2, 2, true), 16 * 6 + 4 * 6);
    assert_int_equal(spwp_array_bytes(UINT64_MAX, 2, 2, 8, 1, false), UINT64_MAX);
}

static void routes(void **state) {
    (void)state;
    static spwp_routes t;
    static int a, b, c, wa, wb;
    memset(&t, 0, sizeof t);
    assert_int_equal(spwp_routes_add(&t, &a, &wa), 0);
    assert_int_equal(spwp_routes_add(&t, &b, &wb), 0);
    assert_int_equal(spwp_routes_add(&t, &a, &wb), 1); /* first mapping wins */
    assert_int_equal(spwp_routes_add(&t, NULL, &wa), 1);
    assert_int_equal(spwp_routes_add(&t, &wa, &wa), 1); /* never route a wrapper to itself */
    assert_ptr_equal(spwp_routes_find(&t, &a), &wa);
    assert_ptr_equal(spwp_routes_find(&t, &b), &wb);
    assert_null(spwp_routes_find(&t, &c));
    assert_null(spwp_routes_find(&t, NULL));
    assert_null(spwp_routes_find(&t, &wa)); /* a wrapper is returned unchanged by the caller */
    static char reals[SPWP_ROUTES_MAX + 1];
    for (size_t i = 2; i < SPWP_ROUTES_MAX; i++) assert_int_equal(spwp_routes_add(&t, &reals[i], &wa), 0);
    assert_int_equal(spwp_routes_add(&t, &reals[SPWP_ROUTES_MAX], &wa), -1);
    assert_ptr_equal(spwp_routes_find(&t, &reals[SPWP_ROUTES_MAX - 1]), &wa);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(sizes),       cmocka_unit_test(budgets),   cmocka_unit_test(environment),
        cmocka_unit_test(charge_and_refund), cmocka_unit_test(many_entries),
        cmocka_unit_test(percent_and_per_device), cmocka_unit_test(reporting), cmocka_unit_test(arrays),
        cmocka_unit_test(routes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
