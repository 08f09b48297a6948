/*
 * spillway run [--budget SIZE | --fraction F] [--report] [--preload PATH] -- CMD [ARGS...]
 *
 * Runs CMD with libspillway-preload.so in LD_PRELOAD, so that every CUDA allocation it makes is
 * charged against the budget and past it fails with CUDA_ERROR_OUT_OF_MEMORY. The command
 * replaces this process (exec), so its exit status is the run's. Exit 2: bad usage; 127: the
 * shim or the command could not be found or started.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#ifdef SPW_HAVE_PRELOAD
#include "ledger.h"
#endif

#define SHIM_NAME "libspillway-preload.so"

static void run_usage(FILE *f) {
    fprintf(f,
            "usage: spillway run [--budget SIZE | --fraction F] [--report] [--preload PATH] -- CMD [ARGS...]\n"
            "\n"
            "Run CMD with its GPU memory capped: every CUDA program sees a device of SIZE and gets\n"
            "CUDA_ERROR_OUT_OF_MEMORY (a clear error, never a silent fallback) past it.\n"
            "\n"
            "  --budget SIZE   bytes with B/KiB/MiB/GiB/TiB (or K/M/G/T), or N%% of the device;\n"
            "                  per device: '0:4GiB;1:8GiB' (an entry without 'DEV:' covers the rest)\n"
            "  --fraction F    the same as --budget with F x 100%%, 0 < F <= 1\n"
            "  --report        print peak charged bytes and refusals per device at exit\n"
            "  --preload PATH  the interposer to load (default: next to this executable)\n"
            "\n"
            "Without --budget or --fraction, SPILLWAY_BUDGET or SPILLWAY_CONF's budget applies; with\n"
            "none of them the run is refused unless --report is given (measure without a cap).\n"
            "Environment set for CMD: LD_PRELOAD, SPILLWAY_BUDGET, SPILLWAY_REPORT.\n");
}

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "spillway run: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see 'spillway run --help')\n");
    return 2;
}

/* The directory of this executable, from /proc/self/exe. */
static int exe_dir(char *buf, size_t len) {
    ssize_t n = readlink("/proc/self/exe", buf, len - 1);
    if (n <= 0) return -1;
    buf[n] = '\0';
    char *slash = strrchr(buf, '/');
    if (!slash) return -1;
    *slash = '\0';
    return 0;
}

/* Find the shim: next to the executable (build tree), else ../lib or ../lib64 (installed). */
static int find_shim(char *out, size_t len) {
    char dir[PATH_MAX];
    if (exe_dir(dir, sizeof dir)) return -1;
    static const char *const rel[] = {"", "/../lib", "/../lib64", "/../lib/x86_64-linux-gnu",
                                      "/../lib/aarch64-linux-gnu"};
    for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++) {
        char cand[PATH_MAX];
        if (snprintf(cand, sizeof cand, "%s%s/%s", dir, rel[i], SHIM_NAME) >= (int)sizeof cand) continue;
        if (access(cand, R_OK) == 0 && realpath(cand, out)) return (void)len, 0;
    }
    return -1;
}

int spw_cmd_run(int argc, char **argv) {
    const char *budget = NULL, *fraction = NULL, *preload = NULL;
    int report = 0, i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) break;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            run_usage(stdout);
            return 0;
        }
        const char **slot = !strcmp(a, "--budget") || !strncmp(a, "--budget=", 9)       ? &budget
                            : !strcmp(a, "--fraction") || !strncmp(a, "--fraction=", 11) ? &fraction
                            : !strcmp(a, "--preload") || !strncmp(a, "--preload=", 10)   ? &preload
                                                                                         : NULL;
        if (slot) {
            const char *eq = strchr(a, '=');
            if (eq) {
                *slot = eq + 1;
            } else {
                if (i + 1 >= argc || !strcmp(argv[i + 1], "--")) return usage_error("%s needs a value", a);
                *slot = argv[++i];
            }
            continue;
        }
        if (!strcmp(a, "--report")) {
            report = 1;
            continue;
        }
        if (a[0] == '-') return usage_error("unknown option '%s'", a);
        return usage_error("expected '--' before the command (got '%s'): spillway run [OPTIONS] -- CMD [ARGS...]",
                           a);
    }
    if (i >= argc) return usage_error("missing '--' and the command to run%s", "");
    if (i + 1 >= argc) return usage_error("missing the command after '--'%s", "");
    char **cmd = argv + i + 1;

    if (budget && fraction) return usage_error("--budget and --fraction are exclusive; give one%s", "");
    char frac_budget[64];
    if (fraction) {
        char *end = NULL;
        errno = 0;
        double fr = strtod(fraction, &end);
        if (!*fraction || *end || errno || !(fr > 0.0) || fr > 1.0)
            return usage_error("bad --fraction '%s': must be a number in (0, 1]", fraction);
        snprintf(frac_budget, sizeof frac_budget, "%.6g%%", fr * 100.0);
        budget = frac_budget;
    }
#ifdef SPW_HAVE_PRELOAD
    if (budget) {
        spwp_config cfg;
        char err[512];
        if (spwp_parse_budget(budget, &cfg, err, sizeof err)) return usage_error("--budget: %s", err);
    }
#endif
    if (!budget && !report && !getenv("SPILLWAY_BUDGET") &&
        !(getenv("SPILLWAY_CONF") && strstr(getenv("SPILLWAY_CONF"), "budget=")))
        return usage_error("no budget: give --budget SIZE or --fraction F (or --report to measure "
                           "without a cap)%s", "");

    char shim[PATH_MAX];
    if (preload) {
        if (access(preload, R_OK) != 0 || !realpath(preload, shim)) {
            fprintf(stderr, "spillway run: --preload '%s': %s\n", preload, strerror(errno));
            return 127;
        }
    } else if (find_shim(shim, sizeof shim)) {
        fprintf(stderr,
                "spillway run: cannot find %s next to this executable (or in ../lib); build it, or "
                "pass --preload PATH\n",
                SHIM_NAME);
        return 127;
    }
    /* LD_PRELOAD splits on spaces and colons: such a path cannot be preloaded. */
    if (strpbrk(shim, " :")) {
        fprintf(stderr, "spillway run: the interposer's path '%s' contains a space or ':', which LD_PRELOAD "
                        "cannot carry; move it or pass --preload\n", shim);
        return 127;
    }

    const char *old = getenv("LD_PRELOAD");
    size_t len = strlen(shim) + (old ? strlen(old) : 0) + 2;
    char *ld = malloc(len);
    if (!ld) {
        fprintf(stderr, "spillway run: out of host memory\n");
        return 127;
    }
    snprintf(ld, len, "%s%s%s", shim, old && *old ? ":" : "", old && *old ? old : "");
    /* exec keeps the pid: the interposer knows the command from its children by it (its report) */
    char pid[24];
    snprintf(pid, sizeof pid, "%ld", (long)getpid());
    if (setenv("LD_PRELOAD", ld, 1) || (budget && setenv("SPILLWAY_BUDGET", budget, 1)) ||
        (report && setenv("SPILLWAY_REPORT", "1", 1)) || setenv("SPILLWAY_RUN_PID", pid, 1)) {
        fprintf(stderr, "spillway run: cannot set the environment: %s\n", strerror(errno));
        free(ld);
        return 127;
    }
    free(ld);
    fflush(NULL);
    execvp(cmd[0], cmd);
    fprintf(stderr, "spillway run: cannot run '%s': %s\n", cmd[0], strerror(errno));
    return 127;
}
