/*
 * Host optimizer internals: the worker pool (optim_pool.c), the per-instruction-set element
 * kernels (optim_kernel.h, compiled once per set by optim_kernel_*.c) and the entry points
 * that check arguments and split the work (optim_step.c).
 */
#ifndef SPW_OPTIM_H
#define SPW_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "spillway_optim.h"

/* ---- optim_pool.c ---- */

/* Work for one pool run: fn(arg, part, parts) is called once for each part in [0, parts), each
 * on a different thread (part 0 on the caller). */
typedef void (*spw__pool_fn)(void *arg, unsigned part, unsigned parts);

/* Run fn over `parts` parts (1 <= parts <= the pool's threads) and return when all are done.
 * parts == 1, or a pool inherited through fork(), runs every part on the caller. */
void spw__pool_run(spw_optim_pool *pool, unsigned parts, spw__pool_fn fn, void *arg);
/* The process-wide pool (spw_adam_step with pool NULL), started on first use; NULL when it
 * could not be started, with the message set. */
spw_optim_pool *spw__pool_default(void);
/* CPUs this process may run on (at least 1). */
unsigned spw__cpus_allowed(void);

/* ---- the element kernels ---- */

/* Adam's per-call constants, each converted to fp32 where torch converts the Python scalar. */
typedef struct spw__adam_coef {
    float gsign;         /* -1 for maximize, else 1 */
    float wd_mul;        /* AdamW: 1 - lr * weight_decay; Adam: 1 (exact no-op) */
    float wd;            /* Adam's L2 term; used when coupled_wd */
    float beta1, one_minus_beta1;
    float lerp_coef;     /* torch's lerp: weight when |weight| < 0.5, else weight - 1 */
    float beta2, one_minus_beta2;
    float bc2_sqrt;      /* sqrt(1 - beta2^step), computed in double */
    float eps;
    float neg_step_size; /* -lr / (1 - beta1^step), computed in double */
    int coupled_wd;      /* Adam with weight_decay != 0 */
    int lerp_small;      /* lerp's weight below 0.5: base is exp_avg, else the gradient */
    int mul_add;         /* SPW_ADAM_MOMENT_MUL_ADD */
    int amsgrad;
} spw__adam_coef;

typedef struct spw__sgd_coef {
    float gsign;
    float wd;            /* used when weight_decay != 0 */
    float momentum;
    float one_minus_dampening;
    float neg_lr;
    int has_wd;
    int has_momentum;
    int first_step;
    int nesterov;
} spw__sgd_coef;

/* Update elements [lo, hi) of one tensor. */
typedef void (*spw__adam_kernel_fn)(const spw__adam_coef *c, const spw_adam_tensor *t, size_t lo,
                                     size_t hi);
typedef void (*spw__sgd_kernel_fn)(const spw__sgd_coef *c, const spw_sgd_tensor *t, size_t lo,
                                    size_t hi);

void spw__adam_kernel_generic(const spw__adam_coef *c, const spw_adam_tensor *t, size_t lo, size_t hi);
void spw__sgd_kernel_generic(const spw__sgd_coef *c, const spw_sgd_tensor *t, size_t lo, size_t hi);
#if defined(__x86_64__)
void spw__adam_kernel_avx2(const spw__adam_coef *c, const spw_adam_tensor *t, size_t lo, size_t hi);
void spw__sgd_kernel_avx2(const spw__sgd_coef *c, const spw_sgd_tensor *t, size_t lo, size_t hi);
void spw__adam_kernel_avx512(const spw__adam_coef *c, const spw_adam_tensor *t, size_t lo, size_t hi);
void spw__sgd_kernel_avx512(const spw__sgd_coef *c, const spw_sgd_tensor *t, size_t lo, size_t hi);
#endif

/* ---- optim_step.c ---- */

/* Force the instruction set ("generic", "avx2", "avx512"; NULL: back to the best this CPU has),
 * for tests that compare them. SPW_ERR_UNSUPPORTED when this CPU or build lacks it. Not
 * thread-safe against running steps. */
spw_status spw__optim_force_isa(const char *name);

#endif /* SPW_OPTIM_H */
