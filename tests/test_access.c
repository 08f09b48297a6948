/* Access traces (access.c) and the offline models (oracle.c). No engine needed. */
#include "test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MiB ((uint64_t)1 << 20)

/* Write text to a fresh temporary file; returns its path (static buffer, one at a time). */
static const char *tmp_trace(const char *text) {
    static char path[64];
    snprintf(path, sizeof path, "/tmp/spw_access_XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

static void load_text(const char *text, spw_access_trace *t) {
    const char *p = tmp_trace(text);
    spw_status st = spw__access_load(p, t);
    unlink(p);
    assert_ok(st);
}

static void test_valid(void **state) {
    (void)state;
    spw_access_trace t;
    load_text("# header comment\n"
              "b 7 1048576 ro\n"
              "b 9 4096 rw   # trailing comment\n"
              "a 7:r 9:w\n" /* before the first s: implicit step 0 */
              "\n"
              "s\n"
              "a 7:r 9:rw\n"
              "f 9\n"
              "b 9 8192 rw\n" /* a destroyed id may be created again: a new buffer */
              "s\n"
              "a 9:w\n",
              &t);
    assert_int_equal(t.nbufs, 3);
    assert_int_equal(t.nsteps, 3);
    assert_true(t.implicit_first_step);
    assert_int_equal(t.nitems, 5);
    assert_int_equal(t.total_bytes, 1048576 + 4096 + 8192);
    assert_int_equal(t.peak_live_bytes, 1048576 + 8192);
    assert_true(t.bufs[0].read_only);
    assert_false(t.bufs[1].read_only);
    assert_int_equal(t.bufs[2].id, 9);
    assert_int_equal(t.bufs[2].line, 9);
    /* ops: b b a s a f b s a */
    assert_int_equal(t.nops, 9);
    assert_int_equal(t.ops[2].kind, 'a');
    assert_int_equal(t.ops[2].step, 0);
    assert_int_equal(t.ops[2].line, 4);
    assert_int_equal(t.ops[4].step, 1);
    assert_int_equal(t.items[3].mode, SPW_ACCESS_READ_WRITE);
    assert_int_equal(t.items[1].mode, SPW_ACCESS_WRITE);
    assert_int_equal(t.ops[8].step, 2);
    assert_int_equal(t.items[t.ops[8].first].buf, 2);
    spw__access_scale(&t, 1024);
    assert_int_equal(t.bufs[0].bytes, 1024);
    assert_int_equal(t.bufs[1].bytes, 4);
    assert_int_equal(t.peak_live_bytes, 1024 + 8);
    spw__access_free(&t);
}

typedef struct bad_case {
    const char *text;
    int line;
    const char *needle;
} bad_case;

static const bad_case bad_cases[] = {
    {"b 0 64 ro\ns\na 1:r\n", 3, "unknown buffer id 1"},
    {"b 0 64 ro\nb 0 64 rw\n", 2, "duplicate buffer id 0"},
    {"b 0 64 rw\ns\na 0:x\n", 3, "bad mode 'x'"},
    {"b 0 64 rw\ns\na 0:rr\n", 3, "bad mode"},
    {"b 0 64 ro\ns\na 0:w\n", 3, "write (w) to read-only buffer 0"},
    {"b 0 64 ro\ns\na 0:rw\n", 3, "read-only"},
    {"b 0 0 rw\n", 1, "bytes 0"},
    {"b 0 64 xx\n", 1, "bad kind 'xx'"},
    {"b 0 64\n", 1, "missing <ro|rw>"},
    {"b 0 -5 rw\n", 1, "not a number"},
    {"b 0 99999999999999999999999 rw\n", 1, "out of range"},
    {"x 1\n", 1, "unknown record 'x'"},
    {"b 0 64 rw\ns\na 0\n", 3, "missing ':<mode>'"},
    {"b 0 64 rw\ns\na 0:r 0:w\n", 3, "listed twice"},
    {"b 0 64 rw\ns\na\n", 3, "lists no buffer"},
    {"s extra\n", 1, "trailing garbage"},
    {"b 0 64 rw extra\n", 1, "trailing garbage"},
    {"f 3\n", 1, "unknown buffer id 3"},
    {"b 0 64 rw\nf 0\nf 0\n", 3, "unknown buffer id 0"},
    {"b 0 64 rw\nf 0\ns\na 0:r\n", 4, "unknown buffer id 0"},
};

static void test_malformed(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case *c = &bad_cases[i];
        const char *p = tmp_trace(c->text);
        spw_access_trace t = {0};
        spw_status st = spw__access_load(p, &t);
        unlink(p);
        if (st != SPW_ERR_PARSE) fail_msg("case %zu: %s (want SPW_ERR_PARSE)", i, spw_status_str(st));
        char want[256];
        snprintf(want, sizeof want, "%s: line %d: ", p, c->line);
        const char *msg = spw_last_error();
        if (strncmp(msg, want, strlen(want)) != 0 || !strstr(msg, c->needle))
            fail_msg("case %zu: message '%s' lacks '%s' or '%s'", i, msg, want, c->needle);
        assert_null(t.ops); /* all or nothing */
    }
}

static void test_missing_file(void **state) {
    (void)state;
    spw_access_trace t;
    assert_status(spw__access_load("/nonexistent/x.access", &t), SPW_ERR_IO);
    assert_non_null(strstr(spw_last_error(), "/nonexistent/x.access"));
    assert_status(spw__access_load(NULL, &t), SPW_ERR_INVALID_ARGUMENT);
}

/* Run a model and compare per-step bytes (in MiB) with the hand-computed ones. */
static void expect_model(const spw_access_trace *t, uint64_t budget, spw_model_kind kind,
                         const uint64_t *h2d_mib, const uint64_t *d2h_mib) {
    spw_model_result r;
    assert_ok(spw__model_run(t, budget, kind, &r));
    assert_int_equal(r.nsteps, t->nsteps);
    for (size_t s = 0; s < r.nsteps; s++) {
        if (r.h2d[s] != h2d_mib[s] * MiB || r.d2h[s] != d2h_mib[s] * MiB)
            fail_msg("model %d step %zu: h2d %llu d2h %llu MiB, want %llu %llu", (int)kind, s,
                     (unsigned long long)(r.h2d[s] / MiB), (unsigned long long)(r.d2h[s] / MiB),
                     (unsigned long long)h2d_mib[s], (unsigned long long)d2h_mib[s]);
    }
    spw__model_free(&r);
}

/* 3 read-only buffers of 1 MiB read in a cycle, budget 2 MiB, 4 steps.
 * LRU: the buffer evicted is always the next one needed: 3 MiB every step.
 * Oracle, by hand (the resident buffer whose next use is farthest goes):
 *   step 0: load 0, 1; at 2 evict 1 (next: step 1 op 1; 0's is step 1 op 0); load 2: 3 MiB
 *   step 1: 0 hit; at 1 evict 0 (next: step 2; 2's is this step), load 1; 2 hit: 1 MiB
 *   step 2: at 0 evict 2 (next: op 2; 1's is op 1), load 0; 1 hit; at 2 evict 1 (next: step 3
 *           op 1; 0's is step 3 op 0), load 2: 2 MiB
 *   step 3: 0 hit; at 1 evict 0 (never used again), load 1; 2 hit: 1 MiB */
static void test_models_cyclic(void **state) {
    (void)state;
    spw_access_trace t;
    load_text("b 0 1048576 ro\nb 1 1048576 ro\nb 2 1048576 ro\n"
              "s\na 0:r\na 1:r\na 2:r\ns\na 0:r\na 1:r\na 2:r\n"
              "s\na 0:r\na 1:r\na 2:r\ns\na 0:r\na 1:r\na 2:r\n",
              &t);
    const uint64_t zero[4] = {0};
    expect_model(&t, 2 * MiB, SPW_MODEL_LRU, (const uint64_t[]){3, 3, 3, 3}, zero);
    expect_model(&t, 2 * MiB, SPW_MODEL_ORACLE, (const uint64_t[]){3, 1, 2, 1}, zero);
    expect_model(&t, 3 * MiB, SPW_MODEL_LRU, (const uint64_t[]){3, 0, 0, 0}, zero);
    expect_model(&t, 3 * MiB, SPW_MODEL_ORACLE, (const uint64_t[]){3, 0, 0, 0}, zero);
    spw_model_result r;
    assert_status(spw__model_run(&t, MiB - 1, SPW_MODEL_ORACLE, &r), SPW_ERR_OUT_OF_MEMORY);
    assert_non_null(strstr(spw_last_error(), "line 5"));
    spw__access_free(&t);
}

/* Write-backs. Two rw buffers of 1 MiB, budget 1 MiB, one step:
 *   a 0:w; a 1:w; a 0:w; a 1:r
 * Oracle: a1:w evicts 0 (next access w: drop); a0:w evicts 1 (next access r: write back 1);
 *   a1:r evicts 0 (never used again: drop) and loads 1: h2d 1, d2h 1.
 * LRU: every eviction of a dirty buffer writes it back: 3 write-backs, h2d 1. */
static void test_models_writeback(void **state) {
    (void)state;
    spw_access_trace t;
    load_text("b 0 1048576 rw\nb 1 1048576 rw\ns\na 0:w\na 1:w\na 0:w\na 1:r\n", &t);
    expect_model(&t, MiB, SPW_MODEL_ORACLE, (const uint64_t[]){1}, (const uint64_t[]){1});
    expect_model(&t, MiB, SPW_MODEL_LRU, (const uint64_t[]){1}, (const uint64_t[]){3});
    spw__access_free(&t);
    /* Acquired together: at "a 0:r 2:w" 0 is protected, so 1 goes (clean: dropped). At "a 1:r"
     * 0 and 2 were last used together, 0 listed first: LRU evicts 0 (clean); the oracle too
     * (neither is used again: the lower number goes). No write-back either way. */
    load_text("b 0 1048576 ro\nb 1 1048576 ro\nb 2 1048576 rw\n"
              "s\na 0:r 1:r\na 0:r 2:w\na 1:r\n", &t);
    expect_model(&t, 2 * MiB, SPW_MODEL_ORACLE, (const uint64_t[]){3}, (const uint64_t[]){0});
    expect_model(&t, 2 * MiB, SPW_MODEL_LRU, (const uint64_t[]){3}, (const uint64_t[]){0});
    spw__access_free(&t);
}

/* The end of the trace: two rw buffers, budget 1 MiB, two steps of "a 0:rw; a 1:rw".
 * Step 0 (all models): load 0; at 1 evict 0 (dirty, read next: write back); load 1: h2d 2, d2h 1.
 * Step 1: at 0 evict 1 (dirty, read next in this step: write back); at 1 evict 0: the oracle
 * drops it (no next use): d2h 1; oracle_repeat sees the step repeated after the end (0 is read
 * next): d2h 2, like LRU, which writes back every dirty eviction. */
static void test_models_end_of_trace(void **state) {
    (void)state;
    spw_access_trace t;
    load_text("b 0 1048576 rw\nb 1 1048576 rw\ns\na 0:rw\na 1:rw\ns\na 0:rw\na 1:rw\n", &t);
    expect_model(&t, MiB, SPW_MODEL_ORACLE, (const uint64_t[]){2, 2}, (const uint64_t[]){1, 1});
    expect_model(&t, MiB, SPW_MODEL_ORACLE_REPEAT, (const uint64_t[]){2, 2}, (const uint64_t[]){1, 2});
    expect_model(&t, MiB, SPW_MODEL_LRU, (const uint64_t[]){2, 2}, (const uint64_t[]){1, 2});
    spw__access_free(&t);
}

/* The shared trace: the README says the oracle moves about 2.1 GiB a step at 2 GiB and LRU 4 GiB.
 * Exactly: 4 MiB of activation stays, 31 of 64 layers fit beside it, 33 are loaded a step. */
static void test_models_cyclic64(void **state) {
    (void)state;
    spw_access_trace t;
    test_require_data("cyclic64.access");
    assert_ok(spw__access_load(SPW_TEST_DATA_DIR "/cyclic64.access", &t));
    assert_int_equal(t.nbufs, 65);
    spw_model_result o, l;
    assert_ok(spw__model_run(&t, 2 * SPW_GiB, SPW_MODEL_ORACLE, &o));
    assert_ok(spw__model_run(&t, 2 * SPW_GiB, SPW_MODEL_LRU, &l));
    assert_true(o.nsteps >= 2);
    assert_int_equal(o.h2d[0], 64 * 64 * MiB + 4 * MiB);
    for (size_t s = 1; s < o.nsteps; s++) {
        assert_int_equal(o.h2d[s], 33 * 64 * MiB);
        assert_int_equal(l.h2d[s], 64 * 64 * MiB);
        assert_int_equal(o.d2h[s] + l.d2h[s], 0);
    }
    assert_int_equal(spw__model_moved_from(&o, 1), (o.nsteps - 1) * 33 * 64 * MiB);
    spw__model_free(&o);
    spw__model_free(&l);
    spw__access_free(&t);
}

/* On train16 the oracle never moves more than LRU, at 35, 50 and 75% of the footprint. */
static void test_models_train16(void **state) {
    (void)state;
    spw_access_trace t;
    test_require_data("train16.access");
    assert_ok(spw__access_load(SPW_TEST_DATA_DIR "/train16.access", &t));
    const double fr[3] = {0.35, 0.50, 0.75};
    for (int i = 0; i < 3; i++) {
        uint64_t budget = (uint64_t)((double)t.total_bytes * fr[i]);
        spw_model_result o, rep, l;
        assert_ok(spw__model_run(&t, budget, SPW_MODEL_ORACLE, &o));
        assert_ok(spw__model_run(&t, budget, SPW_MODEL_ORACLE_REPEAT, &rep));
        assert_ok(spw__model_run(&t, budget, SPW_MODEL_LRU, &l));
        assert_true(spw__model_moved_from(&o, 1) <= spw__model_moved_from(&rep, 1));
        assert_true(spw__model_moved_from(&rep, 1) < spw__model_moved_from(&l, 1));
        spw__model_free(&o);
        spw__model_free(&rep);
        spw__model_free(&l);
    }
    spw__access_free(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_models_cyclic),
        cmocka_unit_test(test_models_writeback),
        cmocka_unit_test(test_models_end_of_trace),
        cmocka_unit_test(test_models_cyclic64),
        cmocka_unit_test(test_models_train16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
