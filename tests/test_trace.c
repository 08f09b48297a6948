/* Allocation trace loader: valid input (plain and gzip), every kind of malformed line reported
 * with its line number, missing files, and the recorded traces (tests/data) against their .json. */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

static char tmp_path[256];

/* Write text to a fresh temporary file, gzip-compressed when gz; returns its path (static). */
static const char *write_temp(const char *text, int gz) {
    snprintf(tmp_path, sizeof tmp_path, "/tmp/spw_test_trace_XXXXXX");
    int fd = mkstemp(tmp_path);
    assert_true(fd >= 0);
    if (gz) {
        gzFile g = gzdopen(fd, "wb");
        assert_non_null(g);
        if (*text) assert_int_equal(gzputs(g, text), (int)strlen(text));
        assert_int_equal(gzclose(g), Z_OK);
    } else {
        FILE *f = fdopen(fd, "w");
        assert_non_null(f);
        assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
        assert_int_equal(fclose(f), 0);
    }
    return tmp_path;
}

static const char valid_text[] =
    "# a comment\n"
    "\n"
    "a 1 1024 0\n"
    "  a 2\t4096   7  # trailing comment\r\n"
    "f 1\n"
    "   \n"
    "a 18446744073709551615 512 0\n"
    "f 2\n"
    "a 3 100 0"; /* last line without a newline; 3 stays live */

static void check_valid(const spw_trace *t) {
    assert_int_equal(t->count, 6);
    const spw_trace_op *o = t->ops;
    assert_int_equal(o[0].kind, 'a');
    assert_int_equal(o[0].id, 1);
    assert_int_equal(o[0].bytes, 1024);
    assert_int_equal(o[0].stream, 0);
    assert_int_equal(o[1].kind, 'a');
    assert_int_equal(o[1].id, 2);
    assert_int_equal(o[1].bytes, 4096);
    assert_int_equal(o[1].stream, 7);
    /* an 'f' op repeats its allocation's bytes and stream */
    assert_int_equal(o[2].kind, 'f');
    assert_int_equal(o[2].id, 1);
    assert_int_equal(o[2].bytes, 1024);
    assert_int_equal(o[2].stream, 0);
    assert_true(o[3].id == UINT64_MAX);
    assert_int_equal(o[4].kind, 'f');
    assert_int_equal(o[4].id, 2);
    assert_int_equal(o[4].bytes, 4096);
    assert_int_equal(o[4].stream, 7);
    assert_int_equal(o[5].kind, 'a');
    assert_int_equal(o[5].id, 3);
}

static void test_valid_plain(void **state) {
    (void)state;
    const char *path = write_temp(valid_text, 0);
    spw_trace t = {0};
    assert_ok(spw__trace_load(path, &t));
    check_valid(&t);
    spw__trace_free(&t);
    assert_null(t.ops);
    assert_int_equal(t.count, 0);
    unlink(path);
}

static void test_valid_gzip(void **state) {
    (void)state;
    const char *path = write_temp(valid_text, 1);
    spw_trace t = {0};
    assert_ok(spw__trace_load(path, &t));
    check_valid(&t);
    spw__trace_free(&t);
    unlink(path);
}

static void test_empty(void **state) {
    (void)state;
    const char *texts[] = {"", "# only a comment\n\n"};
    for (size_t i = 0; i < 2; i++) {
        const char *path = write_temp(texts[i], (int)i);
        spw_trace t = {0};
        assert_ok(spw__trace_load(path, &t));
        assert_int_equal(t.count, 0);
        spw__trace_free(&t);
        unlink(path);
    }
}

typedef struct bad_case {
    const char *text;
    const char *line; /* "line N:" */
    const char *what; /* a piece of the message */
} bad_case;

static const bad_case bad_cases[] = {
    {"a 1 10 0\n\nx 1 2 3\n", "line 3:", "unknown op 'x'"},
    {"alloc 1 10 0\n", "line 1:", "unknown op 'alloc'"},
    {"a 1 10 0\na 2 10\n", "line 2:", "missing field <stream>"},
    {"a 1\n", "line 1:", "missing field <bytes>"},
    {"a 1 10 0\n# c\nf\n", "line 3:", "missing field <id>"},
    {"a 1 10 0 # c\na 2 # 10 0\n", "line 2:", "missing field <bytes>"},
    {"a one 10 0\n", "line 1:", "<id> is not a number: 'one'"},
    {"a 1 10x 0\n", "line 1:", "<bytes> is not a number: '10x'"},
    {"a 1 -5 0\n", "line 1:", "<bytes> is not a number: '-5'"},
    {"a 1 +5 0\n", "line 1:", "<bytes> is not a number"},
    {"a 1 10 0\nf 0x1\n", "line 2:", "<id> is not a number"},
    {"a 18446744073709551616 10 0\n", "line 1:", "out of range"},
    {"a 1 10 0 extra\n", "line 1:", "trailing garbage"},
    {"a 1 10 0\nf 1 1\n", "line 2:", "trailing garbage"},
    {"a 1 0 0\n", "line 1:", "bytes 0"},
    {"a 1 10 0\na 2 10 0\na 1 10 0\n", "line 3:", "duplicate allocation id 1"},
    {"a 1 10 0\nf 1\na 1 10 0\n", "line 3:", "duplicate allocation id 1"},
    {"a 1 10 0\nf 2\n", "line 2:", "unknown id 2"},
    {"a 1 10 0\nf 1\n\nf 1\n", "line 4:", "already freed"},
    {"a 1 10 0\nf 1\nf 1\n", "line 3:", "already freed"},
};

/* A malformed trace fails with SPW_ERR_PARSE naming the file, the line and the fault, and hands
 * nothing back (out is untouched). Both as plain text and gzip. */
static void test_malformed(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        for (int gz = 0; gz < 2; gz++) {
            const bad_case *c = &bad_cases[i];
            const char *path = write_temp(c->text, gz);
            spw_trace_op sentinel;
            spw_trace t = {&sentinel, 12345};
            spw_status st = spw__trace_load(path, &t);
            const char *msg = spw_last_error();
            if (st != SPW_ERR_PARSE || !strstr(msg, c->line) || !strstr(msg, c->what) ||
                !strstr(msg, path))
                fail_msg("case %zu (%s): got %s '%s', want SPW_ERR_PARSE with '%s' and '%s'", i,
                         gz ? "gzip" : "plain", spw_status_str(st), msg, c->line, c->what);
            assert_ptr_equal(t.ops, &sentinel);
            assert_int_equal(t.count, 12345);
            unlink(path);
        }
    }
}

static void test_long_line_and_nul(void **state) {
    (void)state;
    char *text = malloc(10000);
    assert_non_null(text);
    strcpy(text, "a 1 10 0\n# ");
    memset(text + strlen(text), 'x', 8000);
    strcpy(text + 11 + 8000, "\n");
    const char *path = write_temp(text, 0);
    spw_trace t = {0};
    assert_status(spw__trace_load(path, &t), SPW_ERR_PARSE);
    assert_non_null(strstr(spw_last_error(), "line 2:"));
    assert_non_null(strstr(spw_last_error(), "longer than"));
    unlink(path);
    free(text);

    /* a NUL byte inside a line would hide the rest of it */
    snprintf(tmp_path, sizeof tmp_path, "/tmp/spw_test_trace_XXXXXX");
    int fd = mkstemp(tmp_path);
    assert_true(fd >= 0);
    static const char nul_text[] = "a 1 10 0\na 2 1\0 0\nf 1\n";
    assert_int_equal(write(fd, nul_text, sizeof nul_text - 1), (ssize_t)(sizeof nul_text - 1));
    close(fd);
    assert_status(spw__trace_load(tmp_path, &t), SPW_ERR_PARSE);
    assert_non_null(strstr(spw_last_error(), "line 2:"));
    unlink(tmp_path);
}

/* A gzip stream cut short is reported as such, not as a short last line. */
static void test_truncated_gzip(void **state) {
    (void)state;
    char *text = malloc(200000);
    assert_non_null(text);
    size_t n = 0;
    for (int i = 0; i < 5000; i++) n += (size_t)sprintf(text + n, "a %d %d 0\n", i, 1000 + i * 7);
    const char *path = write_temp(text, 1);
    free(text);
    FILE *f = fopen(path, "r+");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long size = ftell(f);
    fclose(f);
    assert_int_equal(truncate(path, size / 2), 0);
    spw_trace t = {0};
    assert_status(spw__trace_load(path, &t), SPW_ERR_PARSE);
    assert_non_null(strstr(spw_last_error(), "truncated"));
    unlink(path);
}

static void test_missing_file(void **state) {
    (void)state;
    spw_trace t = {0};
    assert_status(spw__trace_load("/nonexistent/spw/trace.gz", &t), SPW_ERR_IO);
    assert_non_null(strstr(spw_last_error(), "/nonexistent/spw/trace.gz"));
    assert_non_null(strstr(spw_last_error(), "No such file"));
    assert_null(t.ops);
    /* a directory opens but cannot be read */
    assert_status(spw__trace_load("/tmp", &t), SPW_ERR_IO);
    assert_non_null(strstr(spw_last_error(), "/tmp"));
    assert_status(spw__trace_load(NULL, &t), SPW_ERR_INVALID_ARGUMENT);
}

/* Value of "key": N in a small JSON file, or fail. */
static uint64_t json_u64(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    if (!f) fail_msg("cannot open %s", path);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    const char *k = strstr(buf, pat);
    if (!k || !(k = strchr(k, ':'))) fail_msg("%s has no key %s", path, key);
    return strtoull(k + 1, NULL, 10);
}

static void check_real_trace(const char *name) {
    char trace[512], json[512];
    snprintf(trace, sizeof trace, "%s.trace.gz", name);
    test_require_data(trace);
    snprintf(json, sizeof json, "%s.json", name);
    test_require_data(json);
    snprintf(trace, sizeof trace, "%s/%s.trace.gz", SPW_TEST_DATA_DIR, name);
    snprintf(json, sizeof json, "%s/%s.json", SPW_TEST_DATA_DIR, name);
    spw_trace t = {0};
    uint64_t t0 = spw__now_ns();
    assert_ok(spw__trace_load(trace, &t));
    double ms = (double)(spw__now_ns() - t0) / 1e6;
    print_message("%s: %zu ops loaded in %.2f ms\n", name, t.count, ms);
    /* The target is well under 50 ms; the bound leaves room for sanitizer builds. */
    assert_true(ms < 500.0);
    uint64_t allocs = 0, frees = 0, live = 0, peak = 0;
    for (size_t i = 0; i < t.count; i++) {
        if (t.ops[i].kind == 'a') {
            allocs++;
            live += t.ops[i].bytes;
            if (live > peak) peak = live;
        } else {
            assert_int_equal(t.ops[i].kind, 'f');
            frees++;
            live -= t.ops[i].bytes;
        }
    }
    assert_int_equal(allocs, json_u64(json, "allocs"));
    assert_int_equal(frees, json_u64(json, "frees"));
    assert_int_equal(peak, json_u64(json, "trace_peak_live"));
    spw__trace_free(&t);
}

static void test_real_gpt2(void **state) {
    (void)state;
    check_real_trace("gpt2_train");
}

static void test_real_bert(void **state) {
    (void)state;
    check_real_trace("bert_varlen_train");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_plain),
        cmocka_unit_test(test_valid_gzip),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_long_line_and_nul),
        cmocka_unit_test(test_truncated_gzip),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_real_gpt2),
        cmocka_unit_test(test_real_bert),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
