#include "test_util.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <string.h>
#include <unistd.h>

int test_on_emu(void) {
    const char *b = getenv("SPW_TEST_BACKEND");
    return !b || strcmp(b, "cuda") != 0;
}

void test_require_data(const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", SPW_TEST_DATA_DIR, name);
    if (access(path, R_OK) == 0) return;
    fail_msg("test data %s is not readable: %s", path, strerror(errno));
}

int test_have_gpu(const char *name) {
    if (spw__backend_cuda_available()) return 1;
    printf("%s: GPU-only test, no usable CUDA device here: skipped\n", name);
    return 0;
}

spw_ctx *test_ctx(const char *conf) {
    spw_config *cfg = NULL;
    assert_ok(spw_config_create(&cfg));
    assert_ok(spw_config_set(cfg, "backend", test_on_emu() ? "emu" : "cuda"));
    if (conf) assert_ok(spw_config_parse(cfg, conf));
    spw_ctx *ctx = NULL;
    assert_ok(spw_ctx_create(cfg, &ctx));
    spw_config_destroy(cfg);
    return ctx;
}

int test_run_cmd(const char *cmd, char **out) {
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    size_t n;
    while ((n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
        len += n;
        if (cap - len < 4096) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
    }
    buf[len] = '\0';
    int st = pclose(p);
    if (out) *out = buf;
    else free(buf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

spw_stats test_stats(spw_ctx *ctx) {
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    return st;
}

char *test_summary(spw_ctx *ctx, int json) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    assert_ok(json ? spw_summary_json(ctx, f) : spw_summary(ctx, f));
    fclose(f);
    return text;
}

static void wait_gate(_Atomic int *gate) {
    while (gate && !atomic_load(gate)) usleep(200);
}

void test_kfill_cb(void *arg) {
    test_kfill *k = arg;
    wait_gate(k->gate);
    memset(k->p, k->v, k->n);
}

void test_kcheck_cb(void *arg) {
    test_kcheck *k = arg;
    wait_gate(k->gate);
    for (size_t i = 0; i < k->n; i++)
        if (k->p[i] != k->v) {
            atomic_store(k->bad, 1);
            return;
        }
}

void test_checked_read(spw_ctx *ctx, spw_buf *b, uint8_t v, test_kcheck *k, _Atomic int *bad) {
    void *d;
    assert_ok(spw_acquire(b, NULL, SPW_ACCESS_READ, &d));
    *k = (test_kcheck){d, spw_buf_size(b), v, NULL, bad};
    assert_ok(spw_launch_host(ctx, NULL, test_kcheck_cb, k));
    assert_ok(spw_release(b, NULL));
}

void test_fill_buf(spw_buf *b, uint8_t v) {
    size_t n = spw_buf_size(b);
    uint8_t *tmp = malloc(n);
    assert_non_null(tmp);
    memset(tmp, v, n);
    assert_ok(spw_buf_write(b, 0, tmp, n));
    free(tmp);
}
