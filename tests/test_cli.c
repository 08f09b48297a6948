/* The spillway CLI as a user runs it: exit codes, messages, and the JSON of replay and
 * bench alloc on emu. Needs the spillway_cli target built (SPW_CLI is its path). */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct cli_result {
    int status; /* exit status, or -1 if it did not exit normally */
    char *out;  /* stdout, NUL-terminated */
    char *err;  /* stderr */
} cli_result;

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot read %s", path);
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1) break;
        cap *= 2;
        buf = realloc(buf, cap);
        assert_non_null(buf);
    }
    fclose(f);
    buf[n] = '\0';
    return buf;
}

/* Run `SPW_CLI args` through the shell with stdout and stderr captured. args is shell text. */
static cli_result run_cli(const char *args) {
    char out[] = "/tmp/spw_test_cli_out_XXXXXX", err[] = "/tmp/spw_test_cli_err_XXXXXX";
    int fo = mkstemp(out), fe = mkstemp(err);
    assert_true(fo >= 0 && fe >= 0);
    close(fo);
    close(fe);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s >'%s' 2>'%s' </dev/null", SPW_CLI, args, out, err);
    int ws = system(cmd);
    cli_result r = {WIFEXITED(ws) ? WEXITSTATUS(ws) : -1, slurp(out), slurp(err)};
    unlink(out);
    unlink(err);
    /* In sanitizer builds a report also exits non-zero: never let it pass for an expected
     * failure. */
    if (strstr(r.err, "Sanitizer") || strstr(r.err, "runtime error:"))
        fail_msg("spillway %s: sanitizer report:\n%s", args, r.err);
    return r;
}

static void cli_free(cli_result *r) {
    free(r->out);
    free(r->err);
}

static void expect_status(const cli_result *r, int want, const char *args) {
    if (r->status != want)
        fail_msg("spillway %s: exit %d, want %d\nstdout: %s\nstderr: %s", args, r->status, want,
                 r->out, r->err);
}

/* Run and check the exit status; the caller frees the result. */
static cli_result run_expect(const char *args, int want) {
    cli_result r = run_cli(args);
    expect_status(&r, want, args);
    return r;
}

/* The unsigned number after "key": in a JSON text; fails if absent. */
static uint64_t json_u64(const char *json, const char *key) {
    char pat[96];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *k = strstr(json, pat);
    if (!k) fail_msg("no key %s in %s", key, json);
    k += strlen(pat);
    while (*k == ' ') k++;
    if (*k < '0' || *k > '9') fail_msg("key %s is not an unsigned number in %s", key, json);
    return strtoull(k, NULL, 10);
}

static size_t count_of(const char *text, const char *needle) {
    size_t n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

static void test_help_version(void **state) {
    (void)state;
    cli_result r = run_expect("--help", 0);
    assert_non_null(strstr(r.out, "replay"));
    assert_non_null(strstr(r.out, "bench"));
    cli_free(&r);
    r = run_expect("--version", 0);
    assert_non_null(strstr(r.out, SPW_VERSION_STRING));
    cli_free(&r);
    r = run_expect("replay --help", 0);
    assert_non_null(strstr(r.out, "--budget"));
    cli_free(&r);
    r = run_expect("bench alloc --help", 0);
    assert_non_null(strstr(r.out, "--iters"));
    cli_free(&r);
}

static void test_usage_errors(void **state) {
    (void)state;
    static const struct {
        const char *args, *msg;
    } cases[] = {
        {"no-such-command", "unknown command"},
        {"", "usage"},
        {"replay", "missing TRACE"},
        {"replay x.trace --frobnicate", "unknown option '--frobnicate'"},
        {"replay x.trace --budget", "needs a value"},
        {"replay x.trace --budget 12parsecs", "bad --budget"},
        {"replay a.trace b.trace", "more than one trace"},
        {"bench", "usage"},
        {"bench nothing", "unknown benchmark"},
        {"bench alloc --iters 0", "bad --iters"},
        {"bench alloc --iters", "needs a value"},
        {"bench alloc --bogus", "unknown argument"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cli_result r = run_expect(cases[i].args, 2);
        if (!strstr(r.err, cases[i].msg))
            fail_msg("spillway %s: stderr lacks '%s': %s", cases[i].args, cases[i].msg, r.err);
        cli_free(&r);
    }
}

static void test_replay_bad_trace(void **state) {
    (void)state;
    char path[] = "/tmp/spw_test_cli_trace_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    static const char text[] = "a 1 4096 0\nf 1\nf 1\n";
    assert_int_equal(write(fd, text, sizeof text - 1), (ssize_t)(sizeof text - 1));
    close(fd);
    char args[256];
    snprintf(args, sizeof args, "replay '%s' --backend emu", path);
    cli_result r = run_cli(args);
    assert_int_not_equal(r.status, 0);
    if (!strstr(r.err, "line 3:") || !strstr(r.err, path) || !strstr(r.err, "already freed"))
        fail_msg("stderr does not name the file and line: %s", r.err);
    cli_free(&r);
    unlink(path);

    r = run_cli("replay /nonexistent/spw.trace.gz --backend emu");
    assert_int_equal(r.status, 1);
    assert_non_null(strstr(r.err, "/nonexistent/spw.trace.gz"));
    assert_non_null(strstr(r.err, "SPW_ERR_IO"));
    cli_free(&r);

    /* a usage error is reported before the trace is read */
    r = run_expect("replay /nonexistent/spw.trace.gz --backend warp", 2);
    assert_non_null(strstr(r.err, "bad --backend"));
    cli_free(&r);
}

static void test_replay_json(void **state) {
    (void)state;
    test_require_data("gpt2_train.trace.gz");
    const char *args = "replay '" SPW_TEST_DATA_DIR "/gpt2_train.trace.gz' --backend emu --json";
    cli_result r = run_expect(args, 0);
    static const char *const keys[] = {
        "trace", "backend", "budget_bytes", "ops", "allocs", "frees", "peak_reserved_bytes",
        "peak_live_bytes", "trace_peak_live", "reserved_over_live", "backend_allocs",
        "backend_frees", "ooms", "ns_per_op", "seconds"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        char pat[64];
        snprintf(pat, sizeof pat, "\"%s\":", keys[i]);
        if (!strstr(r.out, pat)) fail_msg("no key %s in %s", keys[i], r.out);
    }
    assert_non_null(strstr(r.out, "\"backend\": \"emu\""));
    /* one JSON object, nothing else on stdout */
    assert_int_equal(r.out[0], '{');
    assert_int_equal(count_of(r.out, "\n"), 1);
    assert_int_equal(json_u64(r.out, "allocs"), 6179);
    assert_int_equal(json_u64(r.out, "frees"), 6176);
    assert_int_equal(json_u64(r.out, "ops"), 6179 + 6176);
    assert_int_equal(json_u64(r.out, "trace_peak_live"), 7701353160ull);
    assert_int_equal(json_u64(r.out, "ooms"), 0);
    uint64_t reserved = json_u64(r.out, "peak_reserved_bytes");
    uint64_t live = json_u64(r.out, "peak_live_bytes");
    assert_true(reserved >= json_u64(r.out, "trace_peak_live"));
    assert_true(reserved >= live);
    assert_true(live >= json_u64(r.out, "trace_peak_live"));
    assert_true(reserved <= json_u64(r.out, "budget_bytes"));
    assert_non_null(strstr(r.err, "backend emu"));
    cli_free(&r);
}

static void test_replay_human_summary(void **state) {
    (void)state;
    test_require_data("gpt2_train.trace.gz");
    cli_result r = run_expect("replay '" SPW_TEST_DATA_DIR "/gpt2_train.trace.gz' --summary", 0);
    assert_non_null(strstr(r.out, "reserved/live"));
    assert_non_null(strstr(r.out, "ns/op"));
    assert_non_null(strstr(r.out, "backend_allocs")); /* from spw_summary */
    assert_non_null(strstr(r.err, "spillway: backend "));
    cli_free(&r);
}

/* Several trace streams: one spillway stream each (0 is the default stream); allocations the
 * trace leaves live are reported and freed. */
static void test_replay_streams(void **state) {
    (void)state;
    char path[] = "/tmp/spw_test_cli_trace_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    static const char text[] = "# three streams\n"
                               "a 18446744073709551615 1048576 0\n"
                               "a 2 4096 139872341196800\n"
                               "a 3 512 7\n"
                               "f 2\n"
                               "a 4 8192 139872341196800\n"
                               "f 18446744073709551615\n";
    assert_int_equal(write(fd, text, sizeof text - 1), (ssize_t)(sizeof text - 1));
    close(fd);
    char args[256];
    snprintf(args, sizeof args, "replay '%s' --backend emu --json --budget 64MiB", path);
    cli_result r = run_expect(args, 0);
    assert_int_equal(json_u64(r.out, "streams"), 3);
    assert_int_equal(json_u64(r.out, "allocs"), 4);
    assert_int_equal(json_u64(r.out, "frees"), 2);
    assert_int_equal(json_u64(r.out, "live_at_end"), 2);
    assert_int_equal(json_u64(r.out, "trace_peak_live"), 1048576 + 512 + 8192);
    assert_int_equal(json_u64(r.out, "budget_bytes"), 64u << 20);
    cli_free(&r);
    unlink(path);
}

/* A bad SPILLWAY_CONF is a usage error that names the key. */
static void test_bad_env(void **state) {
    (void)state;
    assert_int_equal(setenv("SPILLWAY_CONF", "no_such_option=1", 1), 0);
    cli_result r = run_cli("replay /nonexistent.trace");
    cli_result b = run_cli("bench alloc --iters 10");
    unsetenv("SPILLWAY_CONF");
    expect_status(&r, 2, "replay (bad SPILLWAY_CONF)");
    expect_status(&b, 2, "bench alloc (bad SPILLWAY_CONF)");
    assert_non_null(strstr(r.err, "no_such_option"));
    assert_non_null(strstr(b.err, "no_such_option"));
    cli_free(&r);
    cli_free(&b);
}

/* A budget below the trace's peak: the replay fails, naming the op and the budget. */
static void test_replay_oom(void **state) {
    (void)state;
    test_require_data("gpt2_train.trace.gz");
    cli_result r = run_expect(
        "replay '" SPW_TEST_DATA_DIR "/gpt2_train.trace.gz' --backend emu --budget 1GiB --json", 1);
    assert_non_null(strstr(r.err, "replay op "));
    assert_non_null(strstr(r.err, "SPW_ERR_OUT_OF_MEMORY"));
    /* words for a command-line user: the default stream by name, no C function to call */
    assert_non_null(strstr(r.err, " on the default stream;"));
    assert_null(strstr(r.err, "(nil)"));
    assert_null(strstr(r.err, "spw_"));
    assert_string_equal(r.out, "");
    cli_free(&r);
}

static void test_bench_alloc_json(void **state) {
    (void)state;
    cli_result r = run_expect("bench alloc --backend emu --json --iters 20", 0);
    assert_int_equal(r.out[0], '{');
    assert_non_null(strstr(r.out, "\"backend\": \"emu\""));
    assert_int_equal(count_of(r.out, "\"bytes\":"), 4);
    assert_int_equal(count_of(r.out, "\"spillway_ns\":"), 4);
    assert_int_equal(json_u64(r.out, "bytes"), 1024);
    /* every timed pair must have been served from spillway's cache */
    assert_int_equal(count_of(r.out, "\"cached\": true"), 4);
    cli_free(&r);
    r = run_expect("bench alloc --backend emu --iters 10", 0);
    assert_non_null(strstr(r.out, "1 GiB"));
    assert_non_null(strstr(r.out, "spillway ns"));
    cli_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_help_version),
        cmocka_unit_test(test_usage_errors),
        cmocka_unit_test(test_replay_bad_trace),
        cmocka_unit_test(test_replay_json),
        cmocka_unit_test(test_replay_human_summary),
        cmocka_unit_test(test_replay_streams),
        cmocka_unit_test(test_bad_env),
        cmocka_unit_test(test_replay_oom),
        cmocka_unit_test(test_bench_alloc_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
