/* Shared helpers for the cmocka tests. */
#ifndef SPW_TEST_UTIL_H
#define SPW_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka.h needs the above first */
#include <cmocka.h>

#include "access.h"
#include "arena.h"
#include "backend.h"
#include "ctx.h"
#include "internal.h"
#include "options.h"
#include "oracle.h"
#include "stats.h"
#include "trace.h"

/* The sanitizer the test program is built with (gcc defines __SANITIZE_*__, clang answers
 * __has_feature): TEST_ASAN, TEST_TSAN. Tests of the host's own time or of glibc's allocator
 * leave out what the sanitizer's instrumentation or allocator changes. */
#if defined(__SANITIZE_ADDRESS__)
#define TEST_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define TEST_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(TEST_ASAN)
#define TEST_ASAN 1
#endif
#if __has_feature(thread_sanitizer) && !defined(TEST_TSAN)
#define TEST_TSAN 1
#endif
#endif

/* Context on the backend named by SPW_TEST_BACKEND (emu unless set to cuda), with `conf`
 * ("key=value,...", may be NULL) applied on top. Fails the test on error. */
spw_ctx *test_ctx(const char *conf);
/* 1 when tests run against emu (fault injection and exact-capacity tests need it). */
int test_on_emu(void);
/* Skip the current test unless on emu. */
#define TEST_REQUIRE_EMU()                                                                     \
    do {                                                                                       \
        if (!test_on_emu()) skip();                                                            \
    } while (0)
/* The exit status of a test program that needs a CUDA device and finds none: ctest reports the
 * test as skipped (SKIP_RETURN_CODE of the tests labelled gpu, tests/CMakeLists.txt). */
#define TEST_SKIP_EXIT 77
/* In main() of a GPU-only test program: 1 when a CUDA device is usable; else it prints that the
 * program `name` is skipped and returns 0 (main then returns TEST_SKIP_EXIT). */
int test_have_gpu(const char *name);
/* Fail the current test, naming the path, unless the test data file `name` (in tests/data) is
 * readable: a missing input is a failure, not a skip. */
void test_require_data(const char *name);
/* assert a status, printing spw_last_error() on mismatch */
#define assert_status(expr, want)                                                              \
    do {                                                                                       \
        spw_status st_ = (expr);                                                               \
        if (st_ != (want))                                                                     \
            fail_msg("%s returned %s (want %s): %s", #expr, spw_status_str(st_),             \
                     spw_status_str(want), spw_last_error());                                  \
    } while (0)
#define assert_ok(expr) assert_status(expr, SPW_OK)

/* Run a shell command; returns its exit status (-1 if it did not exit normally). *out (when
 * out is not NULL) receives its stdout, malloc'd; stderr is captured only if cmd redirects it. */
int test_run_cmd(const char *cmd, char **out);

/* The context's statistics (spw_stats_get); fails the test on error. */
spw_stats test_stats(spw_ctx *ctx);
/* The context's summary as text: the table (spw_summary), or with `json` the JSON object
 * (spw_summary_json). malloc'd; fails the test on error. */
char *test_summary(spw_ctx *ctx, int json);

/* A host function (spw_launch_host) that checks n bytes at p all read v, setting *bad where one
 * does not; with `gate` set it first waits until *gate is nonzero (a use still running). */
typedef struct test_kcheck {
    const uint8_t *p;
    size_t n;
    uint8_t v;
    _Atomic int *gate;
    _Atomic int *bad;
} test_kcheck;
void test_kcheck_cb(void *arg);
/* A host function that fills n bytes at p with v; with `gate` set it first waits until *gate is
 * nonzero (a write still running). */
typedef struct test_kfill {
    uint8_t *p;
    size_t n;
    uint8_t v;
    _Atomic int *gate;
} test_kfill;
void test_kfill_cb(void *arg);
/* Fill buffer b's contents with v (spw_buf_write). */
void test_fill_buf(spw_buf *b, uint8_t v);
/* Acquire b for reading on the default stream, check there (test_kcheck_cb, through *k, which
 * must live until the stream ran it) that every byte of it reads v, release it. */
void test_checked_read(spw_ctx *ctx, spw_buf *b, uint8_t v, test_kcheck *k, _Atomic int *bad);

/* xorshift PRNG, deterministic per seed */
static inline uint64_t test_rand(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

#endif
