/*
 * The cuda backend on a real device: every vtable entry, checked against data and against the
 * CUDA runtime's own view. Without a usable device only the first test runs (creation fails
 * cleanly), then the program exits TEST_SKIP_EXIT: ctest reports it skipped, a GPU-only test.
 */
#include "test_util.h"

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- helpers ---- */

static spw_backend *open_backend(void) {
    if (!spw__backend_cuda_available()) skip();
    spw_backend_params p;
    memset(&p, 0, sizeof p);
    spw_backend *b = NULL;
    assert_ok(spw__backend_cuda_create(&p, &b));
    assert_non_null(b);
    assert_non_null(b->ops);
    assert_string_equal(b->ops->name, "cuda");
    assert_int_equal(b->device, 0);
    return b;
}

static spw_device_info info_of(spw_backend *b) {
    spw_device_info d;
    memset(&d, 0xab, sizeof d);
    assert_ok(b->ops->device_info(b, &d));
    return d;
}

/* Deterministic bytes, none of them 0 (so a zeroed or unwritten destination never matches). */
static void fill(void *p, size_t n, uint64_t seed) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1, x = 0;
    unsigned char *c = p;
    for (size_t i = 0; i < n; i++) {
        if (i % 8 == 0) x = test_rand(&s);
        unsigned char v = (unsigned char)(x >> (8 * (i % 8)));
        c[i] = v ? v : 0x5c;
    }
}

/* Byte-for-byte check of got[0..n) against fill(seed) starting at pattern offset `off`. */
static void check_pattern(const void *got, size_t n, uint64_t seed, size_t off, const char *what) {
    unsigned char *want = malloc(off + n);
    assert_non_null(want);
    fill(want, off + n, seed);
    const unsigned char *g = got;
    for (size_t i = 0; i < n; i++)
        if (g[i] != want[off + i]) {
            unsigned w = want[off + i], h = g[i];
            free(want);
            fail_msg("%s: byte %zu of %zu is 0x%02x, want 0x%02x", what, i, n, h, w);
        }
    free(want);
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* The runtime's last-error slot must be clean after every spillway call, failed or not. */
static void assert_runtime_clean(void) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) fail_msg("cudaGetLastError = %s (%d)", cudaGetErrorString(e), (int)e);
}

static enum cudaMemoryType mem_type(const void *p) {
    struct cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) fail_msg("cudaPointerGetAttributes(%p): %s", p, cudaGetErrorString(e));
    return a.type;
}

/* ---- availability and creation (also runs without a GPU) ---- */

static void test_create_and_availability(void **state) {
    (void)state;
    int avail = spw__backend_cuda_available();
    assert_int_equal(avail, spw__backend_cuda_available()); /* stable, no side effect */
    spw_backend_params p;
    memset(&p, 0, sizeof p);
    spw_backend *b = (spw_backend *)&p; /* sentinel: must stay untouched on failure */
    if (!avail) {
        spw__error_clear();
        assert_status(spw__backend_cuda_create(&p, &b), SPW_ERR_NO_DEVICE);
        assert_ptr_equal(b, (spw_backend *)&p);
        assert_non_null(strstr(spw_last_error(), "cuda"));
        assert_int_equal(spw__backend_cuda_available(), 0); /* still quiet afterwards */
        return;
    }
    int n = 0;
    assert_int_equal(cudaGetDeviceCount(&n), cudaSuccess);
    p.device = n;
    assert_status(spw__backend_cuda_create(&p, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_ptr_equal(b, (spw_backend *)&p);
    assert_non_null(strstr(spw_last_error(), "does not exist"));
    p.device = -1;
    assert_status(spw__backend_cuda_create(&p, &b), SPW_ERR_INVALID_ARGUMENT);
    assert_ptr_equal(b, (spw_backend *)&p);
    assert_status(spw__backend_cuda_create(&p, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_runtime_clean();
    /* NULL params: device 0 */
    b = NULL;
    assert_ok(spw__backend_cuda_create(NULL, &b));
    assert_int_equal(b->device, 0);
    b->ops->destroy(b);
}

static void test_device_info(void **state) {
    (void)state;
    spw_backend *b = open_backend();
    spw_device_info d = info_of(b);
    struct cudaDeviceProp prop;
    assert_int_equal(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    assert_string_equal(d.name, prop.name);
    assert_int_equal(d.cc_major, prop.major);
    assert_int_equal(d.cc_minor, prop.minor);
    assert_true(d.cc_major >= 7); /* CUDA 13 supports nothing older */
    assert_int_equal(d.emulated, 0);
    assert_true(d.total_bytes >= SPW_GiB);
    assert_true(d.free_bytes > 0 && d.free_bytes <= d.total_bytes);
    int v = -1;
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrConcurrentManagedAccess, 0), cudaSuccess);
    assert_int_equal(d.concurrent_managed_access, v != 0);
    assert_int_equal(cudaDeviceGetAttribute(&v, cudaDevAttrPageableMemoryAccess, 0), cudaSuccess);
    assert_int_equal(d.pageable_memory_access, v != 0);
    assert_true(d.vmm_supported == 0 || d.vmm_supported == 1);
    if (d.vmm_supported) {
        assert_true(d.vmm_granularity >= 64 * SPW_KiB);
        assert_int_equal(d.vmm_granularity & (d.vmm_granularity - 1), 0);
        assert_non_null(b->ops->va_reserve);
        assert_non_null(b->ops->map);
        assert_non_null(b->ops->unmap);
        assert_non_null(b->ops->va_release);
    } else {
        assert_int_equal(d.vmm_granularity, 0);
        assert_null(b->ops->va_reserve);
        assert_null(b->ops->map);
    }
    print_message("device: %s, cc %d.%d, %zu MiB total, %zu MiB free, vmm %d (granule %zu KiB), "
                  "managed %d, pageable %d\n",
                  d.name, d.cc_major, d.cc_minor, d.total_bytes >> 20, d.free_bytes >> 20,
                  d.vmm_supported, d.vmm_granularity >> 10, d.concurrent_managed_access,
                  d.pageable_memory_access);
    assert_status(b->ops->device_info(b, NULL), SPW_ERR_INVALID_ARGUMENT);

    /* mem_info agrees with device_info and sees a 1 GiB allocation. */
    size_t f0 = 0, t0 = 0, f1 = 0, t1 = 0;
    assert_ok(b->ops->mem_info(b, &f0, &t0));
    assert_int_equal(t0, d.total_bytes);
    assert_true(f0 <= t0);
    if (f0 > 2 * SPW_GiB) {
        void *p = NULL;
        assert_ok(b->ops->dev_alloc(b, SPW_GiB, &p));
        assert_ok(b->ops->mem_info(b, &f1, &t1));
        assert_int_equal(t1, t0);
        if (!(f1 + SPW_GiB <= f0 + 64 * SPW_MiB))
            fail_msg("free %zu -> %zu after a 1 GiB cudaMalloc", f0, f1);
        assert_ok(b->ops->dev_free(b, p));
    }
    assert_runtime_clean();
    b->ops->destroy(b);
}

/* ---- device memory and copies ---- */

static void roundtrip(spw_backend *b, size_t n, spw_stream s, int pinned, uint64_t seed) {
    const spw_backend_ops *o = b->ops;
    void *src = NULL, *dst = NULL, *d1 = NULL, *d2 = NULL, *h2 = NULL;
    if (pinned) {
        assert_ok(o->host_alloc(b, n, &src));
        assert_ok(o->host_alloc(b, n, &dst));
        assert_int_equal(mem_type(src), cudaMemoryTypeHost);
    } else {
        src = malloc(n);
        dst = malloc(n);
        assert_non_null(src);
        assert_non_null(dst);
    }
    h2 = malloc(n);
    assert_non_null(h2);
    fill(src, n, seed);
    memset(dst, 0, n);
    memset(h2, 0, n);
    assert_ok(o->dev_alloc(b, n, &d1));
    assert_ok(o->dev_alloc(b, n, &d2));
    assert_int_equal((uintptr_t)d1 % 256, 0);
    assert_int_equal(mem_type(d1), cudaMemoryTypeDevice);
    /* d2 starts as zeros so a skipped D2D would show (legacy stream: finish before s runs) */
    assert_int_equal(cudaMemset(d2, 0, n), cudaSuccess);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    assert_ok(o->memcpy_async(b, d1, src, n, SPW_COPY_H2D, s));
    assert_ok(o->memcpy_async(b, d2, d1, n, SPW_COPY_D2D, s));
    assert_ok(o->memcpy_async(b, dst, d2, n, SPW_COPY_D2H, s));
    assert_ok(o->memcpy_async(b, h2, dst, n, SPW_COPY_H2H, s));
    assert_ok(o->stream_sync(b, s));
    check_pattern(dst, n, seed, 0, pinned ? "H2D/D2D/D2H via pinned" : "H2D/D2D/D2H via pageable");
    check_pattern(h2, n, seed, 0, "H2H");
    assert_ok(o->dev_free(b, d1));
    assert_ok(o->dev_free(b, d2));
    if (pinned) {
        assert_ok(o->host_free(b, src));
        assert_ok(o->host_free(b, dst));
    } else {
        free(src);
        free(dst);
    }
    free(h2);
}

static void test_dev_alloc_and_copies(void **state) {
    (void)state;
    spw_backend *b = open_backend();
    spw_stream s = NULL;
    assert_ok(b->ops->stream_create(b, &s));
    assert_non_null(s);
    const size_t sizes[] = {1, 4099, 8 * SPW_MiB + 13, 256 * SPW_MiB};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        roundtrip(b, sizes[i], s, 1, 100 + i);
        roundtrip(b, sizes[i], NULL, 0, 200 + i); /* default stream, pageable host memory */
    }
    assert_ok(b->ops->stream_destroy(b, s));
    assert_status(b->ops->stream_destroy(b, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(b->ops->memcpy_async(b, NULL, NULL, 0, SPW_COPY_H2D, NULL)); /* empty copy */
    assert_status(b->ops->memcpy_async(b, &s, &s, 1, (spw_copy_kind)7, NULL),
                  SPW_ERR_INVALID_ARGUMENT);
    assert_runtime_clean();
    b->ops->destroy(b);
}

/* A failed call reports the call and the numbers and leaves the runtime usable. */
static void test_errors_not_sticky(void **state) {
    (void)state;
    spw_backend *b = open_backend();
    const spw_backend_ops *o = b->ops;
    spw_device_info d = info_of(b);
    void *p = (void *)&d; /* sentinel */
    size_t huge = d.total_bytes * 2;
    assert_status(o->dev_alloc(b, huge, &p), SPW_ERR_OUT_OF_MEMORY);
    assert_ptr_equal(p, (void *)&d);
    assert_non_null(strstr(spw_last_error(), "cudaMalloc"));
    char num[32];
    snprintf(num, sizeof num, "%zu", huge);
    assert_non_null(strstr(spw_last_error(), num));
    assert_runtime_clean();
    assert_status(o->dev_alloc(b, 0, &p), SPW_ERR_INVALID_ARGUMENT);

    int local = 0;
    assert_status(o->dev_free(b, &local), SPW_ERR_BACKEND); /* a host stack address */
    assert_non_null(strstr(spw_last_error(), "cudaFree"));
    assert_runtime_clean();

    assert_status(o->host_alloc(b, (size_t)1 << 50, &p), SPW_ERR_HOST_OUT_OF_MEMORY);
    assert_non_null(strstr(spw_last_error(), "cudaHostAlloc"));
    assert_runtime_clean();

    /* still fully usable */
    roundtrip(b, 1 * SPW_MiB, NULL, 1, 7);
    assert_ok(o->dev_free(b, NULL));
    assert_ok(o->host_free(b, NULL));
    b->ops->destroy(b);
}

/* ---- pinned host memory ---- */

static void test_host_register(void **state) {
    (void)state;
    spw_backend *b = open_backend();
    const spw_backend_ops *o = b->ops;
    const size_t n = 8 * SPW_MiB;
    void *user = NULL;
    assert_int_equal(posix_memalign(&user, 4096, n), 0);
    memset(user, 0, n);
    assert_int_equal(mem_type(user), cudaMemoryTypeUnregistered);
    assert_ok(o->host_register(b, user, n));
    assert_int_equal(mem_type(user), cudaMemoryTypeHost);
    assert_status(o->host_register(b, user, n), SPW_ERR_STATE);
    assert_non_null(strstr(spw_last_error(), "cudaHostRegister"));
    assert_runtime_clean();

    /* device -> registered memory, asynchronously, on a stream */
    void *src = NULL, *d = NULL;
    spw_stream s = NULL;
    assert_ok(o->host_alloc(b, n, &src));
    assert_ok(o->dev_alloc(b, n, &d));
    assert_ok(o->stream_create(b, &s));
    fill(src, n, 31);
    assert_ok(o->memcpy_async(b, d, src, n, SPW_COPY_H2D, s));
    assert_ok(o->memcpy_async(b, user, d, n, SPW_COPY_D2H, s));
    assert_ok(o->stream_sync(b, s));
    check_pattern(user, n, 31, 0, "D2H into registered memory");

    assert_ok(o->host_unregister(b, user));
    assert_int_equal(mem_type(user), cudaMemoryTypeUnregistered);
    assert_status(o->host_unregister(b, user), SPW_ERR_STATE);
    assert_runtime_clean();
    assert_status(o->host_register(b, NULL, n), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(o->stream_destroy(b, s));
    assert_ok(o->dev_free(b, d));
    assert_ok(o->host_free(b, src));
    free(user);
    b->ops->destroy(b);
}

/* ---- streams, events, host functions ---- */

typedef struct gate {
    atomic_int open;
    atomic_int ran;
} gate;

/* Blocks its stream until the test opens the gate (or 10 s pass, so a bug cannot hang CI). */
static void wait_gate(void *arg) {
    gate *g = arg;
    for (int i = 0; i < 10000 && !atomic_load(&g->open); i++) sleep_ms(1);
    atomic_store(&g->ran, 1);
}

static void test_event_query(void **state) {
    (void)state;
    spw_backend *b = open_backend();
    const spw_backend_ops *o = b->ops;
    spw_stream s = NULL;
    spw_event e = NULL;
    assert_ok(o->stream_create(b, &s));
    assert_ok(o->event_create(b, &e));
    assert_non_null(e);

    /* idle stream: complete after sync */
    assert_ok(o->event_record(b, e, s));
    assert_ok(o->event_sync(b, e));
    assert_ok(o->event_query(b, e));

    /* blocked stream: not ready, repeatedly, without poisoning the runtime */
    gate g;
    atomic_init(&g.open, 0);
    atomic_init(&g.ran, 0);
    assert_ok(o->launch_host(b, s, wait_gate, &g));
    assert_ok(o->event_record(b, e, s));
    for (int i = 0; i < 3; i++) {
        assert_status(o->event_query(b, e), SPW_ERR_NOT_READY);
        assert_runtime_clean();
    }
    atomic_store(&g.open, 1);
    assert_ok(o->event_sync(b, e));
    assert_int_equal(atomic_load(&g.ran), 1);
    assert_ok(o->event_query(b, e));

    /* the default stream works for records and waits as well */
    assert_ok(o->event_record(b, e, NULL));
    assert_ok(o->stream_wait(b, s, e));
    assert_ok(o->stream_sync(b, NULL));
    assert_ok(o->stream_sync(b, s));
    assert_ok(o->event_query(b, e));

    assert_status(o->event_query(b, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_status(o->event_destroy(b, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(o->event_destroy(b, e));
    assert_ok(o->stream_destroy(b, s));
    assert_runtime_clean();
    b->ops->destroy(b);
}

typedef struct handoff {
    atomic_int flag;
    int observed;
} handoff;

static void slow_set(void *arg) {
    handoff *h = arg;
    sleep_ms(20);
    atomic_store(&h->flag, 1);
}

static void observe(void *arg) {
    handoff *h = arg;
    h->observed = atomic_load(&h->flag);
}

static void test_cross_stream_wait(void **state) {
    (void)state;
    spw_backend *b = open_backend();
    const spw_backend_ops *o = b->ops;
    spw_stream s1 = NULL, s2 = NULL;
    spw_event e = NULL;
    assert_ok(o->stream_create(b, &s1));
    assert_ok(o->stream_create(b, &s2));
    assert_ok(o->event_create(b, &e));

    for (int round = 0; round < 5; round++) {
        handoff h;
        atomic_init(&h.flag, 0);
        h.observed = -1;
        assert_ok(o->launch_host(b, s1, slow_set, &h));
        assert_ok(o->event_record(b, e, s1));
        assert_ok(o->stream_wait(b, s2, e));
        assert_ok(o->launch_host(b, s2, observe, &h));
        assert_ok(o->stream_sync(b, s2));
        if (h.observed != 1) fail_msg("round %d: s2's callback saw flag %d", round, h.observed);
        assert_ok(o->stream_sync(b, s1));
    }

    /* copies are ordered too: s2 reads d only after s1's delayed write lands */
    const size_t n = 32 * SPW_MiB;
    void *a = NULL, *out = NULL, *d = NULL;
    assert_ok(o->host_alloc(b, n, &a));
    assert_ok(o->host_alloc(b, n, &out));
    assert_ok(o->dev_alloc(b, n, &d));
    fill(a, n, 41);
    memset(out, 0, n);
    assert_int_equal(cudaMemset(d, 0x5a, n), cudaSuccess);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    handoff h;
    atomic_init(&h.flag, 0);
    assert_ok(o->launch_host(b, s1, slow_set, &h));
    assert_ok(o->memcpy_async(b, d, a, n, SPW_COPY_H2D, s1));
    assert_ok(o->event_record(b, e, s1));
    assert_ok(o->stream_wait(b, s2, e));
    assert_ok(o->memcpy_async(b, out, d, n, SPW_COPY_D2H, s2));
    assert_ok(o->stream_sync(b, s2));
    check_pattern(out, n, 41, 0, "D2H on s2 after s1's H2D");

    assert_ok(o->dev_free(b, d));
    assert_ok(o->host_free(b, a));
    assert_ok(o->host_free(b, out));
    assert_ok(o->event_destroy(b, e));
    assert_ok(o->stream_destroy(b, s1));
    assert_ok(o->stream_destroy(b, s2));
    assert_runtime_clean();
    b->ops->destroy(b);
}

typedef struct order_log {
    int seen[64];
    int count;
} order_log;

typedef struct order_item {
    order_log *log;
    int index;
} order_item;

static void append(void *arg) {
    order_item *it = arg;
    it->log->seen[it->log->count++] = it->index;
}

static void test_launch_host_order(void **state) {
    (void)state;
    spw_backend *b = open_backend();
    const spw_backend_ops *o = b->ops;
    spw_stream s = NULL;
    assert_ok(o->stream_create(b, &s));
    for (int pass = 0; pass < 2; pass++) {
        spw_stream on = pass == 0 ? s : NULL;
        order_log log;
        memset(&log, 0, sizeof log);
        order_item items[64];
        for (int i = 0; i < 64; i++) {
            items[i].log = &log;
            items[i].index = i;
            assert_ok(o->launch_host(b, on, append, &items[i]));
        }
        assert_ok(o->stream_sync(b, on));
        assert_int_equal(log.count, 64);
        for (int i = 0; i < 64; i++) assert_int_equal(log.seen[i], i);
    }
    assert_status(o->launch_host(b, s, NULL, NULL), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(o->stream_destroy(b, s));
    b->ops->destroy(b);
}

/* ---- virtual memory ---- */

static void vmm_write(spw_backend *b, void *dst, size_t n, uint64_t seed, size_t off) {
    void *h = NULL;
    assert_ok(b->ops->host_alloc(b, off + n, &h));
    fill(h, off + n, seed);
    assert_ok(b->ops->memcpy_async(b, dst, (char *)h + off, n, SPW_COPY_H2D, NULL));
    assert_ok(b->ops->stream_sync(b, NULL));
    assert_ok(b->ops->host_free(b, h));
}

static void vmm_check(spw_backend *b, const void *src, size_t n, uint64_t seed, size_t off,
                      const char *what) {
    void *h = NULL;
    assert_ok(b->ops->host_alloc(b, n, &h));
    memset(h, 0, n);
    assert_ok(b->ops->memcpy_async(b, h, src, n, SPW_COPY_D2H, NULL));
    assert_ok(b->ops->stream_sync(b, NULL));
    check_pattern(h, n, seed, off, what);
    assert_ok(b->ops->host_free(b, h));
}

/* The backend, its device info in *d; the test is skipped where VMM is unsupported. */
static spw_backend *open_vmm_backend(spw_device_info *d) {
    spw_backend *b = open_backend();
    *d = info_of(b);
    if (!d->vmm_supported) {
        print_message("VMM not supported on %s: skipped\n", d->name);
        b->ops->destroy(b);
        skip();
    }
    return b;
}

static void test_vmm_map_unmap(void **state) {
    (void)state;
    spw_device_info d;
    spw_backend *b = open_vmm_backend(&d);
    const spw_backend_ops *o = b->ops;
    const size_t g = d.vmm_granularity, R = 64 * SPW_GiB;
    size_t free0 = 0;
    assert_ok(o->mem_info(b, &free0, NULL));

    char *va = NULL;
    assert_ok(o->va_reserve(b, R, 0, (void **)&va));
    assert_non_null(va);
    assert_int_equal((uintptr_t)va % g, 0);

    assert_ok(o->map(b, va, 3 * g));
    assert_int_equal(mem_type(va), cudaMemoryTypeDevice);
    vmm_write(b, va, 3 * g, 51, 0);
    vmm_check(b, va, 3 * g, 51, 0, "3 mapped granules");

    /* the middle granule alone */
    assert_ok(o->unmap(b, va + g, g));
    assert_status(o->unmap(b, va + g, g), SPW_ERR_STATE); /* double unmap */
    assert_status(o->unmap(b, va, 3 * g), SPW_ERR_STATE); /* partly unmapped: nothing done */
    assert_status(o->va_release(b, va, R), SPW_ERR_STATE); /* granules still mapped */
    vmm_check(b, va, g, 51, 0, "granule 0 after unmapping granule 1");
    vmm_check(b, va + 2 * g, g, 51, 2 * g, "granule 2 after unmapping granule 1");

    /* map it again with new contents */
    assert_ok(o->map(b, va + g, g));
    vmm_write(b, va + g, g, 52, 0);
    vmm_check(b, va, g, 51, 0, "granule 0 after remap");
    vmm_check(b, va + g, g, 52, 0, "remapped granule 1");
    vmm_check(b, va + 2 * g, g, 51, 2 * g, "granule 2 after remap");

    /* bad requests map nothing and report the call */
    assert_status(o->map(b, va, g), SPW_ERR_STATE);
    assert_status(o->map(b, va + 2 * g, 2 * g), SPW_ERR_STATE); /* overlaps granule 2 */
    assert_ok(o->map(b, va + 3 * g, g)); /* proves the failed call above left granule 3 free */
    assert_ok(o->unmap(b, va + 3 * g, g));
    assert_status(o->map(b, va + 1, g), SPW_ERR_INVALID_ARGUMENT);
    assert_status(o->map(b, va + 4 * g, g + 1), SPW_ERR_INVALID_ARGUMENT);
    assert_status(o->map(b, va + 4 * g, 0), SPW_ERR_INVALID_ARGUMENT);
    assert_status(o->map(b, va + R, g), SPW_ERR_NOT_FOUND);
    assert_status(o->map(b, va + R - g, 2 * g), SPW_ERR_NOT_FOUND);
    assert_non_null(strstr(spw_last_error(), "reservation"));

    /* the last granule of the reservation */
    assert_ok(o->map(b, va + R - g, g));
    vmm_write(b, va + R - g, g, 53, 0);
    vmm_check(b, va + R - g, g, 53, 0, "last granule");
    assert_ok(o->unmap(b, va + R - g, g));

    /* one unmap over granules that came from two maps */
    assert_ok(o->unmap(b, va, 3 * g));
    assert_status(o->unmap(b, va, g), SPW_ERR_STATE);
    assert_status(o->va_release(b, va, R + g), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(o->va_release(b, va, R));
    assert_status(o->va_release(b, va, R), SPW_ERR_NOT_FOUND);
    assert_status(o->map(b, va, g), SPW_ERR_NOT_FOUND);

    size_t free1 = 0;
    assert_ok(o->mem_info(b, &free1, NULL));
    if (free1 + 64 * SPW_MiB < free0) fail_msg("free %zu -> %zu: granules leaked", free0, free1);
    assert_runtime_clean();
    b->ops->destroy(b);
}

/* destroy returns mapped granules and reservations; two reservations are told apart. */
static void test_vmm_destroy_releases(void **state) {
    (void)state;
    spw_device_info d;
    spw_backend *b = open_vmm_backend(&d);
    const size_t g = d.vmm_granularity, n = 128; /* 256 MiB at 2 MiB granules */
    size_t free0 = 0, free1 = 0, free2 = 0;
    assert_ok(b->ops->mem_info(b, &free0, NULL));
    char *v1 = NULL, *v2 = NULL;
    assert_ok(b->ops->va_reserve(b, n * g, 0, (void **)&v1));
    assert_ok(b->ops->va_reserve(b, n * g, 0, (void **)&v2));
    assert_true(v1 + n * g <= v2 || v2 + n * g <= v1);
    assert_ok(b->ops->map(b, v1, n * g));
    assert_ok(b->ops->map(b, v2 + g, 2 * g));
    vmm_write(b, v2 + g, 2 * g, 61, 0);
    vmm_check(b, v2 + g, 2 * g, 61, 0, "second reservation");
    assert_status(b->ops->unmap(b, v2, g), SPW_ERR_STATE);
    assert_ok(b->ops->mem_info(b, &free1, NULL));
    if (free1 + (n + 2) * g > free0 + 64 * SPW_MiB)
        fail_msg("free %zu -> %zu after mapping %zu granules", free0, free1, n + 2);
    b->ops->destroy(b); /* everything still mapped */

    b = open_backend();
    assert_ok(b->ops->mem_info(b, &free2, NULL));
    if (free2 + 64 * SPW_MiB < free0) fail_msg("free %zu -> %zu after destroy", free0, free2);
    b->ops->destroy(b);
}

/* A reservation with pages of 16 granules: whole pages only, and data written over several of
 * them reads back. */
static void test_vmm_large_page(void **state) {
    (void)state;
    spw_device_info d;
    spw_backend *b = open_vmm_backend(&d);
    const size_t g = d.vmm_granularity, P = 16 * g;
    char *va = NULL;
    assert_status(b->ops->va_reserve(b, 4 * P, 3 * g, (void **)&va), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(b->ops->va_reserve(b, 4 * P, P, (void **)&va));
    assert_int_equal((uintptr_t)va % P, 0);
    assert_status(b->ops->map(b, va, g), SPW_ERR_INVALID_ARGUMENT);
    assert_ok(b->ops->map(b, va, 3 * P));
    vmm_write(b, va, 3 * P, 29, 0);
    assert_status(b->ops->unmap(b, va + P, g), SPW_ERR_INVALID_ARGUMENT);
    vmm_check(b, va, 3 * P, 29, 0, "three large pages");
    assert_ok(b->ops->unmap(b, va + P, P));
    vmm_check(b, va + 2 * P, P, 29, 2 * P, "the page after the unmapped one");
    assert_status(b->ops->va_release(b, va, 4 * P), SPW_ERR_STATE);
    assert_ok(b->ops->unmap(b, va, P));
    assert_ok(b->ops->unmap(b, va + 2 * P, P));
    assert_ok(b->ops->va_release(b, va, 4 * P));
    b->ops->destroy(b);
}

/* A map that runs out of device memory part-way maps nothing. Drives the device to exhaustion
 * with one granule at a time, so it takes a few seconds on a large GPU. */
static void test_vmm_map_oom_rolls_back(void **state) {
    (void)state;
    spw_device_info d;
    spw_backend *b = open_vmm_backend(&d);
    const spw_backend_ops *o = b->ops;
    const size_t g = d.vmm_granularity;
    size_t free0 = 0, free1 = 0;
    assert_ok(o->mem_info(b, &free0, NULL));
    size_t want = SPW_ALIGN_UP(free0 + 2 * SPW_GiB, g);
    char *va = NULL;
    assert_ok(o->va_reserve(b, want, 0, (void **)&va));
    uint64_t t0 = spw__now_ns();
    assert_status(o->map(b, va, want), SPW_ERR_OUT_OF_MEMORY);
    print_message("map of %zu MiB (free %zu MiB) failed in %.2f s: %s\n", want >> 20, free0 >> 20,
                  (double)(spw__now_ns() - t0) / 1e9, spw_last_error());
    assert_non_null(strstr(spw_last_error(), "cuMem"));
    assert_ok(o->mem_info(b, &free1, NULL));
    if (free1 + 64 * SPW_MiB < free0) fail_msg("free %zu -> %zu after failed map", free0, free1);
    /* nothing of the failed map is left: every granule maps afresh and the range releases */
    assert_ok(o->map(b, va, g));
    assert_ok(o->map(b, va + want - g, g));
    assert_ok(o->unmap(b, va, g));
    assert_ok(o->unmap(b, va + want - g, g));
    assert_ok(o->va_release(b, va, want));
    assert_runtime_clean();
    b->ops->destroy(b);
}

/* Several threads map and unmap their own granules of one reservation at once. */
typedef struct vmm_worker {
    spw_backend *b;
    char *base;
    size_t g;
    int failures;
} vmm_worker;

static void *vmm_churn(void *arg) {
    vmm_worker *w = arg;
    for (int i = 0; i < 50; i++) {
        if (w->b->ops->map(w->b, w->base, 2 * w->g) != SPW_OK) w->failures++;
        if (w->b->ops->unmap(w->b, w->base + w->g, w->g) != SPW_OK) w->failures++;
        if (w->b->ops->unmap(w->b, w->base, w->g) != SPW_OK) w->failures++;
    }
    return NULL;
}

static void test_vmm_threads(void **state) {
    (void)state;
    spw_device_info d;
    spw_backend *b = open_vmm_backend(&d);
    const size_t g = d.vmm_granularity;
    char *va = NULL;
    assert_ok(b->ops->va_reserve(b, 8 * g, 0, (void **)&va));
    vmm_worker w[4];
    pthread_t t[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (vmm_worker){b, va + (size_t)i * 2 * g, g, 0};
        assert_int_equal(pthread_create(&t[i], NULL, vmm_churn, &w[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        assert_int_equal(pthread_join(t[i], NULL), 0);
        assert_int_equal(w[i].failures, 0);
    }
    assert_ok(b->ops->va_release(b, va, 8 * g)); /* STATE if any granule were left mapped */
    b->ops->destroy(b);
}

/* A thread that never chose a device works on the backend's device (the last one, so that on a
 * machine with several GPUs this is not the default device 0). */
typedef struct bind_check {
    spw_backend *b;
    spw_status st;
    int device_after;
    int ptr_device;
} bind_check;

static void *bind_thread(void *arg) {
    bind_check *k = arg;
    void *p = NULL;
    k->st = k->b->ops->dev_alloc(k->b, SPW_MiB, &p);
    if (k->st != SPW_OK) return NULL;
    struct cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    if (cudaPointerGetAttributes(&a, p) == cudaSuccess) k->ptr_device = a.device;
    (void)cudaGetDevice(&k->device_after);
    k->st = k->b->ops->dev_free(k->b, p);
    return NULL;
}

static void test_other_thread_binds_device(void **state) {
    (void)state;
    if (!spw__backend_cuda_available()) skip();
    int n = 0;
    assert_int_equal(cudaGetDeviceCount(&n), cudaSuccess);
    spw_backend_params p;
    memset(&p, 0, sizeof p);
    p.device = n - 1;
    spw_backend *b = NULL;
    assert_ok(spw__backend_cuda_create(&p, &b));
    bind_check k = {b, SPW_ERR_STATE, -1, -1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, bind_thread, &k), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_status(k.st, SPW_OK);
    assert_int_equal(k.device_after, n - 1);
    assert_int_equal(k.ptr_device, n - 1);
    b->ops->destroy(b);
}

/* ---- managed memory ---- */

static int range_attr(enum cudaMemRangeAttribute a, const void *p, size_t n) {
    int v = -100;
    cudaError_t e = cudaMemRangeGetAttribute(&v, sizeof v, a, p, n);
    if (e != cudaSuccess) fail_msg("cudaMemRangeGetAttribute(%d): %s", (int)a, cudaGetErrorString(e));
    return v;
}

static void test_managed(void **state) {
    (void)state;
    spw_backend *b = open_backend();
    const spw_backend_ops *o = b->ops;
    spw_device_info d = info_of(b);
    size_t n = SPW_MIN(64 * SPW_MiB, d.free_bytes / 4);
    unsigned char *m = NULL;
    assert_ok(o->managed_alloc(b, n, (void **)&m));
    assert_non_null(m);
    assert_int_equal(mem_type(m), cudaMemoryTypeManaged);
    fill(m, n, 71); /* written by the CPU in place */

    spw_stream s = NULL;
    assert_ok(o->stream_create(b, &s));
    assert_ok(o->managed_advise(b, m, n, SPW_ADVISE_PREFERRED_DEVICE));
    assert_int_equal(range_attr(cudaMemRangeAttributePreferredLocationType, m, n),
                     cudaMemLocationTypeDevice);
    assert_int_equal(range_attr(cudaMemRangeAttributePreferredLocationId, m, n), 0);
    assert_status(o->managed_advise(b, m, n, (spw_managed_advice)99), SPW_ERR_INVALID_ARGUMENT);

    if (!d.concurrent_managed_access) {
        assert_status(o->prefetch(b, m, n, 1, s), SPW_ERR_UNSUPPORTED);
        print_message("no concurrent managed access: prefetch not exercised\n");
    } else {
        /* to the device, then read it there through a device-to-device copy */
        assert_ok(o->prefetch(b, m, n, 1, s));
        assert_ok(o->stream_sync(b, s));
        assert_int_equal(range_attr(cudaMemRangeAttributeLastPrefetchLocationType, m, n),
                         cudaMemLocationTypeDevice);
        void *dv = NULL, *h = NULL;
        assert_ok(o->dev_alloc(b, n, &dv));
        assert_ok(o->host_alloc(b, n, &h));
        memset(h, 0, n);
        assert_ok(o->memcpy_async(b, dv, m, n, SPW_COPY_D2D, s));
        assert_ok(o->memcpy_async(b, h, dv, n, SPW_COPY_D2H, s));
        assert_ok(o->stream_sync(b, s));
        check_pattern(h, n, 71, 0, "managed after prefetch to device");

        /* overwrite while resident on the device, then bring it home and read it in place */
        fill(h, n, 72);
        assert_ok(o->memcpy_async(b, m, h, n, SPW_COPY_H2D, s));
        assert_ok(o->stream_sync(b, s)); /* cudaMemAdvise is not stream-ordered */
        assert_ok(o->managed_advise(b, m, n, SPW_ADVISE_PREFERRED_HOST));
        assert_int_equal(range_attr(cudaMemRangeAttributePreferredLocationType, m, n),
                         cudaMemLocationTypeHost);
        assert_ok(o->prefetch(b, m, n, 0, s));
        assert_ok(o->stream_sync(b, s));
        assert_int_equal(range_attr(cudaMemRangeAttributeLastPrefetchLocationType, m, n),
                         cudaMemLocationTypeHost);
        check_pattern(m, n, 72, 0, "managed after prefetch to host");
        assert_ok(o->dev_free(b, dv));
        assert_ok(o->host_free(b, h));
    }

    assert_ok(o->managed_advise(b, m, n, SPW_ADVISE_READ_MOSTLY));
    assert_int_equal(range_attr(cudaMemRangeAttributeReadMostly, m, n), 1);
    assert_ok(o->managed_advise(b, m, n, SPW_ADVISE_UNSET_READ_MOSTLY));
    assert_int_equal(range_attr(cudaMemRangeAttributeReadMostly, m, n), 0);
    check_pattern(m, n, d.concurrent_managed_access ? 72 : 71, 0, "managed after advice");

    assert_ok(o->stream_destroy(b, s));
    assert_ok(o->managed_free(b, m));
    assert_status(o->managed_alloc(b, 0, (void **)&m), SPW_ERR_INVALID_ARGUMENT);
    assert_runtime_clean();
    b->ops->destroy(b);
}

int main(void) {
    const struct CMUnitTest no_device[] = {
        cmocka_unit_test(test_create_and_availability),
    };
    if (!spw__backend_cuda_available()) {
        int rc = cmocka_run_group_tests(no_device, NULL, NULL);
        if (rc) return rc;
        test_have_gpu("test_cuda_backend");
        return TEST_SKIP_EXIT;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_and_availability),
        cmocka_unit_test(test_device_info),
        cmocka_unit_test(test_dev_alloc_and_copies),
        cmocka_unit_test(test_errors_not_sticky),
        cmocka_unit_test(test_host_register),
        cmocka_unit_test(test_event_query),
        cmocka_unit_test(test_cross_stream_wait),
        cmocka_unit_test(test_launch_host_order),
        cmocka_unit_test(test_vmm_map_unmap),
        cmocka_unit_test(test_vmm_destroy_releases), cmocka_unit_test(test_vmm_large_page),
        cmocka_unit_test(test_vmm_threads),
        cmocka_unit_test(test_vmm_map_oom_rolls_back),
        cmocka_unit_test(test_other_thread_binds_device),
        cmocka_unit_test(test_managed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
