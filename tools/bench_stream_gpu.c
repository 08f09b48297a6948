/*
 * spillway bench stream, the CUDA side (built only with SPW_HAVE_CUDA): the pinned host to
 * device link rate, the all-resident reference (the same chain of cuBLAS products on cudaMalloc'd
 * weights, timed) and the cuBLAS product the runs enqueue. The bf16 product is cublasGemmEx
 * (CUDA_R_16BF in and out, CUBLAS_COMPUTE_32F) in the reference and in the runs alike, so the
 * runs' outputs are expected bitwise equal to the reference.
 */
#include <stdlib.h>
#include <string.h>

#include "bench_stream.h"

/* The file name in a __FILE__ path, for the messages of CK and BK. */
static const char *bs_base(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

void bs_cuda_fail(const char *call, cudaError_t e, const char *file, int line) {
    fprintf(stderr, "spillway bench stream: %s failed (%s:%d): %s: %s\n", call,
            bs_base(file), line, cudaGetErrorName(e), cudaGetErrorString(e));
}
void bs_blas_fail(const char *call, cublasStatus_t s, const char *file, int line) {
    fprintf(stderr, "spillway bench stream: %s failed (%s:%d): %s: %s\n", call,
            bs_base(file), line, cublasGetStatusName(s), cublasGetStatusString(s));
}

/* Y = X W (row-major X: batch x K, W: K x K) on stream s: in cuBLAS's column-major terms
 * Y^T = W^T X^T, which is W read with lda K times X read with ldb K. */
int bs_gpu_gemm(bench *B, const void *x, const void *w, void *y, cudaStream_t s) {
    const float alpha = 1.0f, beta = 0.0f;
    int K = (int)B->K, n = (int)B->o.batch;
    BK(cublasSetStream(B->blas, s));
    BK(cublasGemmEx(B->blas, CUBLAS_OP_N, CUBLAS_OP_N, K, n, K, &alpha, w, CUDA_R_16BF, K, x,
                    CUDA_R_16BF, K, &beta, y, CUDA_R_16BF, K, CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT));
    return 0;
fail:
    return 1;
}

/* Pinned host -> device rate, 1 GiB, best of 3 (after one warm-up copy). Not fatal: a failure
 * leaves link_gbps < 0 and says so. */
void bs_gpu_link_rate(bench *B) {
    const size_t bytes = SPW_GiB;
    void *h = NULL, *d = NULL;
    cudaStream_t s = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float best = 0;
    CK(cudaHostAlloc(&h, bytes, cudaHostAllocDefault));
    CK(cudaMalloc(&d, bytes));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    memset(h, 0x5a, bytes);
    CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s));
    for (int i = 0; i < 3; i++) {
        float ms;
        CK(cudaEventRecord(e0, s));
        CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (best == 0 || ms < best) best = ms;
    }
    B->link_gbps = (double)bytes / ((double)best * 1e6);
fail:
    if (B->link_gbps < 0)
        fprintf(stderr, "spillway bench stream: could not measure the link rate: no link bound\n");
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (s) cudaStreamDestroy(s);
    cudaFree(d);
    cudaFreeHost(h);
}

/* The reference: the same chain on weights in plain cudaMalloc memory, timed over the same
 * number of passes. When the model does not fit in free device memory, the layers are staged one
 * at a time through one buffer: the same products (same result), but no all-resident time. */
int bs_gpu_reference(bench *B) {
    size_t free_b = 0, total_b = 0, ab = B->act_bytes;
    long N = B->o.layers, P = B->o.passes;
    char *w = NULL, *act = NULL;
    cudaStream_t s = NULL;
    cudaEvent_t *ev = calloc((size_t)P + 1, sizeof *ev);
    double *ms = calloc((size_t)P, sizeof *ms);
    int rc = 1;
    if (!ev || !ms) goto fail;
    CK(cudaMemGetInfo(&free_b, &total_b));
    bool resident = B->model_bytes + 3 * ab + 512 * SPW_MiB <= free_b;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc((void **)&act, 3 * ab));
    CK(cudaMalloc((void **)&w, resident ? B->model_bytes : B->layer_bytes));
    CK(cudaMemcpy(act + 2 * ab, B->x0, ab, cudaMemcpyHostToDevice));
    if (!resident) {
        B->ref_how = "cuBLAS, layers staged one at a time (the model does not fit all-resident)";
        CK(cudaMemcpyAsync(act, act + 2 * ab, ab, cudaMemcpyDeviceToDevice, s));
        for (long l = 0; l < N; l++) {
            CK(cudaMemcpyAsync(w, (char *)B->weights + (size_t)l * B->stride, B->layer_bytes,
                               cudaMemcpyHostToDevice, s));
            if (bs_gpu_gemm(B, act + (size_t)(l % 2) * ab, w, act + (size_t)((l + 1) % 2) * ab, s)) goto fail;
            CK(cudaStreamSynchronize(s));
        }
    } else {
        B->ref_how = "cuBLAS on all-resident weights (cudaMalloc)";
        for (long l = 0; l < N; l++)
            CK(cudaMemcpy(w + (size_t)l * B->layer_bytes, (char *)B->weights + (size_t)l * B->stride,
                          B->layer_bytes, cudaMemcpyHostToDevice));
        for (long p = 0; p <= P; p++) CK(cudaEventCreate(&ev[p]));
        CK(cudaEventRecord(ev[0], s));
        for (long p = 0; p < P; p++) {
            CK(cudaMemcpyAsync(act, act + 2 * ab, ab, cudaMemcpyDeviceToDevice, s));
            for (long l = 0; l < N; l++)
                if (bs_gpu_gemm(B, act + (size_t)(l % 2) * ab, w + (size_t)l * B->layer_bytes,
                                act + (size_t)((l + 1) % 2) * ab, s)) goto fail;
            CK(cudaEventRecord(ev[p + 1], s));
        }
        CK(cudaStreamSynchronize(s));
        for (long p = 0; p < P; p++) {
            float m;
            CK(cudaEventElapsedTime(&m, ev[p], ev[p + 1]));
            ms[p] = m;
        }
        B->all_resident_ms = bs_median_from(ms, (size_t)P, 1);
    }
    CK(cudaMemcpy(B->ref, act + (size_t)(N % 2) * ab, ab, cudaMemcpyDeviceToHost));
    rc = 0;
fail:
    for (long p = 0; ev && p <= P; p++)
        if (ev[p]) cudaEventDestroy(ev[p]);
    if (s) cudaStreamDestroy(s);
    cudaFree(w);
    cudaFree(act);
    free(ev);
    free(ms);
    return rc;
}

int bs_ltimes_create(const bench *B, bs_ltimes *t) {
    t->N = B->o.layers;
    t->P = B->o.passes;
    t->ev = NULL;
    if (!B->o.layer_times) return 0;
    if (!(t->ev = calloc((size_t)(t->N * t->P), sizeof *t->ev))) return 1;
    for (long i = 0; i < t->N * t->P; i++) CK(cudaEventCreate(&t->ev[i]));
    return 0;
fail:
    return 1;
}

int bs_ltimes_mark(bs_ltimes *t, long p, long l, cudaStream_t s) {
    if (t->ev) CK(cudaEventRecord(t->ev[p * t->N + l], s));
    return 0;
fail:
    return 1;
}

int bs_ltimes_finish(bs_ltimes *t, const cudaEvent_t *pass_start, double **layer_ms) {
    if (!t->ev) return 0;
    long from = BS_STEADY_FROM(t->P), n = t->P - from;
    double *v = calloc((size_t)n, sizeof *v), *out = calloc((size_t)t->N, sizeof *out);
    if (!v || !out) goto fail;
    for (long l = 0; l < t->N; l++) {
        for (long p = from; p < t->P; p++) {
            float ms;
            CK(cudaEventElapsedTime(&ms, pass_start[p], t->ev[p * t->N + l]));
            v[p - from] = ms;
        }
        out[l] = bs_median_from(v, (size_t)n, 0);
    }
    free(v);
    *layer_ms = out;
    return 0;
fail:
    free(v);
    free(out);
    return 1;
}

void bs_ltimes_destroy(bs_ltimes *t) {
    for (long i = 0; t->ev && i < t->N * t->P; i++)
        if (t->ev[i]) cudaEventDestroy(t->ev[i]);
    free(t->ev);
    t->ev = NULL;
}
