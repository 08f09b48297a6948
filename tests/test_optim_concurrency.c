/* The optimizer pool under concurrent callers (a ThreadSanitizer target): threads stepping
 * their own tensors through one shared pool, the default pool and pools of their own get the
 * bits a single-threaded step gets; pools are created and destroyed while others run; a child
 * of fork() still steps (on its calling thread). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "optim.h"
#include "test_util.h"

enum { CALLERS = 4, N = 200003, STEPS = 6 };

static spw_optim_pool *shared_pool;

typedef struct caller {
    int id;
    float *p, *g, *m, *v;      /* stepped concurrently */
    float *rp, *rm, *rv;       /* stepped alone, on one thread */
    int bad;
} caller;

static void fill(caller *c) {
    c->p = malloc(N * 4), c->g = malloc(N * 4), c->m = calloc(N, 4), c->v = calloc(N, 4);
    c->rp = malloc(N * 4), c->rm = calloc(N, 4), c->rv = calloc(N, 4);
    for (size_t i = 0; i < N; i++) {
        c->p[i] = c->rp[i] = (float)((i * 31 + (size_t)c->id * 7) % 1009) / 1009.0f - 0.5f;
        c->g[i] = (float)((i * 17 + (size_t)c->id) % 997) / 997.0f - 0.5f;
    }
}

static void release(caller *c) {
    free(c->p), free(c->g), free(c->m), free(c->v), free(c->rp), free(c->rm), free(c->rv);
}

static void *caller_main(void *arg) {
    caller *c = arg;
    spw_optim_pool *own = NULL, *alone = NULL;
    if (spw_optim_pool_create(3, &own) != SPW_OK || spw_optim_pool_create(1, &alone) != SPW_OK) {
        c->bad = 1;
        return NULL;
    }
    for (int s = 1; s <= STEPS; s++) {
        spw_adam_hparams hp = {1e-3, 0.9, 0.999, 1e-8, 1e-2, s, 0};
        spw_adam_tensor t = {.param = c->p, .grad = c->g, .exp_avg = c->m, .exp_avg_sq = c->v, .n = N,
                             .grad_dtype = SPW_OPTIM_F32};
        spw_adam_tensor r = {.param = c->rp, .grad = c->g, .exp_avg = c->rm, .exp_avg_sq = c->rv,
                             .n = N, .grad_dtype = SPW_OPTIM_F32};
        spw_optim_pool *pool = s % 3 == 0 ? shared_pool : s % 3 == 1 ? NULL : own;
        if (spw_adamw_step(pool, &hp, &t, 1) != SPW_OK) c->bad = 1;
        if (spw_adamw_step(alone, &hp, &r, 1) != SPW_OK) c->bad = 1;
    }
    spw_optim_pool_destroy(own);
    spw_optim_pool_destroy(alone);
    if (memcmp(c->p, c->rp, N * 4) || memcmp(c->m, c->rm, N * 4) || memcmp(c->v, c->rv, N * 4))
        c->bad = 2;
    return NULL;
}

static void concurrent_callers(void **s) {
    (void)s;
    assert_ok(spw_optim_pool_create(4, &shared_pool));
    caller cs[CALLERS];
    pthread_t tids[CALLERS];
    for (int i = 0; i < CALLERS; i++) {
        memset(&cs[i], 0, sizeof cs[i]);
        cs[i].id = i;
        fill(&cs[i]);
    }
    for (int i = 0; i < CALLERS; i++) assert_int_equal(pthread_create(&tids[i], NULL, caller_main, &cs[i]), 0);
    for (int i = 0; i < CALLERS; i++) pthread_join(tids[i], NULL);
    for (int i = 0; i < CALLERS; i++) {
        if (cs[i].bad) fail_msg("caller %d: %s", i, cs[i].bad == 1 ? "a call failed" : "results differ");
        release(&cs[i]);
    }
    spw_optim_pool_destroy(shared_pool);
}

/* Many short runs back to back: each run's parts are done before the next run starts. */
static void many_small_runs(void **s) {
    (void)s;
    spw_optim_pool *pool;
    assert_ok(spw_optim_pool_create(4, &pool));
    enum { M = 1 << 17 };
    float *p = calloc(M, 4), *g = malloc(M * 4);
    for (size_t i = 0; i < M; i++) g[i] = -1.0f;
    spw_sgd_hparams hp = {1.0, 0.0, 0.0, 0.0, 0};
    spw_sgd_tensor t = {p, g, NULL, M, SPW_OPTIM_F32};
    for (int k = 0; k < 200; k++) assert_ok(spw_sgd_step(pool, &hp, &t, 1));
    for (size_t i = 0; i < M; i++)
        if (p[i] != 200.0f) fail_msg("p[%zu] = %g after 200 steps of +1", i, (double)p[i]);
    spw_optim_pool_destroy(pool);
    free(p);
    free(g);
}

static void step_after_fork(void **s) {
    (void)s;
    spw_optim_pool *pool;
    assert_ok(spw_optim_pool_create(3, &pool));
    enum { M = 1 << 17 };
    float *p = calloc(M, 4), *g = malloc(M * 4);
    for (size_t i = 0; i < M; i++) g[i] = -2.0f;
    spw_sgd_hparams hp = {0.5, 0.0, 0.0, 0.0, 0};
    spw_sgd_tensor t = {p, g, NULL, M, SPW_OPTIM_F32};
    assert_ok(spw_sgd_step(pool, &hp, &t, 1)); /* workers are up */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int ok = spw_sgd_step(pool, &hp, &t, 1) == SPW_OK && p[0] == 2.0f && p[M - 1] == 2.0f;
        spw_optim_pool_destroy(pool);
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    assert_true(p[0] == 1.0f); /* the parent's copy is its own */
    spw_optim_pool_destroy(pool);
    free(p);
    free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(concurrent_callers),
        cmocka_unit_test(many_small_runs),
        cmocka_unit_test(step_after_fork),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
