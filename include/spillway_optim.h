/*
 * spillway host optimizer step: Adam, AdamW and SGD over fp32 arrays in host memory,
 * multi-threaded and vectorized, computing what PyTorch's single-tensor path computes.
 *
 * Equality with PyTorch: each element goes through the operations torch.optim's
 * `foreach=False` path applies on a CPU, in the same order and precision (fp32 arithmetic,
 * hyper-parameters converted to fp32 where torch converts them, bias corrections in double as
 * torch's Python computes them, fused multiply-adds where torch's vectorized kernels use them).
 * The result of one element does not depend on the thread count, the instruction set chosen at
 * run time, or where the array is split.
 *
 * Thread safety: every function may be called from any thread. Calls on one pool run one at a
 * time (a second caller waits); different pools run concurrently. The arrays of a call must not
 * be written by anyone else while it runs.
 *
 * Errors: a call returns an spw_status; on failure spw_last_error() names the bad argument and
 * its value, and no array has been touched (every argument is checked before any work starts).
 */
#ifndef SPILLWAY_OPTIM_H
#define SPILLWAY_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "spillway.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element type of a gradient array. Parameters and optimizer states are always fp32; a bf16 or
 * fp16 gradient is widened to fp32 exactly, as torch's type promotion does. */
typedef enum spw_optim_dtype {
    SPW_OPTIM_F32 = 0,
    SPW_OPTIM_BF16 = 1,
    SPW_OPTIM_F16 = 2,
} spw_optim_dtype;

/* ---- worker pool ----
 * A step's elements are split into contiguous ranges, one per thread; the calling thread
 * takes one range itself. Workers sleep between calls. A step small enough that waking workers
 * would cost more than it saves runs on the calling thread alone. After fork() a pool runs
 * everything on the calling thread (its workers exist only in the parent). */
typedef struct spw_optim_pool spw_optim_pool;

/* A pool of `threads` threads in all, the caller included (threads - 1 workers are started);
 * 0 means the CPUs this process may run on (sched_getaffinity). At most 1024. */
SPW_API spw_status spw_optim_pool_create(unsigned threads, spw_optim_pool **out);
/* Stops and joins the workers. NULL is a no-op. Not while a call on the pool runs. */
SPW_API void spw_optim_pool_destroy(spw_optim_pool *pool);
/* Threads the pool runs a step on, the caller included; 0 for NULL. */
SPW_API unsigned spw_optim_pool_threads(const spw_optim_pool *pool);

/* ---- Adam and AdamW ----
 * torch.optim.Adam / AdamW (foreach=False, fused=False, capturable=False, differentiable=False),
 * one parameter tensor per spw_adam_tensor. Per element, with g the gradient (negated when
 * maximize), b1 = beta1, b2 = beta2:
 *   AdamW: p = p * (1 - lr * weight_decay)
 *   Adam:  g = g + weight_decay * p                       (only when weight_decay != 0)
 *   m = lerp(m, g, 1 - b1)                                (SPW_ADAM_MOMENT_MUL_ADD: m * b1 + g * (1 - b1))
 *   v = v * b2 + (1 - b2) * g * g
 *   vmax = max(vmax, v)                                   (amsgrad: max_exp_avg_sq not NULL)
 *   p = p - step_size * m / (sqrt(v or vmax) / sqrt(1 - b2^step) + eps),  step_size = lr / (1 - b1^step)
 */
typedef struct spw_adam_tensor {
    float *param;
    const void *grad;        /* grad_dtype elements */
    float *exp_avg;          /* first moment (torch: state["exp_avg"]) */
    float *exp_avg_sq;       /* second moment (state["exp_avg_sq"]) */
    float *max_exp_avg_sq;   /* amsgrad's running maximum (state["max_exp_avg_sq"]), or NULL:
                              * amsgrad is on for a call when every tensor has one, off when none
                              * has; a mix is an error */
    size_t n;                /* elements in each array; 0 is allowed (nothing is done) */
    spw_optim_dtype grad_dtype;
    /* Where the updated values go; NULL (or the input itself): in place. An output that is not
     * its input must not overlap any array of its tensor; the inputs are then only read, so an
     * update can be computed ahead and kept or dropped. Last, so that an initializer that
     * leaves them out updates in place. */
    float *param_out;
    float *exp_avg_out;
    float *exp_avg_sq_out;
    float *max_exp_avg_sq_out; /* only with max_exp_avg_sq */
} spw_adam_tensor;

enum {
    SPW_ADAM_MAXIMIZE = 1u << 0, /* torch's maximize=True: step along the gradient */
    /* The first moment as torch 1.x computes it (exp_avg.mul_(beta1).add_(grad, alpha=1-beta1))
     * instead of torch 2's exp_avg.lerp_(grad, 1-beta1); the two differ in the last bit. */
    SPW_ADAM_MOMENT_MUL_ADD = 1u << 1,
};

typedef struct spw_adam_hparams {
    double lr;           /* >= 0 */
    double beta1, beta2; /* in [0, 1) */
    double eps;          /* >= 0 */
    double weight_decay; /* >= 0 */
    int64_t step;        /* the step this update makes, >= 1: torch's state["step"] after its
                          * increment (1 on a parameter's first update) */
    unsigned flags;      /* SPW_ADAM_* */
} spw_adam_hparams;

/* One Adam (L2 weight decay added to the gradient) or AdamW (decoupled weight decay) update of
 * count tensors, on pool (NULL: a process-wide pool with one thread per CPU the process may
 * run on, started on first use). The arrays of one tensor must not overlap each other; arrays
 * must be aligned to their element size. count = 0 is allowed. */
SPW_API spw_status spw_adam_step(spw_optim_pool *pool, const spw_adam_hparams *hp,
                                 const spw_adam_tensor *tensors, size_t count);
SPW_API spw_status spw_adamw_step(spw_optim_pool *pool, const spw_adam_hparams *hp,
                                  const spw_adam_tensor *tensors, size_t count);

/* ---- SGD ----
 * torch.optim.SGD (foreach=False). Per element, with g the gradient (negated when maximize):
 *   g = g + weight_decay * p                              (only when weight_decay != 0)
 *   buf = g on the first step, else buf * momentum + (1 - dampening) * g   (only when momentum != 0)
 *   g = nesterov ? g + momentum * buf : buf                (only when momentum != 0)
 *   p = p - lr * g
 */
typedef struct spw_sgd_tensor {
    float *param;
    const void *grad;        /* grad_dtype elements */
    float *momentum_buffer;  /* state["momentum_buffer"]; NULL allowed when momentum == 0 */
    size_t n;
    spw_optim_dtype grad_dtype;
} spw_sgd_tensor;

enum {
    SPW_SGD_MAXIMIZE = 1u << 0,
    SPW_SGD_NESTEROV = 1u << 1,       /* needs momentum > 0 and dampening == 0, as torch */
    /* The momentum buffers hold nothing yet (torch's None on a parameter's first step): they
     * are set to the gradient, undamped. */
    SPW_SGD_FIRST_STEP = 1u << 2,
};

typedef struct spw_sgd_hparams {
    double lr;           /* >= 0 */
    double momentum;     /* >= 0 */
    double dampening;    /* finite */
    double weight_decay; /* >= 0 */
    unsigned flags;      /* SPW_SGD_* */
} spw_sgd_hparams;

SPW_API spw_status spw_sgd_step(spw_optim_pool *pool, const spw_sgd_hparams *hp,
                                const spw_sgd_tensor *tensors, size_t count);

/* The instruction set the steps run with on this CPU ("avx512", "avx2", "generic"). */
SPW_API const char *spw_optim_isa(void);

/* ---- the process's heap, for a framework's own host step ----
 * A host step that spillway does not run itself (torch.optim's CPU step of an optimizer other
 * than these) allocates temporaries the size of each parameter and frees them within the step.
 * glibc serves an allocation above its mmap threshold (which its own rule raises to 32 MiB at
 * most) with a fresh mapping, and returns freed memory at the heap's top beyond its trim
 * threshold, so such a step faults every page of its large temporaries in again, every step.
 * This keeps allocations of up to `bytes` in the heap and up to four times that of freed memory
 * at its top (mallopt's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, never below glibc's 32 MiB), for
 * the whole process: the step reuses its pages, and the process holds at most that much more
 * memory between steps. The kept size only grows over calls (a smaller `bytes` keeps what an
 * earlier call set). A process that set glibc's malloc thresholds itself (MALLOC_MMAP_THRESHOLD_,
 * MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_MAX_ or GLIBC_TUNABLES naming them, in the environment)
 * keeps its own: nothing is changed. *kept (may be NULL), on success: the allocation size now
 * kept by this call or an earlier one, 0 where the process's own thresholds stand.
 * SPW_ERR_INVALID_ARGUMENT for 0 or more than 2 GiB less 1 MiB (mallopt's values are ints; the
 * trim threshold is capped there too); SPW_ERR_UNSUPPORTED where the C library is not glibc or
 * mallopt refuses the thresholds (glibc versions that cap the mmap threshold at 32 MiB, a
 * sanitizer's allocator). Thread-safe. */
SPW_API spw_status spw_optim_keep_freed(size_t bytes, size_t *kept);

#ifdef __cplusplus
}
#endif

#endif /* SPILLWAY_OPTIM_H */
