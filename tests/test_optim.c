/* The host optimizer step against a scalar reference written here from torch's op sequence:
 * every instruction set, thread count, list layout and gradient type gives the reference's
 * bits; bad input is refused with a message and leaves every array as it was. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "optim.h"
#include "test_util.h"

#define assert_msg_has(text)                                                                   \
    do {                                                                                       \
        if (!strstr(spw_last_error(), text))                                                   \
            fail_msg("message lacks '%s': %s", text, spw_last_error());                       \
    } while (0)

static const char *const isas[] = {"generic", "avx2", "avx512"};

/* ---- data ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}
/* Roughly normal values over several decades, with zeros and subnormal-sized ones mixed in. */
static float rndf(void) {
    uint32_t r = rnd();
    if (r % 97 == 0) return 0.0f;
    float u = (float)((r >> 8) & 0xffff) / 65536.0f - 0.5f;
    return ldexpf(u, (int)(r % 24) - 12);
}

static float *fvec(size_t n, int fill) {
    float *a = malloc((n ? n : 1) * sizeof *a);
    assert_non_null(a);
    for (size_t i = 0; i < n; i++) a[i] = fill ? rndf() : 0.0f;
    return a;
}

static float *fdup(const float *a, size_t n) {
    float *b = malloc((n ? n : 1) * sizeof *b);
    assert_non_null(b);
    if (n) memcpy(b, a, n * sizeof *b);
    return b;
}

static uint16_t to_bf16(float f) { /* truncation: any bf16 will do as input */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static float ref_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float ref_f16(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0)
        v = ldexpf((float)m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexpf((float)(m | 1024), e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t to_f16(float f) { /* any half near f (finite inputs within range) */
    float a = fabsf(f);
    uint16_t s = f < 0 ? 0x8000 : 0;
    if (a < 0x1p-24f) return s;
    if (a >= 65504.0f) return s | 0x7bff;
    int e;
    float fr = frexpf(a, &e); /* a = fr * 2^e, fr in [0.5, 1) */
    if (e - 1 < -14) return s | (uint16_t)(a * 0x1p24f);
    return s | (uint16_t)(((e - 1 + 15) << 10) | ((uint16_t)(fr * 2048.0f) & 1023));
}

/* ---- the reference: torch's single-tensor ops, one element at a time ---- */

static void ref_adam(int decoupled, const spw_adam_hparams *hp, float *p, const float *g, float *m,
                     float *v, float *vmax, size_t n) {
    const double lr = hp->lr, wd = hp->weight_decay, b1 = hp->beta1, b2 = hp->beta2;
    const double bc1 = 1.0 - pow(b1, (double)hp->step), bc2 = 1.0 - pow(b2, (double)hp->step);
    const float step_size = (float)(-(lr / bc1)), bc2s = (float)sqrt(bc2);
    const float w = (float)(1.0 - b1);
    for (size_t i = 0; i < n; i++) {
        float gi = (hp->flags & SPW_ADAM_MAXIMIZE) ? -g[i] : g[i];                 /* -grads[i] */
        if (decoupled) p[i] = p[i] * (float)(1.0 - lr * wd);                      /* param.mul_ */
        else if (wd != 0.0) gi = fmaf(p[i], (float)wd, gi);                       /* grad.add(param, alpha) */
        if (hp->flags & SPW_ADAM_MOMENT_MUL_ADD)
            m[i] = fmaf(gi, (float)(1.0 - b1), m[i] * (float)b1);                 /* mul_(b1).add_(g, alpha) */
        else if (fabsf(w) < 0.5f)
            m[i] = fmaf(w, gi - m[i], m[i]);                                      /* lerp_(g, w) */
        else
            m[i] = fmaf(w - 1.0f, gi - m[i], gi);
        v[i] = fmaf((float)(1.0 - b2) * gi, gi, v[i] * (float)b2);                /* mul_(b2).addcmul_ */
        float s = v[i];
        if (vmax) {
            s = (isnan(vmax[i]) || isnan(v[i])) ? NAN : (vmax[i] > v[i] ? vmax[i] : v[i]);
            vmax[i] = s;
        }
        float den = sqrtf(s) / bc2s + (float)hp->eps;                             /* (sqrt / bc2s).add_(eps) */
        p[i] = p[i] + (step_size * m[i]) / den;                                   /* addcdiv_ */
    }
}

static void ref_sgd(const spw_sgd_hparams *hp, float *p, const float *g, float *buf, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float gi = (hp->flags & SPW_SGD_MAXIMIZE) ? -g[i] : g[i];
        if (hp->weight_decay != 0.0) gi = fmaf(p[i], (float)hp->weight_decay, gi);
        if (hp->momentum != 0.0) {
            if (hp->flags & SPW_SGD_FIRST_STEP)
                buf[i] = gi;
            else
                buf[i] = fmaf(gi, (float)(1.0 - hp->dampening), buf[i] * (float)hp->momentum);
            gi = (hp->flags & SPW_SGD_NESTEROV) ? fmaf(buf[i], (float)hp->momentum, gi) : buf[i];
        }
        p[i] = fmaf(gi, (float)(-hp->lr), p[i]);
    }
}

static void assert_bits_equal(const float *a, const float *b, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) != 0)
            fail_msg("%s[%zu]: %.9g vs reference %.9g", what, i, (double)a[i], (double)b[i]);
}

/* ---- Adam / AdamW over tensor lists ---- */

typedef struct adam_case {
    int decoupled;
    spw_adam_hparams hp;
    int amsgrad;
    spw_optim_dtype dtype;
} adam_case;

/* Runs `steps` steps of c over tensors of the given sizes on every instruction set and with
 * pools of 1, 2, 3 and 7 threads, and compares each with the reference. */
static void check_adam(const adam_case *c, const size_t *sizes, size_t count, int steps) {
    float *p[8], *m[8], *v[8], *x[8], *g[8], *rp[8], *rm[8], *rv[8], *rx[8];
    uint16_t *g16[8];
    assert_true(count <= 8);
    for (size_t k = 0; k < count; k++) {
        size_t n = sizes[k];
        p[k] = fvec(n, 1);
        m[k] = fvec(n, 0);
        v[k] = fvec(n, 0);
        x[k] = fvec(n, 0);
        g[k] = fvec(n, 0);
        g16[k] = malloc((n ? n : 1) * 2);
        rp[k] = fdup(p[k], n);
        rm[k] = fvec(n, 0);
        rv[k] = fvec(n, 0);
        rx[k] = fvec(n, 0);
    }
    static const unsigned threads[] = {1, 2, 3, 7};
    spw_optim_pool *pools[4];
    for (int i = 0; i < 4; i++) assert_ok(spw_optim_pool_create(threads[i], &pools[i]));
    int run = 0;
    for (int s = 1; s <= steps; s++) {
        spw_adam_hparams hp = c->hp;
        hp.step = s;
        spw_adam_tensor t[8];
        for (size_t k = 0; k < count; k++) {
            for (size_t i = 0; i < sizes[k]; i++) {
                float f = rndf();
                if (c->dtype == SPW_OPTIM_BF16) {
                    g16[k][i] = to_bf16(f);
                    g[k][i] = ref_bf16(g16[k][i]);
                } else if (c->dtype == SPW_OPTIM_F16) {
                    g16[k][i] = to_f16(f * 64.0f);
                    g[k][i] = ref_f16(g16[k][i]);
                } else {
                    g[k][i] = f;
                }
            }
            ref_adam(c->decoupled, &hp, rp[k], g[k], rm[k], rv[k], c->amsgrad ? rx[k] : NULL,
                     sizes[k]);
            t[k] = (spw_adam_tensor){.param = p[k],
                                     .grad = c->dtype == SPW_OPTIM_F32 ? (const void *)g[k] : g16[k],
                                     .exp_avg = m[k], .exp_avg_sq = v[k],
                                     .max_exp_avg_sq = c->amsgrad ? x[k] : NULL, .n = sizes[k],
                                     .grad_dtype = c->dtype};
        }
        /* each step on another instruction set and pool: the state carries across them */
        const char *isa = isas[run % 3];
        spw_optim_pool *pool = pools[(run / 3) % 4];
        run++;
        if (spw__optim_force_isa(isa) != SPW_OK) {
            isa = "generic";
            assert_ok(spw__optim_force_isa(isa));
        }
        if (c->decoupled)
            assert_ok(spw_adamw_step(pool, &hp, t, count));
        else
            assert_ok(spw_adam_step(pool, &hp, t, count));
        for (size_t k = 0; k < count; k++) {
            assert_bits_equal(p[k], rp[k], sizes[k], "param");
            assert_bits_equal(m[k], rm[k], sizes[k], "exp_avg");
            assert_bits_equal(v[k], rv[k], sizes[k], "exp_avg_sq");
            if (c->amsgrad) assert_bits_equal(x[k], rx[k], sizes[k], "max_exp_avg_sq");
        }
    }
    assert_ok(spw__optim_force_isa(NULL));
    for (int i = 0; i < 4; i++) spw_optim_pool_destroy(pools[i]);
    for (size_t k = 0; k < count; k++) {
        free(p[k]), free(m[k]), free(v[k]), free(x[k]), free(g[k]), free(g16[k]);
        free(rp[k]), free(rm[k]), free(rv[k]), free(rx[k]);
    }
}

static const size_t one_large[] = {300001};
static const size_t mixed[] = {0, 1, 15, 17, 1000, 100003, 70001, 5};

static void adamw_default(void **s) {
    (void)s;
    adam_case c = {1, {1e-3, 0.9, 0.999, 1e-8, 1e-2, 0, 0}, 0, SPW_OPTIM_F32};
    check_adam(&c, one_large, 1, 12);
    check_adam(&c, mixed, 8, 12);
}

static void adamw_amsgrad_maximize(void **s) {
    (void)s;
    adam_case c = {1, {3e-2, 0.8, 0.95, 1e-6, 0.1, 0, SPW_ADAM_MAXIMIZE}, 1, SPW_OPTIM_F32};
    check_adam(&c, mixed, 8, 12);
}

static void adam_coupled_weight_decay(void **s) {
    (void)s;
    adam_case c = {0, {1e-2, 0.9, 0.999, 1e-8, 0.05, 0, 0}, 0, SPW_OPTIM_F32};
    check_adam(&c, mixed, 8, 12);
    c.hp.weight_decay = 0.0;
    c.amsgrad = 1;
    check_adam(&c, mixed, 8, 6);
}

static void adam_torch1_moment_and_large_lerp_weight(void **s) {
    (void)s;
    adam_case c = {1, {1e-3, 0.9, 0.999, 1e-8, 1e-2, 0, SPW_ADAM_MOMENT_MUL_ADD}, 0, SPW_OPTIM_F32};
    check_adam(&c, mixed, 8, 12);
    /* beta1 = 0.3: lerp's weight 0.7 takes its other branch; beta1 = 0: weight 1 */
    adam_case d = {1, {1e-3, 0.3, 0.999, 1e-8, 0.0, 0, 0}, 0, SPW_OPTIM_F32};
    check_adam(&d, mixed, 8, 12);
    d.hp.beta1 = 0.0;
    check_adam(&d, mixed, 8, 6);
}

static void adam_half_gradients(void **s) {
    (void)s;
    adam_case c = {1, {1e-3, 0.9, 0.999, 1e-8, 1e-2, 0, 0}, 0, SPW_OPTIM_BF16};
    check_adam(&c, mixed, 8, 6);
    c.dtype = SPW_OPTIM_F16;
    c.amsgrad = 1;
    check_adam(&c, mixed, 8, 6);
}

/* Every bf16 and fp16 value widens exactly (p = 0 - lr * g with lr = 1 gives -g). */
static void widening_is_exact_for_every_value(void **s) {
    (void)s;
    enum { N = 65536 };
    uint16_t *h = malloc(N * 2);
    float *p = malloc(N * 4);
    for (size_t i = 0; i < N; i++) h[i] = (uint16_t)i;
    spw_sgd_hparams hp = {1.0, 0.0, 0.0, 0.0, 0};
    for (int dt = SPW_OPTIM_BF16; dt <= SPW_OPTIM_F16; dt++)
        for (int k = 0; k < 3; k++) {
            if (spw__optim_force_isa(isas[k]) != SPW_OK) continue;
            memset(p, 0, N * 4);
            spw_sgd_tensor t = {p, h, NULL, N, (spw_optim_dtype)dt};
            assert_ok(spw_sgd_step(NULL, &hp, &t, 1));
            for (size_t i = 0; i < N; i++) {
                float want = dt == SPW_OPTIM_BF16 ? ref_bf16(h[i]) : ref_f16(h[i]);
                if (isnan(want)) {
                    if (!isnan(p[i])) fail_msg("%s dtype %d: 0x%04zx: %g, want NaN", isas[k], dt, i, (double)p[i]);
                } else if (p[i] != -want) {
                    fail_msg("%s dtype %d: 0x%04zx: %.9g, want %.9g", isas[k], dt, i, (double)p[i],
                             (double)-want);
                }
            }
        }
    assert_ok(spw__optim_force_isa(NULL));
    free(h);
    free(p);
}

/* ---- SGD ---- */

static void check_sgd(spw_sgd_hparams base, const size_t *sizes, size_t count, int steps) {
    float *p[8], *b[8], *g[8], *rp[8], *rb[8];
    for (size_t k = 0; k < count; k++) {
        p[k] = fvec(sizes[k], 1);
        b[k] = fvec(sizes[k], 0);
        g[k] = fvec(sizes[k], 0);
        rp[k] = fdup(p[k], sizes[k]);
        rb[k] = fvec(sizes[k], 0);
    }
    spw_optim_pool *pool;
    assert_ok(spw_optim_pool_create(3, &pool));
    for (int s = 1; s <= steps; s++) {
        spw_sgd_hparams hp = base;
        if (s == 1) hp.flags |= SPW_SGD_FIRST_STEP;
        spw_sgd_tensor t[8];
        for (size_t k = 0; k < count; k++) {
            for (size_t i = 0; i < sizes[k]; i++) g[k][i] = rndf();
            ref_sgd(&hp, rp[k], g[k], rb[k], sizes[k]);
            t[k] = (spw_sgd_tensor){p[k], g[k], hp.momentum != 0.0 ? b[k] : NULL, sizes[k], SPW_OPTIM_F32};
        }
        if (spw__optim_force_isa(isas[s % 3]) != SPW_OK) assert_ok(spw__optim_force_isa("generic"));
        assert_ok(spw_sgd_step(s % 2 ? pool : NULL, &hp, t, count));
        for (size_t k = 0; k < count; k++) {
            assert_bits_equal(p[k], rp[k], sizes[k], "param");
            if (hp.momentum != 0.0) assert_bits_equal(b[k], rb[k], sizes[k], "momentum_buffer");
        }
    }
    assert_ok(spw__optim_force_isa(NULL));
    spw_optim_pool_destroy(pool);
    for (size_t k = 0; k < count; k++) free(p[k]), free(b[k]), free(g[k]), free(rp[k]), free(rb[k]);
}

/* Outputs apart from the inputs: the outputs equal an in-place step's results bit for bit, the
 * inputs are left as they were, and the next step may read the outputs as its inputs. */
static void adam_out_of_place(void **s) {
    (void)s;
    const size_t n = 100003;
    for (int amsgrad = 0; amsgrad < 2; amsgrad++) {
        float *in[4], *out[4], *ref[4], *keep[4];
        for (int k = 0; k < 4; k++) {
            in[k] = fvec(n, k == 0), out[k] = fvec(n, 0);
            if (k == 2 || k == 3)
                for (size_t i = 0; i < n; i++) in[k][i] = fabsf(rndf());
            ref[k] = fdup(in[k], n);
        }
        float *g = fvec(n, 1);
        for (int step = 1; step <= 3; step++) {
            for (int k = 0; k < 4; k++) keep[k] = fdup(in[k], n);
            spw_adam_hparams hp = {1e-3, 0.9, 0.999, 1e-8, 1e-2, step, 0};
            spw_adam_tensor r = {.param = ref[0], .grad = g, .exp_avg = ref[1], .exp_avg_sq = ref[2],
                                 .max_exp_avg_sq = amsgrad ? ref[3] : NULL, .n = n,
                                 .grad_dtype = SPW_OPTIM_F32};
            spw_adam_tensor t = {.param = in[0], .grad = g, .exp_avg = in[1], .exp_avg_sq = in[2],
                                 .max_exp_avg_sq = amsgrad ? in[3] : NULL, .n = n,
                                 .grad_dtype = SPW_OPTIM_F32, .param_out = out[0],
                                 .exp_avg_out = out[1], .exp_avg_sq_out = out[2],
                                 .max_exp_avg_sq_out = amsgrad ? out[3] : NULL};
            assert_ok(spw_adamw_step(NULL, &hp, &r, 1));
            assert_ok(spw_adamw_step(NULL, &hp, &t, 1));
            for (int k = 0; k < (amsgrad ? 4 : 3); k++) {
                assert_bits_equal(out[k], ref[k], n, "output");
                assert_bits_equal(in[k], keep[k], n, "input");
                float *x = in[k];
                in[k] = out[k], out[k] = x;
            }
            for (int k = 0; k < 4; k++) free(keep[k]);
        }
        for (int k = 0; k < 4; k++) free(in[k]), free(out[k]), free(ref[k]);
        free(g);
    }
}

static void sgd_variants(void **s) {
    (void)s;
    check_sgd((spw_sgd_hparams){0.1, 0.0, 0.0, 0.0, 0}, mixed, 8, 4);
    check_sgd((spw_sgd_hparams){0.1, 0.0, 0.0, 1e-2, SPW_SGD_MAXIMIZE}, mixed, 8, 4);
    check_sgd((spw_sgd_hparams){0.05, 0.9, 0.0, 0.0, 0}, mixed, 8, 6);
    check_sgd((spw_sgd_hparams){0.05, 0.9, 0.1, 1e-2, 0}, mixed, 8, 6);
    check_sgd((spw_sgd_hparams){0.05, 0.9, 0.0, 1e-2, SPW_SGD_NESTEROV}, mixed, 8, 6);
    check_sgd((spw_sgd_hparams){0.05, 0.5, 0.0, 0.0, SPW_SGD_NESTEROV | SPW_SGD_MAXIMIZE}, one_large, 1, 6);
}

/* ---- bad input changes nothing ---- */

enum { BN = 64 };
static float bp[BN + 1], bg[BN + 1], bm[BN], bv[BN], bx[BN];
static float sp[BN + 1], sg[BN + 1], sm[BN], sv[BN], sx[BN];

static void bad_setup(void) {
    for (int i = 0; i < BN; i++) bp[i] = bg[i] = bm[i] = bv[i] = bx[i] = (float)i + 0.5f;
    memcpy(sp, bp, sizeof bp), memcpy(sg, bg, sizeof bg), memcpy(sm, bm, sizeof bm);
    memcpy(sv, bv, sizeof bv), memcpy(sx, bx, sizeof bx);
}

static void bad_unchanged(void) {
    assert_memory_equal(bp, sp, sizeof bp);
    assert_memory_equal(bg, sg, sizeof bg);
    assert_memory_equal(bm, sm, sizeof bm);
    assert_memory_equal(bv, sv, sizeof bv);
    assert_memory_equal(bx, sx, sizeof bx);
}

static spw_status adamw1(spw_adam_hparams hp, spw_adam_tensor t) {
    return spw_adamw_step(NULL, &hp, &t, 1);
}

static void adam_bad_input(void **s) {
    (void)s;
    const spw_adam_hparams ok = {1e-3, 0.9, 0.999, 1e-8, 1e-2, 1, 0};
    const spw_adam_tensor t = {.param = bp, .grad = bg, .exp_avg = bm, .exp_avg_sq = bv, .n = BN,
                               .grad_dtype = SPW_OPTIM_F32};
    bad_setup();
    spw_adam_hparams hp;

    assert_status(spw_adamw_step(NULL, NULL, &t, 1), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("hparams is NULL");
    assert_status(spw_adam_step(NULL, &ok, NULL, 3), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("tensors is NULL (count = 3)");
    hp = ok, hp.lr = -1e-3;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("lr = -0.001");
    hp = ok, hp.lr = NAN;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("lr = nan");
    hp = ok, hp.beta1 = 1.0;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("beta1 = 1 (want 0 <= beta1 < 1)");
    hp = ok, hp.beta2 = -0.5;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("beta2 = -0.5");
    hp = ok, hp.eps = -1e-8;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("eps = -1e-08");
    hp = ok, hp.weight_decay = -0.1;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("weight_decay = -0.1");
    hp = ok, hp.weight_decay = INFINITY;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    hp = ok, hp.step = 0;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("step = 0");
    hp = ok, hp.flags = 0x80;
    assert_status(adamw1(hp, t), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("unknown flags 0x80");

    spw_adam_tensor u = t;
    u.exp_avg = NULL;
    assert_status(adamw1(ok, u), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("tensor 0: exp_avg is NULL (n = 64)");
    u = t, u.param = (float *)((char *)bp + 1);
    assert_status(adamw1(ok, u), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("param");
    assert_msg_has("not aligned");
    u = t, u.grad = bp + 1;
    assert_status(adamw1(ok, u), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("param");
    assert_msg_has("grad");
    assert_msg_has("overlap");
    u = t, u.grad_dtype = (spw_optim_dtype)7;
    assert_status(adamw1(ok, u), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("grad_dtype 7");
    u = t, u.n = SIZE_MAX / 2;
    assert_status(adamw1(ok, u), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("absurd");
    /* amsgrad on one tensor but not the other; the first is valid and must stay untouched */
    spw_adam_tensor two[2] = {t, t};
    two[0].max_exp_avg_sq = bx;
    two[1].n = 8;
    assert_status(spw_adamw_step(NULL, &ok, two, 2), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("tensor 1 lacks max_exp_avg_sq");
    /* a bad second tensor: nothing of the first is written either */
    two[0] = t;
    two[1] = t, two[1].param = NULL;
    assert_status(spw_adamw_step(NULL, &ok, two, 2), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("tensor 1: param is NULL");
    bad_unchanged();

    /* an output over another array of its tensor; an amsgrad output without amsgrad */
    u = t, u.exp_avg_out = bg + 1;
    assert_status(adamw1(ok, u), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("exp_avg_out");
    assert_msg_has("overlap");
    u = t, u.param_out = bm;
    assert_status(adamw1(ok, u), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("param_out");
    u = t, u.max_exp_avg_sq_out = bx;
    assert_status(adamw1(ok, u), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("max_exp_avg_sq_out but no max_exp_avg_sq");
    bad_unchanged();

    /* nothing to do is fine */
    assert_ok(spw_adamw_step(NULL, &ok, NULL, 0));
    u = t, u.n = 0, u.param = NULL, u.exp_avg = NULL;
    assert_ok(adamw1(ok, u));
    bad_unchanged();
}

static void sgd_bad_input(void **s) {
    (void)s;
    const spw_sgd_hparams ok = {0.1, 0.9, 0.0, 0.0, 0};
    spw_sgd_tensor t = {bp, bg, bm, BN, SPW_OPTIM_F32};
    bad_setup();
    spw_sgd_hparams hp;
    assert_status(spw_sgd_step(NULL, NULL, &t, 1), SPW_ERR_INVALID_ARGUMENT);
    hp = ok, hp.lr = -0.1;
    assert_status(spw_sgd_step(NULL, &hp, &t, 1), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("lr = -0.1");
    hp = ok, hp.momentum = -0.9;
    assert_status(spw_sgd_step(NULL, &hp, &t, 1), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("momentum = -0.9");
    hp = ok, hp.dampening = NAN;
    assert_status(spw_sgd_step(NULL, &hp, &t, 1), SPW_ERR_INVALID_ARGUMENT);
    hp = ok, hp.dampening = 0.1, hp.flags = SPW_SGD_NESTEROV;
    assert_status(spw_sgd_step(NULL, &hp, &t, 1), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("nesterov needs momentum > 0 and dampening 0");
    hp = ok, hp.momentum = 0.0, hp.flags = SPW_SGD_NESTEROV;
    assert_status(spw_sgd_step(NULL, &hp, &t, 1), SPW_ERR_INVALID_ARGUMENT);
    t.momentum_buffer = NULL;
    assert_status(spw_sgd_step(NULL, &ok, &t, 1), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("momentum_buffer is NULL");
    bad_unchanged();
    /* without momentum no buffer is needed */
    hp = ok, hp.momentum = 0.0;
    assert_ok(spw_sgd_step(NULL, &hp, &t, 1));
    assert_true(bp[1] != sp[1]);
}

static void pool_arguments(void **s) {
    (void)s;
    spw_optim_pool *pool = NULL;
    assert_status(spw_optim_pool_create(1, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_optim_pool_create(1025, &pool), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("1025 threads");
    assert_null(pool);
    assert_ok(spw_optim_pool_create(0, &pool));
    assert_int_equal(spw_optim_pool_threads(pool), spw__cpus_allowed());
    spw_optim_pool_destroy(pool);
    spw_optim_pool_destroy(NULL);
    assert_int_equal(spw_optim_pool_threads(NULL), 0);
    assert_status(spw__optim_force_isa("sse9"), SPW_ERR_UNSUPPORTED);
    const char *isa = spw_optim_isa();
    assert_true(!strcmp(isa, "generic") || !strcmp(isa, "avx2") || !strcmp(isa, "avx512"));
}

/* ---- the heap for a framework's own step ---- */

static void keep_freed_bad_input(void **s) {
    (void)s;
    size_t kept = 77;
    assert_status(spw_optim_keep_freed(0, &kept), SPW_ERR_INVALID_ARGUMENT);
    assert_msg_has("0 bytes");
    assert_status(spw_optim_keep_freed(SIZE_MAX, &kept), SPW_ERR_INVALID_ARGUMENT);
    assert_status(spw_optim_keep_freed((size_t)1 << 31, &kept), SPW_ERR_INVALID_ARGUMENT);
    assert_int_equal(kept, 77); /* untouched on failure */
}

#if defined(TEST_ASAN) || defined(TEST_TSAN)
#define SANITIZED_MALLOC 1 /* the sanitizer's allocator replaces glibc's: mallopt does nothing */
#endif

#if defined(__GLIBC__) && !defined(SANITIZED_MALLOC)
static long minor_faults(void) {
    struct rusage ru;
    assert_int_equal(getrusage(RUSAGE_SELF, &ru), 0);
    return ru.ru_minflt;
}
#endif

/* An allocation above glibc's own 32 MiB ceiling, made, written and freed as a step's temporary:
 * mapped and faulted in every time by default; kept in the heap, its pages are reused. */
static void keep_freed_reuses_a_temporary(void **s) {
    (void)s;
    const size_t n = (size_t)40 << 20;
    size_t kept = 0;
#if defined(SANITIZED_MALLOC)
    spw_status st = spw_optim_keep_freed(n, &kept);
    assert_true(st == SPW_OK || st == SPW_ERR_UNSUPPORTED);
    skip();
#elif defined(__GLIBC__)
    bool own = getenv("MALLOC_MMAP_THRESHOLD_") || getenv("MALLOC_TRIM_THRESHOLD_") ||
               getenv("MALLOC_MMAP_MAX_") || getenv("GLIBC_TUNABLES");
    assert_ok(spw_optim_keep_freed(n, &kept));
    if (!kept) { /* the environment's thresholds stand: nothing to measure */
        assert_true(own);
        skip();
    }
    assert_int_equal(kept, n);
    long faults = 0;
    for (int i = 0; i < 5; i++) {
        long f0 = minor_faults();
        char *p = malloc(n);
        assert_non_null(p);
        memset(p, i + 1, n);
        assert_int_equal(p[n - 1], i + 1);
        free(p);
        if (i) faults += minor_faults() - f0; /* the first pass faults the heap in */
    }
    /* 4 passes over 10240 pages of 4 KiB would fault 40960 times if each were a new mapping */
    assert_true(faults < 2048);
    assert_ok(spw_optim_keep_freed(1 << 20, &kept)); /* a smaller size keeps the larger one */
    assert_int_equal(kept, n);
    assert_ok(spw_optim_keep_freed(n, NULL));
#else
    assert_status(spw_optim_keep_freed(n, &kept), SPW_ERR_UNSUPPORTED);
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(adamw_default),
        cmocka_unit_test(adamw_amsgrad_maximize),
        cmocka_unit_test(adam_coupled_weight_decay),
        cmocka_unit_test(adam_torch1_moment_and_large_lerp_weight),
        cmocka_unit_test(adam_half_gradients),
        cmocka_unit_test(widening_is_exact_for_every_value),
        cmocka_unit_test(adam_out_of_place),
        cmocka_unit_test(sgd_variants),
        cmocka_unit_test(adam_bad_input),
        cmocka_unit_test(sgd_bad_input),
        cmocka_unit_test(pool_arguments),
        cmocka_unit_test(keep_freed_bad_input),
        cmocka_unit_test(keep_freed_reuses_a_temporary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
