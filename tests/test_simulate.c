/*
 * `spillway simulate` through the built CLI (SPW_CLI). Usage errors and --model-only need no
 * engine; the tests marked ENGINE run the trace through the offload engine (src/buffer.c) on emu
 * and fail until it is built in.
 */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* 3 rw buffers of 4 MiB read and written in a cycle, then read-only ones: small and quick. */
static const char small_trace[] =
    "# test trace\n"
    "b 0 4194304 rw\nb 1 4194304 rw\nb 2 4194304 rw\nb 3 4194304 ro\n"
    "s\na 0:rw 3:r\na 1:rw 3:r\na 2:w\n"
    "s\na 0:rw 3:r\na 1:rw 3:r\na 2:r\n"
    "s\na 0:rw 3:r\na 1:rw 3:r\na 2:rw\n";
#define SMALL_STEPS 3

static char trace_path[64];

static int setup(void **state) {
    (void)state;
    snprintf(trace_path, sizeof trace_path, "/tmp/spw_sim_XXXXXX");
    int fd = mkstemp(trace_path);
    if (fd < 0) return -1;
    FILE *f = fdopen(fd, "w");
    fputs(small_trace, f);
    fclose(f);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    unlink(trace_path);
    return 0;
}

/* Run the CLI with args; returns its exit status; *out gets stdout (malloc'd, may be NULL). */
static int run_cli(const char *args, char **out) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s 2>/dev/null", SPW_CLI, args);
    return test_run_cmd(cmd, out);
}

/* Number of elements of the JSON array after "key": (no nesting in these arrays). */
static int array_len(const char *json, const char *key) {
    char k[128];
    snprintf(k, sizeof k, "\"%s\": [", key);
    const char *p = strstr(json, k);
    if (!p) return -1;
    p += strlen(k);
    if (*p == ']') return 0;
    int n = 1;
    for (; *p && *p != ']'; p++) n += *p == ',';
    return n;
}

/* The number after "key": in json, or -1 if absent / null. */
static double number(const char *json, const char *key) {
    char k[128];
    snprintf(k, sizeof k, "\"%s\": ", key);
    const char *p = strstr(json, k);
    if (!p || !strncmp(p + strlen(k), "null", 4)) return -1;
    return strtod(p + strlen(k), NULL);
}

static void test_bad_usage(void **state) {
    (void)state;
    char args[512];
    assert_int_equal(run_cli("simulate", NULL), 2);
    snprintf(args, sizeof args, "simulate %s", trace_path); /* no --budget */
    assert_int_equal(run_cli(args, NULL), 2);
    assert_int_equal(run_cli("simulate --budget 1GiB", NULL), 2); /* no trace */
    const char *bad[] = {"--budget 12XB", "--budget 0", "--budget -5%", "--budget 1GiB --policy fifo",
                         "--budget 1GiB --frobnicate", "--budget 1GiB --scale 0",
                         "--budget 1GiB --scale x", "--budget", "--budget 1GiB extra.access"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(args, sizeof args, "simulate %s %s", trace_path, bad[i]);
        int rc = run_cli(args, NULL);
        if (rc != 2) fail_msg("'%s': exit %d, want 2", args, rc);
    }
    assert_int_equal(run_cli("simulate --help", NULL), 0);
}

static void test_bad_trace(void **state) {
    (void)state;
    assert_int_equal(run_cli("simulate /nonexistent.access --budget 1GiB", NULL), 1);
    assert_int_equal(run_cli("simulate /nonexistent.access --budget 1GiB --model-only", NULL), 1);
}

/* --model-only: the yardsticks without the engine. 8 MiB of budget for 16 MiB of buffers. */
static void test_model_only_json(void **state) {
    (void)state;
    char args[512], *out = NULL;
    snprintf(args, sizeof args, "simulate %s --budget 8MiB --model-only --json", trace_path);
    assert_int_equal(run_cli(args, &out), 0);
    assert_int_equal(out[0], '{');
    const char *keys[] = {"oracle_per_step_h2d", "oracle_per_step_d2h", "lru_model_per_step_h2d",
                          "lru_model_per_step_d2h", "oracle_repeat_per_step_h2d"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        assert_int_equal(array_len(out, keys[i]), SMALL_STEPS);
    assert_int_equal(number(out, "budget_bytes"), 8 << 20);
    assert_int_equal(number(out, "steps"), SMALL_STEPS);
    assert_null(strstr(out, "\"bytes_h2d\"")); /* the engine did not run */
    free(out);
    /* A percentage is of the trace's total buffer bytes (16 MiB): 50% is 8 MiB. */
    snprintf(args, sizeof args, "simulate %s --budget 50%% --model-only --json", trace_path);
    assert_int_equal(run_cli(args, &out), 0);
    assert_int_equal(number(out, "budget_bytes"), 8 << 20);
    free(out);
    /* An operation larger than the budget is a failure of the run, not of the usage. */
    snprintf(args, sizeof args, "simulate %s --budget 4MiB --model-only", trace_path);
    assert_int_equal(run_cli(args, NULL), 1);
}

/* The table's header lines: the budget says how it came about (a size over --scale, or a share
 * of the buffer bytes), and counts of one are singular. */
static void test_human_header(void **state) {
    (void)state;
    char args[512], *out = NULL;
    test_require_data("cyclic64.access");
    snprintf(args, sizeof args, "simulate %s/cyclic64.access --scale 16 --budget 6GiB --model-only",
             SPW_TEST_DATA_DIR);
    assert_int_equal(run_cli(args, &out), 0);
    if (!strstr(out, "\nbudget    ") || !strstr(out, " = 6GiB / 16, backend emu") || strstr(out, "scale 1/"))
        fail_msg("budget line: %s", out);
    assert_non_null(strstr(out, "scale     every size divided by 16\n"));
    free(out);
    snprintf(args, sizeof args, "simulate %s --budget 50%% --model-only", trace_path);
    assert_int_equal(run_cli(args, &out), 0);
    if (!strstr(out, " = 50% of the buffer bytes, backend emu")) fail_msg("budget line: %s", out);
    assert_non_null(strstr(out, ": 4 buffers ("));
    assert_non_null(strstr(out, ", 3 steps\n"));
    free(out);
    /* one buffer, one step */
    char one[64];
    snprintf(one, sizeof one, "/tmp/spw_sim1_XXXXXX");
    int fd = mkstemp(one);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("b 0 4194304 rw\ns\na 0:rw\n", f);
    fclose(f);
    snprintf(args, sizeof args, "simulate %s --budget 8MiB --model-only", one);
    int rc = run_cli(args, &out);
    unlink(one);
    assert_int_equal(rc, 0);
    if (!strstr(out, ": 1 buffer (") || !strstr(out, ", 1 step\n")) fail_msg("want singular counts: %s", out);
    free(out);
}

/* ENGINE: the JSON shape of a real run, with --compare. */
static void test_engine_json(void **state) {
    (void)state;
    char args[512], *out = NULL;
    snprintf(args, sizeof args, "simulate %s --budget 8MiB --policy lru --json --compare",
             trace_path);
    int rc = run_cli(args, &out);
    if (rc != 0) fail_msg("ENGINE: '%s' exited %d (is the offload engine built in?)", args, rc);
    const char *arrays[] = {"per_step_h2d", "per_step_d2h", "oracle_per_step_h2d",
                            "oracle_per_step_d2h", "lru_model_per_step_h2d",
                            "lru_model_per_step_d2h"};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++)
        if (array_len(out, arrays[i]) != SMALL_STEPS)
            fail_msg("key %s: want an array of %d: %s", arrays[i], SMALL_STEPS, out);
    const char *nums[] = {"bytes_h2d", "bytes_d2h", "evictions", "stalls",
                          "ratio_to_oracle_after_first", "ratio_to_lru_model_after_first"};
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++)
        if (number(out, nums[i]) < 0) fail_msg("key %s missing or null: %s", nums[i], out);
    assert_int_equal(number(out, "data_errors"), 0);
    assert_true(number(out, "bytes_h2d") > 0);
    free(out);
}

/* ENGINE: the engine's bound on cyclic64 (scaled by 16 to stay quick: 4 MiB layers):
 * policy=lru moves no more than the plain LRU model after the first step, and no data is lost. */
static void test_engine_cyclic64_lru(void **state) {
    (void)state;
    test_require_data("cyclic64.access");
    char args[512], *out = NULL;
    snprintf(args, sizeof args, "simulate %s/cyclic64.access --budget 2GiB --scale 16 --policy lru "
             "--json --compare", SPW_TEST_DATA_DIR);
    int rc = run_cli(args, &out);
    if (rc != 0) fail_msg("ENGINE: '%s' exited %d", args, rc);
    double ratio = number(out, "ratio_to_lru_model_after_first");
    if (!(ratio > 0 && ratio <= 1.0))
        fail_msg("engine LRU / LRU model after the first step = %g (want <= 1): %s", ratio, out);
    assert_int_equal(number(out, "data_errors"), 0);
    free(out);
}

/* ENGINE: policy=plan on 48 layers of 16-96 MiB in a cycle (tests/data/varcyclic48.access,
 * scaled by 2: every size stays a multiple of the 2 MiB page) at 75%: after the first step it
 * moves no more than 1.05x the oracle's bytes (it reaches Belady's cycle from an empty device;
 * from LRU's leftovers it would move 1.16x) and less than the LRU model. */
static void test_engine_varcyclic_plan(void **state) {
    (void)state;
    char args[512], *out = NULL;
    snprintf(args, sizeof args, "simulate %s/varcyclic48.access --budget 75%% --scale 2 --policy plan "
             "--json --compare", SPW_TEST_DATA_DIR);
    int rc = run_cli(args, &out);
    if (rc != 0) fail_msg("ENGINE: '%s' exited %d", args, rc);
    double oracle = number(out, "ratio_to_oracle_after_first"), lru = number(out, "ratio_to_lru_model_after_first");
    if (!(oracle > 0 && oracle <= 1.05)) fail_msg("plan / oracle after the first step = %g (want <= 1.05): %s", oracle, out);
    if (!(lru > 0 && lru < 1)) fail_msg("plan / LRU model after the first step = %g (want < 1)", lru);
    assert_int_equal(number(out, "data_errors"), 0);
    free(out);
}

/* ENGINE: policy=plan on cyclic64 and train16 (tests/data) at 35, 50 and 75% of the trace's
 * footprint (scaled to stay quick; every size stays a multiple of the page): after the first
 * step no more than 1.05x the oracle's bytes, and fewer than the LRU model's. */
static void test_engine_access_traces_plan(void **state) {
    (void)state;
    static const struct { const char *trace; int scale; } cases[] = {{"cyclic64.access", 16}, {"train16.access", 8}};
    static const char *budgets[] = {"35%", "50%", "75%"};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        test_require_data(cases[c].trace);
        for (size_t b = 0; b < sizeof budgets / sizeof budgets[0]; b++) {
            char args[512], *out = NULL;
            snprintf(args, sizeof args, "simulate %s/%s --budget %s --scale %d --policy plan --json --compare",
                     SPW_TEST_DATA_DIR, cases[c].trace, budgets[b], cases[c].scale);
            int rc = run_cli(args, &out);
            if (rc != 0) fail_msg("ENGINE: '%s' exited %d", args, rc);
            double oracle = number(out, "ratio_to_oracle_after_first"), lru = number(out, "ratio_to_lru_model_after_first");
            if (!(oracle > 0 && oracle <= 1.05))
                fail_msg("%s at %s: plan / oracle after the first step = %g (want <= 1.05)", cases[c].trace, budgets[b], oracle);
            if (!(lru > 0 && lru < 1))
                fail_msg("%s at %s: plan / LRU model after the first step = %g (want < 1)", cases[c].trace, budgets[b], lru);
            assert_int_equal(number(out, "data_errors"), 0);
            free(out);
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_usage),
        cmocka_unit_test(test_bad_trace),
        cmocka_unit_test(test_model_only_json),
        cmocka_unit_test(test_human_header),
        cmocka_unit_test(test_engine_json),         /* ENGINE */
        cmocka_unit_test(test_engine_cyclic64_lru), /* ENGINE */
        cmocka_unit_test(test_engine_varcyclic_plan), /* ENGINE */
        cmocka_unit_test(test_engine_access_traces_plan), /* ENGINE */
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
