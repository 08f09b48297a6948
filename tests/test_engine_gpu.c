/* The offload engine on a real GPU: buffers move between pinned host memory and the device
 * under a budget that holds a third of them, while device-to-device copies (real GPU work,
 * ordered on the caller's stream) rotate their contents. Every byte is checked at the end;
 * the same again with policy=plan over repeating steps. Skipped without a CUDA device. */
#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define MiB ((size_t)1 << 20)
#define N 9
#define BSZ (16 * MiB)

static uint8_t pattern(int tag, size_t k) { return (uint8_t)(tag * 31 + (k * 7) % 251 + 1); }

static spw_ctx *gpu_ctx(const char *conf) {
    if (!spw__backend_cuda_available()) return NULL;
    spw_config *cfg;
    assert_ok(spw_config_create(&cfg));
    assert_ok(spw_config_parse(cfg, "backend=cuda,budget=56MiB"));
    if (conf) assert_ok(spw_config_parse(cfg, conf));
    spw_ctx *ctx;
    assert_ok(spw_ctx_create(cfg, &ctx));
    spw_config_destroy(cfg);
    return ctx;
}

/* buf[i] <- buf[(i+1) % N] for every i, in order, on the GPU: a rotation of the tags. */
static void rotate(spw_ctx *ctx, spw_buf **b, spw_stream s) {
    spw_buf *first_copy; /* buf[0]'s old contents are needed last: keep them in a spare */
    void *src, *dst;
    assert_ok(spw_buf_create(ctx, BSZ, 0, &first_copy));
    assert_ok(spw_acquire(b[0], s, SPW_ACCESS_READ, &src));
    assert_ok(spw_acquire(first_copy, s, SPW_ACCESS_WRITE, &dst));
    assert_int_equal(cudaMemcpyAsync(dst, src, BSZ, cudaMemcpyDeviceToDevice, (cudaStream_t)s), cudaSuccess);
    assert_ok(spw_release(first_copy, s));
    assert_ok(spw_release(b[0], s));
    for (int i = 0; i < N; i++) {
        spw_buf *from = i + 1 < N ? b[i + 1] : first_copy;
        assert_ok(spw_acquire(from, s, SPW_ACCESS_READ, &src));
        assert_ok(spw_acquire(b[i], s, SPW_ACCESS_WRITE, &dst));
        assert_int_equal(cudaMemcpyAsync(dst, src, BSZ, cudaMemcpyDeviceToDevice, (cudaStream_t)s), cudaSuccess);
        assert_ok(spw_release(b[i], s));
        assert_ok(spw_release(from, s));
        spw_stats st;
        assert_ok(spw_stats_get(ctx, &st));
        assert_true((uint64_t)st.held.current <= st.budget);
    }
    assert_ok(spw_buf_destroy(first_copy));
}

static void run(const char *conf, int rounds, bool steps) {
    spw_ctx *ctx = gpu_ctx(conf);
    assert_non_null(ctx);
    spw_stream s;
    assert_ok(spw_stream_create(ctx, &s));
    spw_buf *b[N];
    uint8_t *tmp = malloc(BSZ);
    for (int i = 0; i < N; i++) {
        assert_ok(spw_buf_create(ctx, BSZ, 0, &b[i]));
        for (size_t k = 0; k < BSZ; k++) tmp[k] = pattern(i, k);
        assert_ok(spw_buf_write(b[i], 0, tmp, BSZ));
    }
    for (int r = 0; r < rounds; r++) {
        if (steps) assert_ok(spw_step_begin(ctx));
        rotate(ctx, b, s);
        if (steps) assert_ok(spw_step_end(ctx));
    }
    assert_ok(spw_stream_synchronize(ctx, s));
    for (int i = 0; i < N; i++) {
        int tag = (i + rounds) % N;
        assert_ok(spw_buf_read(b[i], 0, tmp, BSZ));
        for (size_t k = 0; k < BSZ; k++)
            if (tmp[k] != pattern(tag, k)) fail_msg("buffer %d byte %zu: %u, want %u", i, k, tmp[k], pattern(tag, k));
    }
    spw_stats st;
    assert_ok(spw_stats_get(ctx, &st));
    assert_true(st.bytes_h2d.total > 0);
    assert_true(st.evictions_clean.total + st.evictions_dirty.total > 0);
    assert_true((uint64_t)st.held.peak <= st.budget);
    if (steps) assert_true(st.plan_hits.total > 0);
    for (int i = 0; i < N; i++) assert_ok(spw_buf_destroy(b[i]));
    assert_ok(spw_stream_destroy(ctx, s));
    free(tmp);
    spw_ctx_destroy(ctx);
}

static void explicit_lru(void **state) {
    (void)state;
    run("residency=explicit,policy=lru", 3, false);
}

static void explicit_plan(void **state) {
    (void)state;
    run("residency=explicit,policy=plan", 4, true);
}

static void managed_lru(void **state) {
    (void)state;
    run("residency=managed,policy=lru", 2, false);
}

int main(void) {
    if (!test_have_gpu("test_engine_gpu")) return TEST_SKIP_EXIT;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(explicit_lru),
        cmocka_unit_test(explicit_plan),
        cmocka_unit_test(managed_lru),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
