/*
 * The optimizer entry points: check every argument, turn the hyper-parameters into the fp32
 * constants torch would use, pick the instruction set, split the elements over the pool.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "optim.h"

/* Below this many elements a part is not worth a worker's wake-up. */
#define SPW_OPTIM_MIN_PART ((size_t)1 << 15)
/* Chunks start on multiples of 16 elements (64 bytes of fp32), away from each other's lines. */
#define SPW_OPTIM_CHUNK_ALIGN ((size_t)16)

/* ---- instruction set ---- */

typedef struct spw_isa {
    const char *name;
    spw__adam_kernel_fn adam;
    spw__sgd_kernel_fn sgd;
} spw_isa;

static const spw_isa spw_isa_generic = {"generic", spw__adam_kernel_generic, spw__sgd_kernel_generic};
#if defined(__x86_64__)
static const spw_isa spw_isa_avx2 = {"avx2", spw__adam_kernel_avx2, spw__sgd_kernel_avx2};
static const spw_isa spw_isa_avx512 = {"avx512", spw__adam_kernel_avx512, spw__sgd_kernel_avx512};
#endif

static _Atomic(const spw_isa *) spw_isa_forced;
static _Atomic(const spw_isa *) spw_isa_best;

static int spw_isa_supported(const spw_isa *isa) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (isa == &spw_isa_avx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma");
    if (isa == &spw_isa_avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return isa == &spw_isa_generic;
}

static const spw_isa *spw_isa_current(void) {
    const spw_isa *isa = atomic_load_explicit(&spw_isa_forced, memory_order_acquire);
    if (isa) return isa;
    isa = atomic_load_explicit(&spw_isa_best, memory_order_acquire);
    if (isa) return isa;
    isa = &spw_isa_generic;
#if defined(__x86_64__)
    if (spw_isa_supported(&spw_isa_avx512))
        isa = &spw_isa_avx512;
    else if (spw_isa_supported(&spw_isa_avx2))
        isa = &spw_isa_avx2;
#endif
    atomic_store_explicit(&spw_isa_best, isa, memory_order_release);
    return isa;
}

SPW_API const char *spw_optim_isa(void) { return spw_isa_current()->name; }

spw_status spw__optim_force_isa(const char *name) {
    if (!name) {
        atomic_store(&spw_isa_forced, NULL);
        return SPW_OK;
    }
    const spw_isa *all[] = {
#if defined(__x86_64__)
        &spw_isa_avx512, &spw_isa_avx2,
#endif
        &spw_isa_generic};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (strcmp(all[i]->name, name) != 0) continue;
        if (!spw_isa_supported(all[i]))
            return spw__error(SPW_ERR_UNSUPPORTED, "instruction set '%s' not supported by this CPU", name);
        atomic_store(&spw_isa_forced, all[i]);
        return SPW_OK;
    }
    return spw__error(SPW_ERR_UNSUPPORTED, "instruction set '%s' not built in", name);
}

/* ---- argument checks ---- */

static int spw_in_unit(double x) { return x >= 0.0 && x < 1.0; } /* false for NaN */
static int spw_nonneg(double x) { return x >= 0.0 && isfinite(x); }

static size_t spw_dtype_size(spw_optim_dtype dt) { return dt == SPW_OPTIM_F32 ? 4 : 2; }

typedef struct spw_array {
    const char *name;
    const void *ptr;
    size_t elem;
} spw_array;

/* Each array present, aligned, and disjoint from the others of its tensor. */
static spw_status spw_check_arrays(const char *fn, size_t index, size_t n, const spw_array *a,
                                   size_t count) {
    if (n > SIZE_MAX / 16)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: tensor %zu: n = %zu elements is absurd", fn,
                          index, n);
    for (size_t i = 0; i < count; i++) {
        if (!a[i].ptr)
            return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: tensor %zu: %s is NULL (n = %zu)", fn,
                              index, a[i].name, n);
        if ((uintptr_t)a[i].ptr % a[i].elem)
            return spw__error(SPW_ERR_INVALID_ARGUMENT,
                              "%s: tensor %zu: %s = %p is not aligned to its %zu-byte elements", fn,
                              index, a[i].name, a[i].ptr, a[i].elem);
    }
    for (size_t i = 0; i < count; i++)
        for (size_t j = i + 1; j < count; j++) {
            uintptr_t x = (uintptr_t)a[i].ptr, y = (uintptr_t)a[j].ptr;
            if (x < y + n * a[j].elem && y < x + n * a[i].elem)
                return spw__error(SPW_ERR_INVALID_ARGUMENT,
                                  "%s: tensor %zu: %s (%p) and %s (%p) overlap (n = %zu)", fn, index,
                                  a[i].name, a[i].ptr, a[j].name, a[j].ptr, n);
        }
    return SPW_OK;
}

static spw_status spw_check_dtype(const char *fn, size_t index, spw_optim_dtype dt) {
    if (dt != SPW_OPTIM_F32 && dt != SPW_OPTIM_BF16 && dt != SPW_OPTIM_F16)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: tensor %zu: grad_dtype %d is not one of "
                          "SPW_OPTIM_F32, SPW_OPTIM_BF16, SPW_OPTIM_F16", fn, index, (int)dt);
    return SPW_OK;
}

/* ---- splitting ----
 * The elements of all tensors, end to end, are cut into chunks that the pool's threads take in
 * turn from a shared counter: a thread slowed down (another process on its core, the program's
 * own threads) takes fewer chunks instead of holding up the step. Results do not depend on the
 * cut. */

typedef struct spw_job {
    const spw_isa *isa;
    const void *coef;
    const void *tensors;
    size_t count;
    size_t total;
    size_t chunk;        /* elements per chunk, a multiple of SPW_OPTIM_CHUNK_ALIGN */
    size_t nchunks;
    atomic_size_t next;  /* the next chunk to take */
    int adam;
} spw_job;

static size_t spw_tensor_n(const spw_job *job, size_t i) {
    return job->adam ? ((const spw_adam_tensor *)job->tensors)[i].n
                     : ((const spw_sgd_tensor *)job->tensors)[i].n;
}

static void spw_job_part(void *arg, unsigned part, unsigned parts) {
    spw_job *job = arg;
    (void)part;
    (void)parts;
    size_t first = 0, first_base = 0; /* the tensor holding the last chunk's start; chunks a
                                       * thread takes only grow, so this only moves forward */
    for (;;) {
        size_t c = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (c >= job->nchunks) return;
        size_t lo = c * job->chunk, hi = SPW_MIN(lo + job->chunk, job->total);
        while (first < job->count && first_base + spw_tensor_n(job, first) <= lo)
            first_base += spw_tensor_n(job, first++);
        for (size_t i = first, base = first_base; i < job->count && base < hi; i++) {
            size_t n = spw_tensor_n(job, i);
            size_t a = lo > base ? lo - base : 0;
            size_t b = hi - base < n ? hi - base : n;
            if (a < b) {
                if (job->adam)
                    job->isa->adam(job->coef, (const spw_adam_tensor *)job->tensors + i, a, b);
                else
                    job->isa->sgd(job->coef, (const spw_sgd_tensor *)job->tensors + i, a, b);
            }
            base += n;
        }
    }
}

static spw_status spw_run_job(spw_optim_pool *pool, spw_job *job) {
    if (job->total == 0) return SPW_OK;
    job->isa = spw_isa_current();
    atomic_init(&job->next, 0);
    size_t want = job->total / SPW_OPTIM_MIN_PART;
    if (want <= 1) {
        job->chunk = job->total;
        job->nchunks = 1;
        spw_job_part(job, 0, 1);
        return SPW_OK;
    }
    if (!pool) pool = spw__pool_default();
    if (!pool) return SPW_ERR_HOST_OUT_OF_MEMORY; /* message set */
    unsigned threads = spw_optim_pool_threads(pool);
    unsigned parts = want < threads ? (unsigned)want : threads;
    /* about 8 chunks a thread, none smaller than SPW_OPTIM_MIN_PART */
    size_t chunk = SPW_MAX(job->total / ((size_t)parts * 8), SPW_OPTIM_MIN_PART);
    chunk = SPW_ALIGN_UP(chunk, SPW_OPTIM_CHUNK_ALIGN);
    job->chunk = chunk;
    job->nchunks = (job->total + chunk - 1) / chunk;
    spw__pool_run(pool, parts, spw_job_part, job);
    return SPW_OK;
}

/* ---- Adam / AdamW ---- */

static spw_status spw_adam(const char *fn, int decoupled, spw_optim_pool *pool,
                           const spw_adam_hparams *hp, const spw_adam_tensor *t, size_t count) {
    if (!hp) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: hparams is NULL", fn);
    if (count && !t)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: tensors is NULL (count = %zu)", fn, count);
    if (!spw_nonneg(hp->lr))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: lr = %g (want a finite value >= 0)", fn, hp->lr);
    if (!spw_in_unit(hp->beta1))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: beta1 = %g (want 0 <= beta1 < 1)", fn, hp->beta1);
    if (!spw_in_unit(hp->beta2))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: beta2 = %g (want 0 <= beta2 < 1)", fn, hp->beta2);
    if (!spw_nonneg(hp->eps))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: eps = %g (want a finite value >= 0)", fn, hp->eps);
    if (!spw_nonneg(hp->weight_decay))
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "%s: weight_decay = %g (want a finite value >= 0)", fn, hp->weight_decay);
    if (hp->step < 1)
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "%s: step = %lld (want >= 1: the step count after this update)", fn,
                          (long long)hp->step);
    const unsigned known = SPW_ADAM_MAXIMIZE | SPW_ADAM_MOMENT_MUL_ADD;
    if (hp->flags & ~known)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", fn, hp->flags & ~known);

    int amsgrad = -1; /* -1: not known yet */
    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        spw_status st = spw_check_dtype(fn, i, t[i].grad_dtype);
        if (st) return st;
        if (t[i].n == 0) continue;
        int has_max = t[i].max_exp_avg_sq != NULL;
        if (amsgrad >= 0 && has_max != amsgrad)
            return spw__error(SPW_ERR_INVALID_ARGUMENT,
                              "%s: tensor %zu %s max_exp_avg_sq and an earlier one %s: amsgrad needs "
                              "it on every tensor or none", fn, i, has_max ? "has" : "lacks",
                              amsgrad ? "has" : "lacks");
        amsgrad = has_max;
        if (!has_max && t[i].max_exp_avg_sq_out)
            return spw__error(SPW_ERR_INVALID_ARGUMENT,
                              "%s: tensor %zu has max_exp_avg_sq_out but no max_exp_avg_sq", fn, i);
        spw_array a[9] = {{"param", t[i].param, 4},
                          {"grad", t[i].grad, spw_dtype_size(t[i].grad_dtype)},
                          {"exp_avg", t[i].exp_avg, 4},
                          {"exp_avg_sq", t[i].exp_avg_sq, 4},
                          {"max_exp_avg_sq", t[i].max_exp_avg_sq, 4}};
        size_t na = has_max ? 5 : 4;
        /* an output apart from its input is one more array that must not overlap the others */
        const spw_array outs[] = {{"param_out", t[i].param_out, 4},
                                  {"exp_avg_out", t[i].exp_avg_out, 4},
                                  {"exp_avg_sq_out", t[i].exp_avg_sq_out, 4},
                                  {"max_exp_avg_sq_out", t[i].max_exp_avg_sq_out, 4}};
        const float *ins[] = {t[i].param, t[i].exp_avg, t[i].exp_avg_sq, t[i].max_exp_avg_sq};
        for (size_t k = 0; k < 4; k++)
            if (outs[k].ptr && outs[k].ptr != ins[k]) a[na++] = outs[k];
        st = spw_check_arrays(fn, i, t[i].n, a, na);
        if (st) return st;
        if (t[i].n > SIZE_MAX / 16 - total)
            return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: %zu elements in all is absurd", fn, total);
        total += t[i].n;
    }

    spw__adam_coef c;
    memset(&c, 0, sizeof c);
    const double lr = hp->lr, wd = hp->weight_decay, b1 = hp->beta1, b2 = hp->beta2;
    c.gsign = (hp->flags & SPW_ADAM_MAXIMIZE) ? -1.0f : 1.0f;
    c.wd_mul = decoupled ? (float)(1.0 - lr * wd) : 1.0f;
    c.wd = (float)wd;
    c.coupled_wd = !decoupled && wd != 0.0;
    c.beta1 = (float)b1;
    c.one_minus_beta1 = (float)(1.0 - b1);
    c.lerp_small = fabsf(c.one_minus_beta1) < 0.5f;
    c.lerp_coef = c.lerp_small ? c.one_minus_beta1 : c.one_minus_beta1 - 1.0f;
    c.mul_add = (hp->flags & SPW_ADAM_MOMENT_MUL_ADD) != 0;
    c.beta2 = (float)b2;
    c.one_minus_beta2 = (float)(1.0 - b2);
    const double step = (double)hp->step;
    const double bc1 = 1.0 - pow(b1, step), bc2 = 1.0 - pow(b2, step);
    c.neg_step_size = (float)(-(lr / bc1));
    c.bc2_sqrt = (float)sqrt(bc2);
    c.eps = (float)hp->eps;
    c.amsgrad = amsgrad == 1;

    spw_job job = {.coef = &c, .tensors = t, .count = count, .total = total, .adam = 1};
    return spw_run_job(pool, &job);
}

SPW_API spw_status spw_adam_step(spw_optim_pool *pool, const spw_adam_hparams *hp,
                                 const spw_adam_tensor *tensors, size_t count) {
    return spw_adam("spw_adam_step", 0, pool, hp, tensors, count);
}

SPW_API spw_status spw_adamw_step(spw_optim_pool *pool, const spw_adam_hparams *hp,
                                  const spw_adam_tensor *tensors, size_t count) {
    return spw_adam("spw_adamw_step", 1, pool, hp, tensors, count);
}

/* ---- SGD ---- */

SPW_API spw_status spw_sgd_step(spw_optim_pool *pool, const spw_sgd_hparams *hp,
                                const spw_sgd_tensor *t, size_t count) {
    const char *fn = "spw_sgd_step";
    if (!hp) return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: hparams is NULL", fn);
    if (count && !t)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: tensors is NULL (count = %zu)", fn, count);
    if (!spw_nonneg(hp->lr))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: lr = %g (want a finite value >= 0)", fn, hp->lr);
    if (!spw_nonneg(hp->momentum))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: momentum = %g (want a finite value >= 0)", fn,
                          hp->momentum);
    if (!isfinite(hp->dampening))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: dampening = %g (want a finite value)", fn,
                          hp->dampening);
    if (!spw_nonneg(hp->weight_decay))
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "%s: weight_decay = %g (want a finite value >= 0)", fn, hp->weight_decay);
    const unsigned known = SPW_SGD_MAXIMIZE | SPW_SGD_NESTEROV | SPW_SGD_FIRST_STEP;
    if (hp->flags & ~known)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", fn, hp->flags & ~known);
    int nesterov = (hp->flags & SPW_SGD_NESTEROV) != 0;
    if (nesterov && (hp->momentum <= 0.0 || hp->dampening != 0.0))
        return spw__error(SPW_ERR_INVALID_ARGUMENT,
                          "%s: nesterov needs momentum > 0 and dampening 0 (momentum = %g, "
                          "dampening = %g)", fn, hp->momentum, hp->dampening);
    int has_momentum = hp->momentum != 0.0;

    size_t total = 0;
    for (size_t i = 0; i < count; i++) {
        spw_status st = spw_check_dtype(fn, i, t[i].grad_dtype);
        if (st) return st;
        if (t[i].n == 0) continue;
        spw_array a[] = {{"param", t[i].param, 4},
                         {"grad", t[i].grad, spw_dtype_size(t[i].grad_dtype)},
                         {"momentum_buffer", t[i].momentum_buffer, 4}};
        st = spw_check_arrays(fn, i, t[i].n, a, has_momentum ? 3 : 2);
        if (st) return st;
        if (t[i].n > SIZE_MAX / 16 - total)
            return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: %zu elements in all is absurd", fn, total);
        total += t[i].n;
    }

    spw__sgd_coef c;
    memset(&c, 0, sizeof c);
    c.gsign = (hp->flags & SPW_SGD_MAXIMIZE) ? -1.0f : 1.0f;
    c.wd = (float)hp->weight_decay;
    c.has_wd = hp->weight_decay != 0.0;
    c.momentum = (float)hp->momentum;
    c.one_minus_dampening = (float)(1.0 - hp->dampening);
    c.neg_lr = (float)(-hp->lr);
    c.has_momentum = has_momentum;
    c.first_step = (hp->flags & SPW_SGD_FIRST_STEP) != 0;
    c.nesterov = nesterov;

    spw_job job = {.coef = &c, .tensors = t, .count = count, .total = total, .adam = 0};
    return spw_run_job(pool, &job);
}
