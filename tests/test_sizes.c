/* One size grammar: every row of tests/data/sizes.txt gives the same bytes, percentage or error
 * through the library (spw_parse_budget), SPILLWAY_CONF (the options table), the interposer's
 * configuration (preload/ledger.c, as SPILLWAY_BUDGET and as SPILLWAY_CONF's budget) and the CLI
 * (`spillway replay --budget`, `spillway run --budget`). tests/python/test_sizes.py runs the same
 * table through the Python package. Also: the printer, shared by C and Python, parses back. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ledger.h"
#include "test_util.h"

#define TABLE SPW_TEST_DATA_DIR "/sizes.txt"
#define EMU_TOTAL (80ull << 30) /* the emu device's default size: percentages resolve against it */

typedef struct row {
    int line;
    char text[64];
    enum { R_BYTES, R_PCT, R_ERROR } kind;
    unsigned long long bytes;
    double pct;
    char want[256]; /* R_ERROR: "bad size 'TRIMMED': WHY" */
} row;

static size_t load(row *rows, size_t max) {
    FILE *f = fopen(TABLE, "r");
    if (!f) fail_msg("cannot open %s", TABLE);
    char line[512];
    size_t n = 0;
    for (int ln = 1; fgets(line, sizeof line, f); ln++) {
        line[strcspn(line, "\n")] = '\0';
        if (line[0] != '"') continue; /* comments and blank lines */
        char *close = strchr(line + 1, '"');
        if (!close || n == max) fail_msg("%s:%d: bad row", TABLE, ln);
        row *r = &rows[n++];
        memset(r, 0, sizeof *r);
        r->line = ln;
        snprintf(r->text, sizeof r->text, "%.*s", (int)(close - line - 1), line + 1);
        char *res = close + 1;
        while (*res == ' ' || *res == '\t') res++;
        if (!strncmp(res, "error ", 6)) {
            const char *t = r->text, *e = r->text + strlen(r->text);
            while (*t == ' ' || *t == '\t') t++;
            while (e > t && (e[-1] == ' ' || e[-1] == '\t')) e--;
            r->kind = R_ERROR;
            snprintf(r->want, sizeof r->want, "bad size '%.*s': %s", (int)(e - t), t, res + 6);
        } else if (res[strlen(res) - 1] == '%') {
            r->kind = R_PCT;
            r->pct = strtod(res, NULL);
        } else {
            r->kind = R_BYTES;
            r->bytes = strtoull(res, NULL, 10);
        }
    }
    fclose(f);
    if (n < 40) fail_msg("%s: only %zu rows", TABLE, n);
    return n;
}

/* One surface's answer for a row. */
typedef struct answer {
    bool ok;
    bool is_pct;
    unsigned long long bytes;
    double pct;
    char msg[1024];
} answer;

static int check(const row *r, const char *surface, const answer *a) {
    char got[1200];
    if (!a->ok) snprintf(got, sizeof got, "error: %s", a->msg);
    else if (a->is_pct) snprintf(got, sizeof got, "%g%%", a->pct);
    else snprintf(got, sizeof got, "%llu", a->bytes);
    bool good = r->kind == R_ERROR ? !a->ok && strstr(a->msg, r->want)
                : r->kind == R_PCT ? a->ok && a->is_pct && a->pct == r->pct
                                   : a->ok && !a->is_pct && a->bytes == r->bytes;
    if (good) return 0;
    print_error("%s:%d: \"%s\" through %s: got %s, want %s%s\n", TABLE, r->line, r->text, surface, got,
                r->kind == R_ERROR ? "an error containing " : "",
                r->kind == R_ERROR ? r->want : r->kind == R_PCT ? "a percentage" : "bytes");
    if (r->kind == R_PCT) print_error("  (want %g%%)\n", r->pct);
    if (r->kind == R_BYTES) print_error("  (want %llu)\n", r->bytes);
    return 1;
}

static answer via_library(const char *text) {
    answer a = {0};
    uint64_t b = 0;
    double p = 0;
    a.ok = spw_parse_budget(text, 0, &b, &p) == SPW_OK;
    if (!a.ok) snprintf(a.msg, sizeof a.msg, "%s", spw_last_error());
    a.is_pct = p > 0;
    a.bytes = b;
    a.pct = p;
    return a;
}

static answer via_conf(const char *text) {
    answer a = {0};
    char env[128], val[64];
    snprintf(env, sizeof env, "budget=%s", text);
    setenv("SPILLWAY_CONF", env, 1);
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    a.ok = spw_config_from_env(cfg) == SPW_OK;
    unsetenv("SPILLWAY_CONF");
    if (!a.ok) {
        snprintf(a.msg, sizeof a.msg, "%s", spw_last_error());
    } else {
        assert_ok(spw_config_get(cfg, "budget", val, sizeof val));
        a.is_pct = val[strlen(val) - 1] == '%';
        if (a.is_pct) a.pct = strtod(val, NULL);
        else a.bytes = strtoull(val, NULL, 10);
    }
    spw_config_destroy(cfg);
    return a;
}

static answer via_interposer(const char *conf, const char *budget) {
    answer a = {0};
    spwp_config c;
    a.ok = spwp_config_load(&c, conf, budget, NULL, NULL, a.msg, sizeof a.msg) == 0;
    if (a.ok) {
        a.is_pct = c.budget_default.is_percent;
        a.bytes = c.budget_default.bytes;
        a.pct = c.budget_default.percent;
    }
    return a;
}

/* The CLI's start-up dominates (it links the CUDA libraries), so every row's command starts
 * at once and is read afterwards. */
static FILE *start(const char *fmt, const char *text, const char *trace) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, fmt, SPW_CLI, trace, text);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    return p;
}

static int finish(FILE *p, char *out, size_t len) {
    size_t n = fread(out, 1, len - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* spillway replay of an empty trace on emu: --json says the budget in bytes. */
#define REPLAY "env -u SPILLWAY_CONF %s replay %s --backend emu --budget '%s' --json 2>&1"
static answer replay_answer(FILE *p) {
    answer a = {0};
    char out[8192];
    int rc = finish(p, out, sizeof out);
    const char *b = strstr(out, "\"budget_bytes\": ");
    a.ok = rc == 0 && b;
    if (!a.ok) {
        snprintf(a.msg, sizeof a.msg, "exit %d: %.900s", rc, out);
        return a;
    }
    a.bytes = strtoull(b + 16, NULL, 10);
    return a;
}

#ifdef SPWP_HAVE_SHIM
/* spillway run accepts (runs the command) or refuses (exit 2 with the message). */
#define RUN "env -u SPILLWAY_CONF -u SPILLWAY_BUDGET %s run%.0s --budget '%s' -- true 2>&1"
static answer run_answer(FILE *p) {
    answer a = {0};
    int rc = finish(p, a.msg, sizeof a.msg);
    a.ok = rc == 0;
    if (!a.ok && rc != 2) snprintf(a.msg + strlen(a.msg), sizeof a.msg - strlen(a.msg), " (exit %d)", rc);
    return a;
}
#endif

static void one_grammar(void **state) {
    (void)state;
    static row rows[128];
    size_t n = load(rows, 128);
    char trace[] = "/tmp/spw_sizes_XXXXXX";
    int fd = mkstemp(trace);
    assert_true(fd >= 0);
    assert_true(write(fd, "# no events\n", 12) == 12);
    close(fd);
    static FILE *replays[128];
    for (size_t i = 0; i < n; i++) replays[i] = start(REPLAY, rows[i].text, trace);
#ifdef SPWP_HAVE_SHIM
    /* spillway run validates with the interposer's spwp_parse_budget, checked above for every
     * row; through the CLI itself: every error, and every text with a blank (which it refused) */
    static FILE *runs[128];
    for (size_t i = 0; i < n; i++)
        runs[i] = rows[i].kind == R_ERROR || strpbrk(rows[i].text, " \t") ? start(RUN, rows[i].text, "") : NULL;
#endif
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        const row *r = &rows[i];
        char conf[128];
        snprintf(conf, sizeof conf, "budget=%s", r->text);
        answer lib = via_library(r->text);
        bad += check(r, "spw_parse_budget", &lib);
        answer cf = via_conf(r->text);
        bad += check(r, "SPILLWAY_CONF", &cf);
        answer ib = via_interposer(NULL, r->text);
        bad += check(r, "the interposer's SPILLWAY_BUDGET", &ib);
        answer ic = via_interposer(conf, NULL);
        bad += check(r, "the interposer's SPILLWAY_CONF", &ic);
        /* the CLI: replay resolves a percentage against the emu device */
        answer rp = replay_answer(replays[i]);
        row rr = *r;
        if (r->kind == R_PCT) {
            spw_size_spec s = {.percent = r->pct, .is_percent = true};
            rr.kind = R_BYTES;
            rr.bytes = spw__size_resolve_spec(&s, EMU_TOTAL);
        }
        bad += check(&rr, "spillway replay --budget", &rp);
#ifdef SPWP_HAVE_SHIM
        /* run passes the text on to the interposer (checked above): here, accepted or the error */
        if (runs[i]) {
            answer rn = run_answer(runs[i]);
            if (r->kind == R_ERROR || !rn.ok) bad += check(r, "spillway run --budget", &rn);
        }
#endif
    }
    unlink(trace);
    if (bad) fail_msg("%d disagreements with %s", bad, TABLE);
}

/* The printer: C and Python (format_size calls spw_format_size) print the same; printed text
 * parses back to the bytes rounded to two decimals. */
static void printing(void **state) {
    (void)state;
    static const struct {
        unsigned long long bytes;
        const char *text;
    } cases[] = {{0, "0 B"},
                 {1023, "1023 B"},
                 {1024, "1.00 KiB"},
                 {1536, "1.50 KiB"},
                 {3ull << 20, "3.00 MiB"},
                 {6ull << 30, "6.00 GiB"},
                 {(3ull << 29), "1.50 GiB"},
                 {5ull << 40, "5.00 TiB"},
                 {3ull << 50, "3072.00 TiB"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[SPW_SIZE_FMT_MAX];
        assert_string_equal(spw_format_size(cases[i].bytes, buf, sizeof buf), cases[i].text);
        size_t back;
        assert_ok(spw_parse_size(buf, &back));
        assert_int_equal(back, cases[i].bytes);
    }
    char big[64];
    /* spw__fmt_bytes, in the library's messages: the same text, then the exact bytes */
    assert_string_equal(spw__fmt_bytes(big, sizeof big, 3ull << 29), "1.50 GiB (1610612736 B)");
    assert_string_equal(spw__fmt_bytes(big, sizeof big, 512), "512 B");
    char tiny[4];
    assert_string_equal(spw_format_size(1ull << 30, tiny, sizeof tiny), "1.0");
    assert_string_equal(spw_format_size(1, NULL, 0), "");
}

/* Bad arguments change nothing; percentages resolve against the device size given. */
static void api_edges(void **state) {
    (void)state;
    size_t v = 7;
    assert_status(spw_parse_size(NULL, &v), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_parse_size("1G", NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_parse_size("50%", &v), SPW_ERR_CONFIG);
    assert_non_null(strstr(spw_last_error(), "bad size '50%': a percentage is not accepted here"));
    assert_ok(spw_parse_size("0", &v));
    assert_int_equal(v, 0); /* a size may be 0; a budget may not */
    uint64_t b = 7;
    double p = 7;
    assert_status(spw_parse_budget(NULL, 0, &b, &p), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_parse_budget("0", 0, &b, &p), SPW_ERR_CONFIG);
    assert_true(b == 7 && p == 7);
    assert_ok(spw_parse_budget("12.5%", 1ull << 20, &b, &p));
    assert_true(b == 131072 && p == 12.5);
    assert_ok(spw_parse_budget("3 GB", 1ull << 20, &b, NULL));
    assert_true(b == 3ull << 30);
    assert_ok(spw_parse_budget("3 GB", 0, NULL, &p));
    assert_true(p == 0);
    /* a long text is quoted shortened; the message still says why */
    char longtext[200];
    memset(longtext, '9', sizeof longtext - 1);
    longtext[sizeof longtext - 1] = '\0';
    assert_status(spw_parse_budget(longtext, 0, &b, &p), SPW_ERR_CONFIG);
    assert_non_null(strstr(spw_last_error(), "...': too large"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(one_grammar),
        cmocka_unit_test(printing),
        cmocka_unit_test(api_edges),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
