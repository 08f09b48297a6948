/* `spillway run`: argument checking, the environment it sets, exit statuses passed through, and
 * (with the fake driver) the report at exit. Runs the real CLI through the shell. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "test_util.h"

/* Run `SPW_CLI run ARGS` through sh with stderr merged; returns the exit status, output in out. */
static int run(const char *args, char *out, size_t len) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s run %s 2>&1", SPW_CLI, args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, len - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

#define EXPECT(args, status, text)                                                             \
    do {                                                                                       \
        char out_[8192];                                                                       \
        int st_ = run(args, out_, sizeof out_);                                                \
        if (st_ != (status) || !strstr(out_, text))                                            \
            fail_msg("spillway run %s: exit %d (want %d), output:\n%s(want '%s')", args, st_,  \
                     status, out_, text);                                                      \
    } while (0)

static void usage_errors(void **state) {
    (void)state;
    EXPECT("--budget 1XB -- true", 2, "bad size '1XB'");
    EXPECT("--budget lots -- true", 2, "bad size 'lots'");
    EXPECT("--budget 0 -- true", 2, "at least 1 byte");
    EXPECT("--budget '0:1GiB;0:2GiB' -- true", 2, "given twice");
    EXPECT("--budget 1GiB", 2, "missing '--'");
    EXPECT("--budget 1GiB --", 2, "missing the command");
    EXPECT("--budget 1GiB true", 2, "expected '--'");
    EXPECT("--bogus -- true", 2, "unknown option '--bogus'");
    EXPECT("--budget", 2, "--budget needs a value");
    EXPECT("--budget 1GiB --fraction 0.5 -- true", 2, "exclusive");
    EXPECT("--fraction 0 -- true", 2, "(0, 1]");
    EXPECT("--fraction 1.5 -- true", 2, "(0, 1]");
    EXPECT("--fraction half -- true", 2, "bad --fraction 'half'");
    EXPECT("-- true", 2, "no budget");
    EXPECT("--help", 0, "usage: spillway run");
}

#ifdef SPWP_HAVE_SHIM
static void exit_status_passes_through(void **state) {
    (void)state;
    EXPECT("--budget 1GiB -- true", 0, "");
    EXPECT("--budget 1GiB -- false", 1, "");
    EXPECT("--budget=1GiB -- sh -c 'exit 7'", 7, "");
    EXPECT("--budget 1GiB -- /nonexistent/program", 127, "cannot run '/nonexistent/program'");
    EXPECT("--budget 1GiB --preload /nonexistent.so -- true", 127, "--preload '/nonexistent.so'");
    /* without --report the shim does nothing visible in a program that never touches CUDA */
    char out[4096];
    assert_int_equal(run("--budget 1GiB -- true", out, sizeof out), 0);
    assert_string_equal(out, "");
}

/* --report reports for the command even when it allocated nothing; the command's children that
 * allocated nothing stay quiet (one line, not one per process). The parent here is perl (Debian's
 * perl-base is essential): a shell ends with _exit and coreutils close stderr at exit, so neither
 * can print anything at exit. */
static void report_without_allocations(void **state) {
    (void)state;
    char out[4096];
    assert_int_equal(run("--report -- true", out, sizeof out), 0);
    assert_string_equal(out, "spillway: true: no device memory was allocated\n");
    assert_int_equal(run("--budget 1GiB --report -- perl -e 'system(\"/bin/true\") == 0 && "
                         "system(\"/bin/true\") == 0 or exit 1; print \"done\\n\"'", out, sizeof out), 0);
    const char *line = "no device memory was allocated\n";
    const char *first = strstr(out, line);
    if (!first || strstr(first + 1, line) || !strstr(out, "done\n")) fail_msg("want one report line, got:\n%s", out);
}

static void environment_for_the_command(void **state) {
    (void)state;
    EXPECT("--budget '0:4GiB;1:50%' -- sh -c 'echo \"[$SPILLWAY_BUDGET]\"'", 0, "[0:4GiB;1:50%]");
    EXPECT("--fraction 0.25 -- sh -c 'echo \"[$SPILLWAY_BUDGET]\"'", 0, "[25%]");
    EXPECT("--report --budget 1GiB -- sh -c 'echo \"[$SPILLWAY_REPORT]\"'", 0, "[1]");
    EXPECT("--budget 1GiB -- sh -c 'echo \"[$LD_PRELOAD]\"'", 0, "libspillway-preload.so]");
    /* an existing LD_PRELOAD is kept, after the shim */
    char args[512];
    snprintf(args, sizeof args, "--budget 1GiB -- sh -c 'echo \"[$LD_PRELOAD]\"'");
    char cmd[1024], out[4096];
    /* (the CLI itself then runs with it too: tell a sanitizer runtime not to mind) */
    snprintf(cmd, sizeof cmd, "ASAN_OPTIONS=verify_asan_link_order=0 LD_PRELOAD=libm.so.6 %s run %s 2>&1", SPW_CLI,
             args);
    FILE *p = popen(cmd, "r");
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    pclose(p);
    if (!strstr(out, "libspillway-preload.so:libm.so.6]")) fail_msg("got %s", out);
}
#endif

#ifdef SPWP_FAKE_CLIENT
static void report_at_exit(void **state) {
    (void)state;
    char args[2048];
    snprintf(args, sizeof args, "--budget 4GiB --report -- env LD_LIBRARY_PATH=%s %s 4294967296", SPWP_FAKE_DIR,
             SPWP_FAKE_CLIENT);
    EXPECT(args, 0, "device 0: budget 4294967296 B, peak charged 4294967296 B");
    EXPECT(args, 0, "refused");
    /* a bad budget reaching the shim directly is said, and nothing is capped */
    char cmd[2048], out[8192];
    snprintf(cmd, sizeof cmd,
             "LD_PRELOAD=%s/../../libspillway-preload.so LD_LIBRARY_PATH=%s SPILLWAY_BUDGET=lots %s 4294967296 2>&1",
             SPWP_FAKE_DIR, SPWP_FAKE_DIR, SPWP_FAKE_CLIENT);
    FILE *p = popen(cmd, "r");
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = '\0';
    pclose(p);
    if (!strstr(out, "SPILLWAY_BUDGET: bad budget 'lots'") || !strstr(out, "NOT capped")) fail_msg("got %s", out);
}
#endif

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(usage_errors),
#ifdef SPWP_HAVE_SHIM
        cmocka_unit_test(exit_status_passes_through),
        cmocka_unit_test(environment_for_the_command),
        cmocka_unit_test(report_without_allocations),
#endif
#ifdef SPWP_FAKE_CLIENT
        cmocka_unit_test(report_at_exit),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
