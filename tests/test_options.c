/* The options table: sizes, percentages, enums, round trips, the environment, and help. */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static void sizes(void **s) {
    (void)s;
    static const struct { const char *text; size_t want; } ok[] = {
        {"0", 0}, {"100", 100}, {"1KiB", 1024}, {"1K", 1024}, {"4k", 4096}, {"512M", 512u << 20},
        {"6GiB", (size_t)6 << 30}, {"1.5GiB", (size_t)3 << 29}, {"2TiB", (size_t)2 << 40},
        {" 8 MiB ", 8u << 20}, {"64B", 64},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        size_t v = 1;
        assert_ok(spw_parse_size(ok[i].text, &v));
        if (v != ok[i].want) fail_msg("'%s' parsed as %zu, want %zu", ok[i].text, v, ok[i].want);
    }
    static const char *const bad[] = {"", "abc", "-5", "1.3B", "5 parsecs", "1e99", "GiB", "80%"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t v = 7;
        if (spw_parse_size(bad[i], &v) != SPW_ERR_CONFIG) fail_msg("'%s' accepted", bad[i]);
        assert_int_equal(v, 7);
        assert_non_null(strstr(spw_last_error(), "bad size"));
    }
}

static void percent_budget(void **s) {
    (void)s;
    spw_size_opt o;
    assert_ok(spw__parse_size_opt("80%", &o));
    assert_true(o.is_percent);
    assert_int_equal(spw__size_resolve(&o, 1000), 800);
    assert_ok(spw__parse_size_opt("12.5 %", &o));
    assert_int_equal(spw__size_resolve(&o, 1 << 20), 131072);
    assert_ok(spw__parse_size_opt("3GiB", &o));
    assert_false(o.is_percent);
    assert_int_equal(spw__size_resolve(&o, 1), (size_t)3 << 30);
    assert_status(spw__parse_size_opt("101%", &o), SPW_ERR_CONFIG);
    assert_status(spw__parse_size_opt("x%", &o), SPW_ERR_CONFIG);
}

static void round_trip(void **s) {
    (void)s;
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    char buf[64];
    assert_ok(spw_config_get(cfg, "backend", buf, sizeof buf));
    assert_string_equal(buf, "auto");
    assert_ok(spw_config_get(cfg, "budget", buf, sizeof buf));
    assert_string_equal(buf, "90%");
    assert_ok(spw_config_parse(cfg, " budget = 6GiB , backend=emu,on_exhaust=fail,vmm=off,device=0 "));
    assert_ok(spw_config_get(cfg, "budget", buf, sizeof buf));
    assert_string_equal(buf, "6442450944");
    assert_ok(spw_config_get(cfg, "backend", buf, sizeof buf));
    assert_string_equal(buf, "emu");
    assert_ok(spw_config_get(cfg, "on_exhaust", buf, sizeof buf));
    assert_string_equal(buf, "fail");
    assert_ok(spw_config_get(cfg, "vmm", buf, sizeof buf));
    assert_string_equal(buf, "off");
    assert_status(spw_config_get(cfg, "nope", buf, sizeof buf), SPW_ERR_CONFIG);
    spw_config_destroy(cfg);
}

static void environment(void **s) {
    (void)s;
    setenv("SPILLWAY_CONF", "backend=emu,budget=123MiB,emu_capacity=1GiB", 1);
    spw_ctx *ctx;
    assert_ok(spw_ctx_create(NULL, &ctx));
    assert_string_equal(spw_ctx_backend(ctx), "emu");
    assert_int_equal(spw_ctx_budget(ctx), 123u << 20);
    spw_ctx_destroy(ctx);
    setenv("SPILLWAY_CONF", "backend=emu,budget=50%,emu_capacity=1GiB", 1);
    assert_ok(spw_ctx_create(NULL, &ctx));
    assert_int_equal(spw_ctx_budget(ctx), 512u << 20);
    spw_ctx_destroy(ctx);
    unsetenv("SPILLWAY_CONF");
}

static void help_lists_every_option(void **s) {
    (void)s;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    spw_config_print_help(f);
    fclose(f);
    static const char *const keys[] = {"budget", "backend", "device", "on_exhaust", "vmm", "emu_capacity"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) assert_non_null(strstr(buf, keys[i]));
    free(buf);
}

static void status_names(void **s) {
    (void)s;
    assert_string_equal(spw_status_str(SPW_OK), "SPW_OK");
    assert_string_equal(spw_status_str(SPW_ERR_OUT_OF_MEMORY), "SPW_ERR_OUT_OF_MEMORY");
    for (int i = 0; i < SPW_STATUS_COUNT_; i++) assert_non_null(strstr(spw_status_str((spw_status)i), "SPW_"));
    assert_string_equal(spw_version(), SPW_VERSION_STRING);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(sizes), cmocka_unit_test(percent_budget), cmocka_unit_test(round_trip),
        cmocka_unit_test(environment), cmocka_unit_test(help_lists_every_option),
        cmocka_unit_test(status_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
