/*
 * The optimizer element loops, written once and compiled once per instruction set: each
 * optim_kernel_<isa>.c defines SPW_OPTIM_SUFFIX and includes this file with its own target
 * flags (see CMakeLists.txt). The loops are plain C that gcc vectorizes at -O3; fused
 * multiply-adds are explicit fmaf() calls and the files are built with -ffp-contract=off, so an
 * element's arithmetic is the same in the vector body and the scalar tail, on every set:
 * results never depend on where a range is cut.
 *
 * The operations and their order follow torch's CPU kernels for fp32 (ATen, vectorized path):
 *   mul_(s)              a * s
 *   add_(b, alpha=s)     fma(b, s, a)
 *   lerp_(b, w), |w|<.5  fma(w, b - a, a); otherwise fma(w - 1, b - a, b)
 *   addcmul_(b, c, s)    a + (s * b) * c
 *   addcdiv_(b, c, s)    a + (s * b) / c
 *   maximum(a, b)        NaN when either is NaN
 */
#ifndef SPW_OPTIM_SUFFIX
#error "define SPW_OPTIM_SUFFIX before including optim_kernel.h"
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "optim.h"

#define SPW_OK_CAT_(a, b) a##b
#define SPW_OK_CAT(a, b) SPW_OK_CAT_(a, b)
#define SPW_OK_NAME(name) SPW_OK_CAT(name, SPW_OPTIM_SUFFIX)

#define SPW_INLINE static inline __attribute__((always_inline))

/* Gradients that are not fp32 are widened block by block into a stack buffer (it stays in L1),
 * so the update loops exist once, over fp32. */
#define SPW_OPTIM_BLOCK 1024

SPW_INLINE float spw_ok_as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

SPW_INLINE uint32_t spw_ok_as_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* bf16 is the top half of an fp32. */
static void SPW_OK_NAME(widen_bf16_)(float *restrict out, const uint16_t *restrict in, size_t n) {
#pragma GCC ivdep
    for (size_t i = 0; i < n; i++) out[i] = spw_ok_as_float((uint32_t)in[i] << 16);
}

/* IEEE half to fp32, exact for every input (subnormals, infinities, NaN payloads), in integer
 * arithmetic plus one exact subtraction between normal floats, so a denormals-are-zero mode does
 * not change it. */
static void SPW_OK_NAME(widen_f16_)(float *restrict out, const uint16_t *restrict in, size_t n) {
#pragma GCC ivdep
    for (size_t i = 0; i < n; i++) {
        uint32_t h = in[i];
        uint32_t shifted = (h & 0x7fffu) << 13;
        uint32_t exp = shifted & 0x0f800000u;
        uint32_t special = 0u - (uint32_t)(exp == 0x0f800000u); /* all ones for inf / NaN */
        uint32_t tiny = 0u - (uint32_t)(exp == 0);              /* all ones for zero / subnormal */
        uint32_t o = shifted + ((127u - 15u) << 23) + (special & ((128u - 16u) << 23));
        uint32_t sub = spw_ok_as_bits(spw_ok_as_float(o + (1u << 23)) - 0x1p-14f);
        uint32_t bits = (sub & tiny) | (o & ~tiny);
        out[i] = spw_ok_as_float(bits | ((h & 0x8000u) << 16));
    }
}

/* a bf16 or fp16 gradient block, widened to fp32 */
static void SPW_OK_NAME(widen_)(spw_optim_dtype dtype, float *restrict out, const uint16_t *restrict in, size_t n) {
    if (dtype == SPW_OPTIM_BF16)
        SPW_OK_NAME(widen_bf16_)(out, in, n);
    else
        SPW_OK_NAME(widen_f16_)(out, in, n);
}

/* torch.maximum: NaN when either operand is NaN. */
SPW_INLINE float spw_ok_nanmax(float a, float b) {
    float r = a > b ? a : b;
    r = (a != a) ? a : r;
    return (b != b) ? b : r;
}

/* The inputs p, m, v, vmax are only read and the outputs only written, element by element at
 * the same index: an output may be its input (in place) or another array, so neither side is
 * restrict; ivdep states that no element depends on another. */
SPW_INLINE void spw_ok_adam_loop(const spw__adam_coef *c, const float *p, const float *restrict g,
                                 const float *m, const float *v, const float *vmax, float *po,
                                 float *mo, float *vo, float *vmaxo, size_t n,
                                 const int coupled_wd, const int mul_add, const int amsgrad) {
    const float gsign = c->gsign, wd_mul = c->wd_mul, wd = c->wd;
    const float b1 = c->beta1, a1 = c->one_minus_beta1, lc = c->lerp_coef;
    const float b2 = c->beta2, a2 = c->one_minus_beta2;
    const float bc2 = c->bc2_sqrt, eps = c->eps, nss = c->neg_step_size;
    const int small = c->lerp_small;
#pragma GCC ivdep
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gsign;
        float pi = p[i] * wd_mul;
        if (coupled_wd) gi = fmaf(pi, wd, gi);
        float mi = m[i];
        if (mul_add)
            mi = fmaf(gi, a1, mi * b1);
        else
            mi = fmaf(lc, gi - mi, small ? mi : gi);
        float vi = fmaf(a2 * gi, gi, v[i] * b2);
        float s = vi;
        if (amsgrad) {
            s = spw_ok_nanmax(vmax[i], vi);
            vmaxo[i] = s;
        }
        float den = sqrtf(s) / bc2 + eps;
        po[i] = pi + (nss * mi) / den;
        mo[i] = mi;
        vo[i] = vi;
    }
}

/* A tensor's arrays from element lo on: inputs, and outputs (the input where none is given). */
typedef struct spw_ok_adam_at {
    const float *p, *m, *v, *vmax;
    float *po, *mo, *vo, *vmaxo;
} spw_ok_adam_at;

/* One specialised loop per flag combination, so the vector body has no per-element branch. */
static void SPW_OK_NAME(adam_f32_)(const spw__adam_coef *c, const spw_ok_adam_at *a, const float *g,
                                   size_t n) {
    int k = (c->coupled_wd ? 4 : 0) | (c->mul_add ? 2 : 0) | (c->amsgrad ? 1 : 0);
#define SPW_OK_ADAM(cw, ma, am) \
    spw_ok_adam_loop(c, a->p, g, a->m, a->v, a->vmax, a->po, a->mo, a->vo, a->vmaxo, n, cw, ma, am)
    switch (k) {
    case 0: SPW_OK_ADAM(0, 0, 0); break;
    case 1: SPW_OK_ADAM(0, 0, 1); break;
    case 2: SPW_OK_ADAM(0, 1, 0); break;
    case 3: SPW_OK_ADAM(0, 1, 1); break;
    case 4: SPW_OK_ADAM(1, 0, 0); break;
    case 5: SPW_OK_ADAM(1, 0, 1); break;
    case 6: SPW_OK_ADAM(1, 1, 0); break;
    default: SPW_OK_ADAM(1, 1, 1); break;
    }
#undef SPW_OK_ADAM
}

static float *spw_ok_out(float *out, float *in, size_t lo) { return (out ? out : in) + lo; }

void SPW_OK_NAME(spw__adam_kernel_)(const spw__adam_coef *c, const spw_adam_tensor *t, size_t lo,
                                    size_t hi) {
    spw_ok_adam_at a = {t->param + lo, t->exp_avg + lo, t->exp_avg_sq + lo, NULL,
                        spw_ok_out(t->param_out, t->param, lo),
                        spw_ok_out(t->exp_avg_out, t->exp_avg, lo),
                        spw_ok_out(t->exp_avg_sq_out, t->exp_avg_sq, lo), NULL};
    if (c->amsgrad) {
        a.vmax = t->max_exp_avg_sq + lo;
        a.vmaxo = spw_ok_out(t->max_exp_avg_sq_out, t->max_exp_avg_sq, lo);
    }
    size_t n = hi - lo;
    if (t->grad_dtype == SPW_OPTIM_F32) {
        SPW_OK_NAME(adam_f32_)(c, &a, (const float *)t->grad + lo, n);
        return;
    }
    const uint16_t *g16 = (const uint16_t *)t->grad + lo;
    float gbuf[SPW_OPTIM_BLOCK];
    for (size_t off = 0; off < n; off += SPW_OPTIM_BLOCK) {
        size_t k = n - off < SPW_OPTIM_BLOCK ? n - off : SPW_OPTIM_BLOCK;
        SPW_OK_NAME(widen_)(t->grad_dtype, gbuf, g16 + off, k);
        spw_ok_adam_at b = {a.p + off, a.m + off, a.v + off, a.vmax ? a.vmax + off : NULL,
                            a.po + off, a.mo + off, a.vo + off, a.vmaxo ? a.vmaxo + off : NULL};
        SPW_OK_NAME(adam_f32_)(c, &b, gbuf, k);
    }
}

/* momentum: 0 none, 1 first step (buffer = gradient), 2 running buffer. */
SPW_INLINE void spw_ok_sgd_loop(const spw__sgd_coef *c, float *restrict p, const float *restrict g,
                                float *restrict buf, size_t n, const int has_wd,
                                const int momentum, const int nesterov) {
    const float gsign = c->gsign, wd = c->wd, mom = c->momentum;
    const float damp1 = c->one_minus_dampening, nlr = c->neg_lr;
#pragma GCC ivdep
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gsign;
        float pi = p[i];
        if (has_wd) gi = fmaf(pi, wd, gi);
        if (momentum) {
            float bi = momentum == 1 ? gi : fmaf(gi, damp1, buf[i] * mom);
            buf[i] = bi;
            gi = nesterov ? fmaf(bi, mom, gi) : bi;
        }
        p[i] = fmaf(gi, nlr, pi);
    }
}

static void SPW_OK_NAME(sgd_f32_)(const spw__sgd_coef *c, float *p, const float *g, float *buf,
                                  size_t n) {
    int mom = c->has_momentum ? (c->first_step ? 1 : 2) : 0;
    int k = (c->has_wd ? 6 : 0) + mom * 2 + (c->nesterov && mom ? 1 : 0);
    switch (k) {
    case 0: spw_ok_sgd_loop(c, p, g, buf, n, 0, 0, 0); break;
    case 2: spw_ok_sgd_loop(c, p, g, buf, n, 0, 1, 0); break;
    case 3: spw_ok_sgd_loop(c, p, g, buf, n, 0, 1, 1); break;
    case 4: spw_ok_sgd_loop(c, p, g, buf, n, 0, 2, 0); break;
    case 5: spw_ok_sgd_loop(c, p, g, buf, n, 0, 2, 1); break;
    case 6: spw_ok_sgd_loop(c, p, g, buf, n, 1, 0, 0); break;
    case 8: spw_ok_sgd_loop(c, p, g, buf, n, 1, 1, 0); break;
    case 9: spw_ok_sgd_loop(c, p, g, buf, n, 1, 1, 1); break;
    case 10: spw_ok_sgd_loop(c, p, g, buf, n, 1, 2, 0); break;
    default: spw_ok_sgd_loop(c, p, g, buf, n, 1, 2, 1); break;
    }
}

void SPW_OK_NAME(spw__sgd_kernel_)(const spw__sgd_coef *c, const spw_sgd_tensor *t, size_t lo,
                                   size_t hi) {
    float *p = t->param + lo;
    float *buf = c->has_momentum ? t->momentum_buffer + lo : NULL;
    size_t n = hi - lo;
    if (t->grad_dtype == SPW_OPTIM_F32) {
        SPW_OK_NAME(sgd_f32_)(c, p, (const float *)t->grad + lo, buf, n);
        return;
    }
    const uint16_t *g16 = (const uint16_t *)t->grad + lo;
    float gbuf[SPW_OPTIM_BLOCK];
    for (size_t off = 0; off < n; off += SPW_OPTIM_BLOCK) {
        size_t k = n - off < SPW_OPTIM_BLOCK ? n - off : SPW_OPTIM_BLOCK;
        SPW_OK_NAME(widen_)(t->grad_dtype, gbuf, g16 + off, k);
        SPW_OK_NAME(sgd_f32_)(c, p + off, gbuf, buf ? buf + off : NULL, k);
    }
}
