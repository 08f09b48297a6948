/*
 * spillway probe: the fallback classifier on synthetic bandwidth series, the PCIe and budget
 * arithmetic, and the CLI on emu (JSON shape, table, bad arguments). No GPU needed; with --gpu,
 * only the real probe on a CUDA device (test_probe_gpu).
 */
#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "probe.h"

/* ---- classifier ---- */

static size_t count_class(const spw_chunk_verdict *v, size_t n, spw_chunk_class c) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += v[i].cls == c;
    return k;
}

static void classify_flat_vram(void **state) {
    (void)state;
    double s[64];
    spw_chunk_verdict v[64];
    for (int i = 0; i < 64; i++) s[i] = 2000.0;
    double ref = spw_probe_classify(s, 64, 0, v);
    assert_true(fabs(ref - 2000.0) < 1e-9);
    assert_int_equal(count_class(v, 64, SPW_CHUNK_VRAM), 64);
    for (int i = 0; i < 64; i++) assert_true(fabs(v[i].ratio - 1.0) < 1e-9);
}

static void classify_cliff_flags_exactly_after(void **state) {
    (void)state;
    /* VRAM for 10 chunks, then the driver backs the rest with system memory */
    double s[16];
    spw_chunk_verdict v[16];
    for (int i = 0; i < 16; i++) s[i] = i < 10 ? 2000.0 + 10 * (i % 3) : 24.0 + i % 2;
    double ref = spw_probe_classify(s, 16, SPW_DETECT_THRESHOLD, v);
    assert_true(ref > 1990 && ref < 2030);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(v[i].cls, i < 10 ? SPW_CHUNK_VRAM : SPW_CHUNK_SYSMEM);
        if (i >= 10) assert_non_null(strstr(v[i].reason, "system memory"));
    }

    /* a cliff right after chunk 0 must not drag the reference down */
    double t[5] = {400.0, 12.0, 11.0, 12.5, 11.8};
    spw_chunk_verdict w[5];
    ref = spw_probe_classify(t, 5, 0, w);
    assert_true(fabs(ref - 400.0) < 1e-9);
    assert_int_equal(w[0].cls, SPW_CHUNK_VRAM);
    assert_int_equal(count_class(w, 5, SPW_CHUNK_SYSMEM), 4);

    /* a cliff in the middle of the leading chunks: only the ones after it are flagged */
    double u[6] = {300, 310, 20, 290, 305, 21};
    spw_chunk_verdict x[6];
    spw_probe_classify(u, 6, 0, x);
    assert_int_equal(x[2].cls, SPW_CHUNK_SYSMEM);
    assert_int_equal(x[5].cls, SPW_CHUNK_SYSMEM);
    assert_int_equal(count_class(x, 6, SPW_CHUNK_VRAM), 4);
}

static void classify_noisy_vram_no_false_positive(void **state) {
    (void)state;
    enum { N = 200 };
    double s[N];
    spw_chunk_verdict v[N];
    for (uint64_t seed = 1; seed <= 200; seed++) {
        uint64_t rs = seed * 0x9E3779B97F4A7C15ull;
        for (int i = 0; i < N; i++) {
            double u = (double)(test_rand(&rs) % 40001) / 100000.0 - 0.2; /* [-0.2, +0.2] */
            s[i] = 2000.0 * (1.0 + u);
        }
        spw_probe_classify(s, N, 0, v);
        size_t flagged = count_class(v, N, SPW_CHUNK_SYSMEM);
        if (flagged) fail_msg("seed %llu: %zu of %d noisy VRAM chunks flagged", (unsigned long long)seed, flagged, N);
    }
    /* worst case: the reference chunks at +20%, every later one at -20% */
    for (int i = 0; i < N; i++) s[i] = i < SPW_DETECT_REF_MAX ? 2400.0 : 1600.0;
    spw_probe_classify(s, N, 0, v);
    assert_int_equal(count_class(v, N, SPW_CHUNK_SYSMEM), 0);
    /* and the reverse: the first chunk 20% low, everything else 20% high */
    s[0] = 1600.0;
    for (int i = 1; i < N; i++) s[i] = 2400.0;
    spw_probe_classify(s, N, 0, v);
    assert_int_equal(count_class(v, N, SPW_CHUNK_SYSMEM), 0);
}

static void classify_selftest_like_series(void **state) {
    (void)state;
    /* what spw_probe_measure classifies on an H200: 64 VRAM chunks (~2 TB/s read), then the
     * self-test's mapped host memory (~55 GB/s over PCIe) appended last */
    enum { N = 65 };
    double s[N];
    spw_chunk_verdict v[N];
    uint64_t rs = 42;
    for (int i = 0; i < N - 1; i++) s[i] = 2050.0 + (double)(test_rand(&rs) % 200) - 100.0;
    s[N - 1] = 55.0;
    double ref = spw_probe_classify(s, N, 0, v);
    assert_true(ref > 1900 && ref < 2200);
    assert_int_equal(count_class(v, N - 1, SPW_CHUNK_VRAM), N - 1);
    assert_int_equal(v[N - 1].cls, SPW_CHUNK_SYSMEM);
    assert_true(v[N - 1].ratio < 0.05);
    /* the same on a small laptop GPU: 180 GB/s VRAM, PCIe 3 x8 host memory */
    double t[4] = {180, 175, 182, 6.5};
    spw_probe_classify(t, 4, 0, v);
    assert_int_equal(v[3].cls, SPW_CHUNK_SYSMEM);
    assert_int_equal(count_class(v, 3, SPW_CHUNK_VRAM), 3);
}

static void classify_invalid_measurements(void **state) {
    (void)state;
    double s[5] = {0.0, NAN, 500.0, 480.0, -1.0};
    spw_chunk_verdict v[5];
    double ref = spw_probe_classify(s, 5, 0, v);
    assert_true(ref > 479 && ref < 501);
    assert_int_equal(v[0].cls, SPW_CHUNK_INVALID);
    assert_int_equal(v[1].cls, SPW_CHUNK_INVALID);
    assert_int_equal(v[2].cls, SPW_CHUNK_VRAM);
    assert_int_equal(v[4].cls, SPW_CHUNK_INVALID);
    double z[2] = {0, 0};
    assert_true(spw_probe_classify(z, 2, 0, v) == 0.0);
    assert_int_equal(count_class(v, 2, SPW_CHUNK_INVALID), 2);
    assert_string_equal(spw_chunk_class_name(SPW_CHUNK_SYSMEM), "sysmem");
}

/* ---- arithmetic ---- */

static void link_and_budget_arithmetic(void **state) {
    (void)state;
    assert_true(fabs(spw_probe_link_gbps(5, 16) - 63.0154) < 1e-3); /* H200's link */
    assert_true(fabs(spw_probe_link_gbps(4, 16) - 31.5077) < 1e-3);
    assert_true(fabs(spw_probe_link_gbps(3, 16) - 15.7538) < 1e-3);
    assert_true(fabs(spw_probe_link_gbps(2, 16) - 8.0) < 1e-9);   /* 8b/10b */
    assert_true(fabs(spw_probe_link_gbps(1, 1) - 0.25) < 1e-9);
    assert_true(spw_probe_link_gbps(0, 16) == 0 && spw_probe_link_gbps(7, 16) == 0 && spw_probe_link_gbps(5, 0) == 0);
    assert_int_equal(spw_probe_gen_from_sysfs("32.0 GT/s PCIe"), 5);
    assert_int_equal(spw_probe_gen_from_sysfs("8.0 GT/s PCIe"), 3);
    assert_int_equal(spw_probe_gen_from_sysfs("2.5 GT/s"), 1);
    assert_int_equal(spw_probe_gen_from_sysfs("Unknown"), 0);
    assert_int_equal(spw_probe_gen_from_sysfs("12 GT/s"), 0);

    /* 95% rounded down to 256 MiB */
    assert_int_equal(spw_probe_recommend_budget(8 * SPW_GiB), 7 * SPW_GiB + 512 * SPW_MiB);
    assert_int_equal(spw_probe_recommend_budget(100 * SPW_MiB), 0);
    size_t b = spw_probe_recommend_budget((size_t)(125.6 * (double)SPW_GiB));
    assert_int_equal(b % (256 * SPW_MiB), 0);
    assert_true(b <= (size_t)(0.95 * 125.6 * (double)SPW_GiB) && b + 256 * SPW_MiB > (size_t)(0.95 * 125.6 * (double)SPW_GiB));
    char buf[32];
    assert_string_equal(spw_probe_size_arg(buf, sizeof buf, 119 * SPW_GiB), "119GiB");
    assert_string_equal(spw_probe_size_arg(buf, sizeof buf, 1536 * SPW_MiB), "1536MiB");
    /* the recommendation must parse back to itself through the library's parser */
    size_t back = 0;
    assert_ok(spw_parse_size(spw_probe_size_arg(buf, sizeof buf, 1536 * SPW_MiB), &back));
    assert_int_equal(back, 1536 * SPW_MiB);
    double m[4] = {4, 1, 3, 2};
    assert_true(spw_probe_median(m, 4) == 2.5 && spw_probe_median(m, 3) == 3.0);
}

/* ---- the CLI ---- */


/* A strict JSON syntax check (RFC 8259 values, no trailing garbage). */
typedef struct jp {
    const char *s;
    int depth;
} jp;
static void jws(jp *p) {
    while (*p->s == ' ' || *p->s == '\n' || *p->s == '\t' || *p->s == '\r') p->s++;
}
static bool jvalue(jp *p);
static bool jstring(jp *p) {
    if (*p->s != '"') return false;
    for (p->s++; *p->s != '"'; p->s++) {
        if ((unsigned char)*p->s < 0x20) return false;
        if (*p->s == '\\') {
            p->s++;
            if (*p->s == 'u') {
                for (int i = 1; i <= 4; i++)
                    if (!strchr("0123456789abcdefABCDEF", p->s[i]) || !p->s[i]) return false;
                p->s += 4;
            } else if (!*p->s || !strchr("\"\\/bfnrt", *p->s)) {
                return false;
            }
        }
    }
    p->s++;
    return true;
}
static bool jnumber(jp *p) {
    const char *s = p->s;
    if (*s == '-') s++;
    if (*s == '0')
        s++;
    else if (*s >= '1' && *s <= '9')
        while (*s >= '0' && *s <= '9') s++;
    else
        return false;
    if (*s == '.') {
        s++;
        if (!(*s >= '0' && *s <= '9')) return false;
        while (*s >= '0' && *s <= '9') s++;
    }
    if (*s == 'e' || *s == 'E') {
        s++;
        if (*s == '+' || *s == '-') s++;
        if (!(*s >= '0' && *s <= '9')) return false;
        while (*s >= '0' && *s <= '9') s++;
    }
    p->s = s;
    return true;
}
static bool jvalue(jp *p) {
    jws(p);
    if (++p->depth > 64) return false;
    bool ok = false;
    if (*p->s == '{' || *p->s == '[') {
        char close = *p->s == '{' ? '}' : ']';
        bool obj = close == '}';
        p->s++;
        jws(p);
        if (*p->s == close) {
            p->s++;
            ok = true;
        } else {
            for (;;) {
                jws(p);
                if (obj) {
                    if (!jstring(p)) break;
                    jws(p);
                    if (*p->s++ != ':') break;
                }
                if (!jvalue(p)) break;
                jws(p);
                if (*p->s == ',') {
                    p->s++;
                    continue;
                }
                if (*p->s == close) {
                    p->s++;
                    ok = true;
                }
                break;
            }
        }
    } else if (*p->s == '"') {
        ok = jstring(p);
    } else if (!strncmp(p->s, "true", 4) || !strncmp(p->s, "null", 4)) {
        p->s += 4;
        ok = true;
    } else if (!strncmp(p->s, "false", 5)) {
        p->s += 5;
        ok = true;
    } else {
        ok = jnumber(p);
    }
    p->depth--;
    return ok;
}
static bool json_valid(const char *text) {
    jp p = {text, 0};
    if (!jvalue(&p)) return false;
    jws(&p);
    return *p.s == '\0';
}

static void json_checker_rejects_garbage(void **state) {
    (void)state;
    assert_true(json_valid("{\"a\":[1,2.5e3,-0.1,true,null,\"x\\n\"],\"b\":{}}\n"));
    assert_false(json_valid("{\"a\":1,}"));
    assert_false(json_valid("{\"a\":nan}"));
    assert_false(json_valid("{\"a\":1} x"));
    assert_false(json_valid("{\"a\":\"unterminated}"));
}

static void cli_json_emu(void **state) {
    (void)state;
    char *out = NULL;
    int rc = test_run_cmd(SPW_CLI " probe --backend emu --quick --json", &out);
    if (rc != 0) fail_msg("probe --json exited %d:\n%s", rc, out);
    if (!json_valid(out)) fail_msg("probe --json printed invalid JSON:\n%s", out);
    static const char *const keys[] = {
        "\"emulated\":true", "\"backend\":\"emu\"", "\"ok\":true", "\"elapsed_s\":", "\"device\":{",
        "\"total_bytes\":", "\"free_bytes\":", "\"wsl2\":", "\"concurrent_managed_access\":", "\"nvml\":{",
        "\"link\":{", "\"theoretical_gbps_per_direction\":", "\"paths\":{", "\"pinned_h2d\":{",
        "\"pinned_d2h\":{", "\"both_ways\":{", "\"pageable_h2d\":{", "\"pageable_d2h\":{", "\"d2d\":{",
        "\"validated\":true", "\"efficiency\":", "\"latency\":{", "\"dev_alloc_small\":{",
        "\"dev_alloc_large\":{", "\"pinned_alloc\":{", "\"median_us\":", "\"fallback\":{", "\"chunks\":[",
        "\"reference_gbps\":", "\"usable_before_fallback_bytes\":", "\"self_test\":{", "\"verdict\":{",
        "\"recommended_budget_bytes\":", "\"conf\":\"SPILLWAY_CONF=budget=", "\"run\":\"spillway run --budget ",
        "\"summary\":[", "EMULATED", "\"pinned_host\":{\"ran\":true", "\"capped\":true",
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strstr(out, keys[i])) fail_msg("probe --json lacks %s:\n%s", keys[i], out);
    /* --json means no table */
    assert_null(strstr(out, "Transfers ("));
    assert_true(out[0] == '{');
    /* every copy validated (whether an emulated chunk is "fast" depends on the CI machine's
     * load, so chunk classes are not asserted here: the classifier tests above cover them) */
    assert_non_null(strstr(out, "\"class\":\"vram\",\"validated\":true"));
    assert_null(strstr(out, "\"validated\":false"));
#if !defined(TEST_TSAN) && !defined(TEST_ASAN)
    /* the emulated link (0.5 GB/s) is far below host memcpy, so the self-test is flagged: the
     * whole pipeline, classifier included, works end to end (sanitizers slow memcpy too much) */
    assert_non_null(strstr(out, "\"self_test\":{\"ran\":true,\"passed\":true"));
#endif
    free(out);
}

/* test_probe_gpu (test_probe --gpu; label gpu): the real probe's JSON on the GPU, with the figures the probe must reach on the H200:
 * pinned copies within 5% of 55 GB/s each way, both ways within 10% of 99 GB/s, the self-test
 * chunk flagged and no VRAM chunk flagged. */
/* Those bounds on one probe's JSON; NULL when met, else what is off (static text). */
static const char *gpu_figures_off(const char *out, char *why, size_t len) {
    static const struct { const char *key; double lo, hi; } paths[] = {
        {"\"pinned_h2d\":{", 55.0 * 0.95, 55.0 * 1.05},
        {"\"pinned_d2h\":{", 55.0 * 0.95, 55.0 * 1.05},
        {"\"both_ways\":{", 99.0 * 0.90, 99.0 * 1.10},
    };
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        const char *at = strstr(out, paths[i].key);
        const char *g = at ? strstr(at, "\"gbps\":") : NULL;
        double v = g ? strtod(g + 7, NULL) : 0;
        if (v < paths[i].lo || v > paths[i].hi) {
            snprintf(why, len, "%s %.1f GB/s outside [%.1f, %.1f]", paths[i].key, v, paths[i].lo, paths[i].hi);
            return why;
        }
    }
    return NULL;
}

/* test_probe_gpu (test_probe --gpu; label gpu): the real probe's JSON on the GPU, with the figures the probe must reach on the H200:
 * pinned copies within 5% of 55 GB/s each way, both ways within 10% of 99 GB/s, the self-test
 * chunk flagged and no VRAM chunk flagged. Bidirectional PCIe throughput varies from run to
 * run with where the host buffers land (seen: 85 to 102 GB/s on the H200), so a run whose
 * figures are off is repeated once; both runs are reported. */
static void cli_json_gpu(void **state) {
    (void)state;
    char why[2][160] = {"", ""};
    for (int attempt = 0; attempt < 2; attempt++) {
        char *out = NULL;
        int rc = test_run_cmd(SPW_CLI " probe --backend cuda --json 2>/dev/null", &out);
        if (rc != 0) fail_msg("probe --json exited %d:\n%s", rc, out);
        if (!json_valid(out)) fail_msg("probe --json printed invalid JSON:\n%s", out);
        static const char *const keys[] = {"\"emulated\":false", "\"backend\":\"cuda\"", "\"ok\":true",
                                           "\"self_test\":{\"ran\":true,\"passed\":true"};
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
            if (!strstr(out, keys[i])) fail_msg("probe --json lacks %s:\n%s", keys[i], out);
        /* no VRAM chunk flagged */
        assert_null(strstr(out, "\"class\":\"sysmem\",\"validated\":true"));
        const char *off = gpu_figures_off(out, why[attempt], sizeof why[attempt]);
        free(out);
        if (!off) return;
    }
    fail_msg("probe figures off twice: %s; then %s", why[0], why[1]);
}

static void cli_table_emu(void **state) {
    (void)state;
    char *out = NULL;
    int rc = test_run_cmd(SPW_CLI " probe --backend emu --quick 2>/dev/null", &out);
    if (rc != 0) fail_msg("probe exited %d:\n%s", rc, out);
    static const char *const want[] = {"EMULATED", "emu backend", "Device", "Transfers (", "pinned host -> device",
                                       "both ways, 2 streams", "Allocation latency", "Pinned host memory (",
                                       "none refused", "Fallback scan", "self-test",
                                       "Verdict", "SPILLWAY_CONF=budget=", "spillway run --budget", "probe took"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(out, want[i])) fail_msg("probe table lacks '%s':\n%s", want[i], out);
    assert_null(strstr(out, "FAILED"));
    assert_true(out[0] != '{');
    free(out);
}

/* A system that limits pinned memory (WSL2; SPILLWAY_CONF's emu_pin_limit here): the probe
 * reports how much it could pin, the refusal, and a verdict line; it is a finding, not a failure. */
static void cli_pinned_limit_emu(void **state) {
    (void)state;
    char *out = NULL;
    int rc = test_run_cmd("SPILLWAY_CONF=emu_pin_limit=20MiB " SPW_CLI " probe --backend emu --quick --json", &out);
    if (rc != 0) fail_msg("probe --json exited %d:\n%s", rc, out);
    if (!json_valid(out)) fail_msg("probe --json printed invalid JSON:\n%s", out);
    static const char *const keys[] = {"\"ok\":true", "\"pinnable_bytes\":20971520", "\"capped\":false",
                                       "can be page-locked", "PINNED MEMORY LIMITED: the system page-locks only 20 MiB"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strstr(out, keys[i])) fail_msg("probe --json lacks %s:\n%s", keys[i], out);
    free(out);
    rc = test_run_cmd("SPILLWAY_CONF=emu_pin_limit=20MiB " SPW_CLI " probe --backend emu --quick 2>/dev/null", &out);
    if (rc != 0) fail_msg("probe exited %d:\n%s", rc, out);
    if (!strstr(out, "Pinned host memory (") || !strstr(out, "20 MiB held, the next refused"))
        fail_msg("probe table lacks the pinned limit:\n%s", out);
    free(out);
}

static void cli_bad_arguments(void **state) {
    (void)state;
    static const struct {
        const char *args, *msg;
    } cases[] = {
        {"--frobnicate", "unknown argument '--frobnicate'"},
        {"--max-mem abc", "--max-mem"},
        {"--max-mem 0", "--max-mem"},
        {"--max-mem 101%", "--max-mem"},
        {"--max-mem=-5GiB", "--max-mem"},
        {"--device -1", "--device: expected a device index"},
        {"--device two", "--device: expected a device index"},
        {"--device", "--device needs a value"},
        {"--backend gpu", "--backend: expected auto, cuda or emu"},
        {"--backend emu --device 1", "one device"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, SPW_CLI " probe %s 2>&1 >/dev/null", cases[i].args);
        char *out = NULL;
        int rc = test_run_cmd(cmd, &out);
        if (rc != 2) fail_msg("'probe %s' exited %d, want 2:\n%s", cases[i].args, rc, out);
        if (!strstr(out, cases[i].msg)) fail_msg("'probe %s' said:\n%s\nwant it to mention '%s'", cases[i].args, out, cases[i].msg);
        free(out);
    }
    /* --help is not an error */
    char *out = NULL;
    assert_int_equal(test_run_cmd(SPW_CLI " probe --help", &out), 0);
    assert_non_null(strstr(out, "--max-mem"));
    free(out);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--gpu") == 0) {
        if (!test_have_gpu("test_probe_gpu")) return TEST_SKIP_EXIT;
        const struct CMUnitTest gpu[] = {
            cmocka_unit_test(cli_json_gpu),
        };
        return cmocka_run_group_tests(gpu, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(classify_flat_vram),
        cmocka_unit_test(classify_cliff_flags_exactly_after),
        cmocka_unit_test(classify_noisy_vram_no_false_positive),
        cmocka_unit_test(classify_selftest_like_series),
        cmocka_unit_test(classify_invalid_measurements),
        cmocka_unit_test(link_and_budget_arithmetic),
        cmocka_unit_test(json_checker_rejects_garbage),
        cmocka_unit_test(cli_json_emu),
        cmocka_unit_test(cli_table_emu),
        cmocka_unit_test(cli_pinned_limit_emu),
        cmocka_unit_test(cli_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
