/*
 * PyTorch's CUDAPluggableAllocator entry points: a table of per-device contexts created on first
 * use, the per-device budget syntax, the record_stream side table, and the latest refusal per
 * device (PyTorch may allocate on an autograd thread and report on another, so the thread-local
 * message is not enough).
 *
 * Locking: g_lock guards creation, the configuration, the OOM messages and the record table. The
 * allocate/free fast path reads the context pointer with an acquire load and takes only the
 * context's own lock; it touches g_lock only when record_stream was ever used on a live block.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local int hash_oom;
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) ((void)(obj), hash_oom = 1)
#include <uthash.h>

#include "ctx.h"
#include "options.h"
#include "spillway_torch.h"

#define SPW_TORCH_MAX_DEVICES 64
#define SPW_TORCH_CONF_MAX 4096

typedef struct torch_dev {
    _Atomic(spw_ctx *) ctx;
    double fraction;          /* memory_fraction before creation; 0 = none */
    _Atomic uint64_t ooms;
    _Atomic int pending;      /* the latest allocation on this device was refused */
    _Atomic uint64_t n_alloc, alloc_ns, n_free, free_ns; /* spw_torch_call_stats */
    char oom_msg[1024];       /* g_lock */
} torch_dev;

/* A block used by other streams (record_stream): waited for at its free. */
typedef struct torch_rec {
    void *ptr;
    size_t n, cap;
    spw_stream *streams;
    UT_hash_handle hh;
} torch_rec;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static torch_dev g_dev[SPW_TORCH_MAX_DEVICES];
static char g_conf[SPW_TORCH_CONF_MAX];
static _Atomic int g_device_count; /* 0: not told (init_fn not called) */
static _Atomic int g_started;      /* a context exists or existed since the last shutdown */
static torch_rec *g_recs;          /* g_lock */
static _Atomic size_t g_nrecs;

static spw_status check_device(int device, const char *what) {
    int count = atomic_load(&g_device_count);
    if (device < 0 || device >= SPW_TORCH_MAX_DEVICES || (count > 0 && device >= count))
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "%s: device %d is out of range (0 .. %d)", what, device,
                          (count > 0 ? count : SPW_TORCH_MAX_DEVICES) - 1);
    return SPW_OK;
}

/* Budget of `device` from a per-device list "0:4GiB;1:8GiB". *found = 0 when the device is not
 * listed. Checks the whole list (syntax, index range, duplicates) whatever the device. */
static spw_status budget_for_device(const char *list, int device, char *out, size_t len, int *found) {
    char seen[SPW_TORCH_MAX_DEVICES] = {0};
    *found = 0;
    const char *p = list;
    while (*p) {
        const char *end = strchr(p, ';');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        char item[128];
        if (n == 0 || n >= sizeof item)
            return spw__error(SPW_ERR_CONFIG, "option 'budget': bad per-device entry in \"%s\" (expected "
                              "DEVICE:SIZE;DEVICE:SIZE, e.g. 0:4GiB;1:8GiB)", list);
        memcpy(item, p, n);
        item[n] = 0;
        char *colon = strchr(item, ':');
        char *idx_end = NULL;
        long idx = colon ? strtol(item, &idx_end, 10) : -1;
        if (!colon || idx_end != colon || idx < 0 || idx >= SPW_TORCH_MAX_DEVICES)
            return spw__error(SPW_ERR_CONFIG, "option 'budget': bad per-device entry \"%s\" (expected "
                              "DEVICE:SIZE with DEVICE 0 .. %d, e.g. 0:4GiB;1:8GiB)", item,
                              SPW_TORCH_MAX_DEVICES - 1);
        if (seen[idx])
            return spw__error(SPW_ERR_CONFIG, "option 'budget': device %ld is given twice in \"%s\"", idx, list);
        seen[idx] = 1;
        spw_size_spec probe;
        char err[SPW_SIZE_ERR_MAX];
        if (spw__size_parse(colon + 1, SPW_SIZE_PERCENT | SPW_SIZE_NONZERO, &probe, err, sizeof err))
            return spw__error(SPW_ERR_CONFIG, "option 'budget' for device %ld: %s", idx, err);
        if (idx == device) {
            *found = 1;
            snprintf(out, len, "%s", colon + 1);
        }
        p += n;
        if (*p == ';') p++;
    }
    return SPW_OK;
}

/* Apply "key=value,..." to cfg for `device` (budget may be per device; device is refused). */
static spw_status apply_list(spw_config *cfg, const char *list, int device, const char *origin) {
    char *copy = strdup(list);
    if (!copy) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "%s: out of host memory", origin);
    spw_status st = SPW_OK;
    char *save = NULL;
    for (char *kv = strtok_r(copy, ",", &save); kv && !st; kv = strtok_r(NULL, ",", &save)) {
        while (*kv == ' ') kv++;
        if (!*kv) continue;
        char *eq = strchr(kv, '=');
        if (!eq) {
            st = spw__error(SPW_ERR_CONFIG, "%s: \"%s\" is not key=value", origin, kv);
            break;
        }
        *eq = 0;
        const char *key = kv, *value = eq + 1;
        if (!strcmp(key, "device")) {
            st = spw__error(SPW_ERR_CONFIG, "%s: option 'device' is chosen by PyTorch for each allocation; "
                            "give per-device budgets as budget=0:4GiB;1:8GiB", origin);
        } else if (!strcmp(key, "budget") && strchr(value, ':')) {
            char one[64];
            int found;
            st = budget_for_device(value, device, one, sizeof one, &found);
            if (!st && found) st = spw_config_set(cfg, "budget", one);
        } else {
            st = spw_config_set(cfg, key, value);
        }
        if (st) spw__error_prefix(st, "%s", origin);
    }
    free(copy);
    return st;
}

/* The configuration of device's context: defaults, grow_ahead=0, vmm=off, SPILLWAY_CONF, g_conf, then a
 * memory fraction if one was set. g_lock held. */
static spw_status build_config(int device, const char *conf, double fraction, spw_config **out) {
    spw_config *cfg = NULL;
    spw_status st = spw_config_create(&cfg);
    if (st) return st;
    const char *env = getenv("SPILLWAY_CONF");
    char dev[16];
    snprintf(dev, sizeof dev, "%d", device);
    /* PyTorch's caching allocator asks for whole segments and caches their blocks itself, so
     * pages mapped in place buy nothing here and cost a cuMemCreate + cuMemMap per 2 MiB on every
     * new segment, many times what one cudaMalloc of the segment costs (bench/RESULTS.md);
     * plain segments are the default, SPILLWAY_CONF or the call's options may still ask for vmm. */
    if (!st) st = spw_config_set(cfg, "grow_ahead", "0");
    if (!st) st = spw_config_set(cfg, "vmm", "off");
    if (!st && env && *env) st = apply_list(cfg, env, device, "SPILLWAY_CONF");
    if (!st && conf && *conf) st = apply_list(cfg, conf, device, "spillway torch configuration");
    if (!st && fraction > 0) {
        char pct[32];
        snprintf(pct, sizeof pct, "%.6f%%", fraction * 100.0);
        st = spw_config_set(cfg, "budget", pct);
    }
    if (!st) st = spw_config_set(cfg, "device", dev);
    if (st) {
        spw_config_destroy(cfg);
        return st;
    }
    *out = cfg;
    return SPW_OK;
}

static spw_status get_ctx(int device, int create, spw_ctx **out) {
    spw_status st = check_device(device, "spillway torch allocator");
    if (st) return st;
    spw_ctx *ctx = atomic_load_explicit(&g_dev[device].ctx, memory_order_acquire);
    if (SPW_LIKELY(ctx != NULL)) {
        *out = ctx;
        return SPW_OK;
    }
    if (!create)
        return spw__error(SPW_ERR_NOT_FOUND, "spillway torch allocator: device %d has no context yet "
                          "(nothing was allocated on it)", device);
    pthread_mutex_lock(&g_lock);
    ctx = atomic_load_explicit(&g_dev[device].ctx, memory_order_acquire);
    if (!ctx) {
        spw_config *cfg = NULL;
        st = build_config(device, g_conf, g_dev[device].fraction, &cfg);
        if (!st) {
            st = spw_ctx_create(cfg, &ctx);
            spw_config_destroy(cfg);
        }
        if (st) {
            spw__error_prefix(st, "spillway torch allocator: creating the context of device %d", device);
        } else {
            atomic_store(&g_started, 1);
            atomic_store_explicit(&g_dev[device].ctx, ctx, memory_order_release);
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (st) return st;
    *out = ctx;
    return SPW_OK;
}

SPW_API spw_status spw_torch_configure(const char *conf) {
    if (!conf) conf = "";
    size_t n = strlen(conf);
    if (n >= SPW_TORCH_CONF_MAX)
        return spw__error(SPW_ERR_CONFIG, "spw_torch_configure: the list is %zu characters; the limit is %d",
                          n, SPW_TORCH_CONF_MAX - 1);
    pthread_mutex_lock(&g_lock);
    spw_status st = SPW_OK;
    if (atomic_load(&g_started)) {
        st = spw__error(SPW_ERR_STATE, "spw_torch_configure: a device context already exists (options apply "
                        "when a context is created: configure before the first CUDA allocation, or call "
                        "spw_torch_shutdown first)");
    } else {
        /* check the list as every device would see it (budget entries are checked whatever the device) */
        spw_config *cfg = NULL;
        st = build_config(0, conf, 0, &cfg);
        spw_config_destroy(cfg);
        if (!st) memcpy(g_conf, conf, n + 1);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

static _Atomic(spw_torch_reclaim_fn) g_reclaim;
static _Thread_local int in_reclaim;

SPW_API void spw_torch_set_reclaim(spw_torch_reclaim_fn reclaim) { atomic_store(&g_reclaim, reclaim); }

/* Ask the reclaim function for cached memory; true when the allocation is worth trying again. */
static bool reclaim_for(int device) {
    spw_torch_reclaim_fn fn = atomic_load(&g_reclaim);
    if (!fn || in_reclaim) return false;
    in_reclaim = 1;
    int freed = fn(device);
    in_reclaim = 0;
    return freed != 0;
}

static void record_oom(int device) {
    pthread_mutex_lock(&g_lock);
    snprintf(g_dev[device].oom_msg, sizeof g_dev[device].oom_msg, "device %d: %s", device, spw_last_error());
    atomic_fetch_add(&g_dev[device].ooms, 1);
    atomic_store(&g_dev[device].pending, 1);
    pthread_mutex_unlock(&g_lock);
}

static void *torch_alloc(size_t size, int device, spw_stream stream);
static void torch_free(void *ptr, size_t size, int device, spw_stream stream);

/* The entry points time themselves (two clock reads, tens of ns against a segment's
 * allocation): PyTorch calls them only when its own cache has no block, so the counts and times
 * say what a step spent on segments. */
static void count_call(int device, int is_alloc, uint64_t t0) {
    if (device < 0 || device >= SPW_TORCH_MAX_DEVICES) return;
    torch_dev *d = &g_dev[device];
    uint64_t ns = spw__now_ns() - t0;
    atomic_fetch_add_explicit(is_alloc ? &d->n_alloc : &d->n_free, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(is_alloc ? &d->alloc_ns : &d->free_ns, ns, memory_order_relaxed);
}

SPW_API void *spw_torch_alloc(size_t size, int device, spw_stream stream) {
    uint64_t t0 = spw__now_ns();
    void *p = torch_alloc(size, device, stream);
    count_call(device, 1, t0);
    return p;
}

SPW_API void spw_torch_free(void *ptr, size_t size, int device, spw_stream stream) {
    uint64_t t0 = spw__now_ns();
    torch_free(ptr, size, device, stream);
    count_call(device, 0, t0);
}

SPW_API void spw_torch_call_stats(int device, uint64_t out[4]) {
    if (!out) return;
    if (device < 0 || device >= SPW_TORCH_MAX_DEVICES) {
        memset(out, 0, 4 * sizeof *out);
        return;
    }
    torch_dev *d = &g_dev[device];
    out[0] = atomic_load(&d->n_alloc);
    out[1] = atomic_load(&d->alloc_ns);
    out[2] = atomic_load(&d->n_free);
    out[3] = atomic_load(&d->free_ns);
}

static void *torch_alloc(size_t size, int device, spw_stream stream) {
    if (SPW_UNLIKELY(size == 0)) {
        spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_torch_alloc: size 0 (PyTorch keeps empty tensors without memory)");
        return NULL;
    }
    spw_ctx *ctx = NULL;
    if (get_ctx(device, 1, &ctx)) return NULL;
    void *p = NULL;
    spw_status st = spw_malloc(ctx, size, stream, &p);
    if (SPW_UNLIKELY(st == SPW_ERR_OUT_OF_MEMORY) && reclaim_for(device)) st = spw_malloc(ctx, size, stream, &p);
    if (SPW_UNLIKELY(st)) {
        if (st == SPW_ERR_OUT_OF_MEMORY) record_oom(device);
        return NULL;
    }
    if (SPW_UNLIKELY(atomic_load_explicit(&g_dev[device].pending, memory_order_relaxed)))
        atomic_store(&g_dev[device].pending, 0);
    return p;
}

/* Order `stream` after the work enqueued so far on each stream recorded for ptr, and forget them.
 * The device waits, the host does not. */
static spw_status wait_recorded(spw_ctx *ctx, void *ptr, spw_stream stream) {
    pthread_mutex_lock(&g_lock);
    torch_rec *r = NULL;
    HASH_FIND_PTR(g_recs, &ptr, r);
    if (r) {
        HASH_DEL(g_recs, r);
        atomic_fetch_sub(&g_nrecs, 1);
    }
    pthread_mutex_unlock(&g_lock);
    if (!r) return SPW_OK;
    const spw_backend_ops *ops = ctx->backend->ops;
    spw_status st = SPW_OK;
    for (size_t i = 0; i < r->n && !st; i++) {
        if (r->streams[i] == stream) continue;
        spw_event ev;
        if ((st = ops->event_create(ctx->backend, &ev))) break;
        st = ops->event_record(ctx->backend, ev, r->streams[i]);
        if (!st) st = ops->stream_wait(ctx->backend, stream, ev);
        spw_status dst = ops->event_destroy(ctx->backend, ev);
        if (!st) st = dst;
    }
    if (st) {
        /* put it back: the free is refused and may be retried */
        pthread_mutex_lock(&g_lock);
        hash_oom = 0;
        HASH_ADD_PTR(g_recs, ptr, r);
        if (hash_oom) {
            /* cannot remember the streams: the caller's free must not go ahead */
            free(r->streams);
            free(r);
        } else {
            atomic_fetch_add(&g_nrecs, 1);
        }
        pthread_mutex_unlock(&g_lock);
        return spw__error_prefix(st, "spw_torch_free: ordering the free of %p after its recorded streams", ptr);
    }
    free(r->streams);
    free(r);
    return SPW_OK;
}

static void torch_free(void *ptr, size_t size, int device, spw_stream stream) {
    if (!ptr) return;
    spw_ctx *ctx = NULL;
    if (get_ctx(device, 0, &ctx)) {
        spw__error_prefix(SPW_ERR_NOT_FOUND, "spw_torch_free(%p)", ptr);
        return;
    }
    size_t requested = 0;
    if (SPW_UNLIKELY(!spw__ctx_live_requested(ctx, ptr, &requested))) {
        spw_free(ctx, ptr, stream); /* sets the message: double free or foreign pointer */
        spw__error_prefix(SPW_ERR_STATE, "spw_torch_free(device %d)", device);
        return;
    }
    if (SPW_UNLIKELY(requested != size)) {
        spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_torch_free: %p was allocated with %zu B, freed with %zu B "
                   "(nothing freed)", ptr, requested, size);
        return;
    }
    if (SPW_UNLIKELY(atomic_load(&g_nrecs) > 0) && wait_recorded(ctx, ptr, stream)) return;
    spw_free(ctx, ptr, stream);
}

SPW_API void spw_torch_init(int device_count) {
    if (device_count < 0 || device_count > SPW_TORCH_MAX_DEVICES) {
        spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_torch_init: device count %d (supported: 0 .. %d)", device_count,
                   SPW_TORCH_MAX_DEVICES);
        return;
    }
    atomic_store(&g_device_count, device_count);
}

SPW_API void spw_torch_reset(void) {
    for (int d = 0; d < SPW_TORCH_MAX_DEVICES; d++) {
        spw_ctx *ctx = atomic_load_explicit(&g_dev[d].ctx, memory_order_acquire);
        if (ctx) spw_empty_cache(ctx);
    }
}

SPW_API void spw_torch_memory_fraction(double fraction, int device) {
    if (check_device(device, "spw_torch_memory_fraction")) return;
    if (!(fraction > 0 && fraction <= 1)) {
        spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_torch_memory_fraction: fraction %g is not in (0, 1]", fraction);
        return;
    }
    pthread_mutex_lock(&g_lock);
    spw_ctx *ctx = atomic_load_explicit(&g_dev[device].ctx, memory_order_acquire);
    if (!ctx) g_dev[device].fraction = fraction;
    pthread_mutex_unlock(&g_lock);
    if (ctx) spw__ctx_set_budget(ctx, (size_t)((double)ctx->dev.total_bytes * fraction));
}

SPW_API void spw_torch_record_stream(void *ptr, spw_stream stream) {
    if (!ptr) {
        spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_torch_record_stream: pointer is NULL");
        return;
    }
    int live = 0;
    for (int d = 0; d < SPW_TORCH_MAX_DEVICES && !live; d++) {
        spw_ctx *ctx = atomic_load_explicit(&g_dev[d].ctx, memory_order_acquire);
        live = ctx && spw__ctx_live_requested(ctx, ptr, NULL);
    }
    if (!live) {
        spw__error(SPW_ERR_NOT_FOUND, "spw_torch_record_stream: %p is not a live allocation of any device", ptr);
        return;
    }
    pthread_mutex_lock(&g_lock);
    torch_rec *r = NULL;
    HASH_FIND_PTR(g_recs, &ptr, r);
    if (!r) {
        r = calloc(1, sizeof *r);
        if (r) {
            r->ptr = ptr;
            hash_oom = 0;
            HASH_ADD_PTR(g_recs, ptr, r);
            if (hash_oom) {
                torch_rec *in = NULL;
                HASH_FIND_PTR(g_recs, &ptr, in);
                if (in) HASH_DEL(g_recs, r);
                free(r);
                r = NULL;
            } else {
                atomic_fetch_add(&g_nrecs, 1);
            }
        }
    }
    int ok = r != NULL;
    if (r) {
        size_t i = 0;
        while (i < r->n && r->streams[i] != stream) i++;
        if (i == r->n) {
            if (r->n == r->cap) {
                size_t cap = r->cap ? 2 * r->cap : 4;
                spw_stream *s = realloc(r->streams, cap * sizeof *s);
                if (s) {
                    r->streams = s;
                    r->cap = cap;
                }
            }
            if (r->n < r->cap) r->streams[r->n++] = stream;
            else ok = 0;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (!ok) spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw_torch_record_stream: out of host memory");
}

SPW_API spw_status spw_torch_context(int device, int create, spw_ctx **out) {
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_torch_context: out is NULL");
    return get_ctx(device, create, out);
}

SPW_API uint64_t spw_torch_oom_count(int device) {
    if (device < 0 || device >= SPW_TORCH_MAX_DEVICES) return 0;
    return atomic_load(&g_dev[device].ooms);
}

SPW_API int spw_torch_oom_pending(int device) {
    if (device < 0 || device >= SPW_TORCH_MAX_DEVICES) return 0;
    return atomic_load(&g_dev[device].pending);
}

SPW_API spw_status spw_torch_oom_message(int device, char *buf, size_t len) {
    if (!buf || !len) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_torch_oom_message: no buffer");
    spw_status st = check_device(device, "spw_torch_oom_message");
    if (st) return st;
    pthread_mutex_lock(&g_lock);
    snprintf(buf, len, "%s", g_dev[device].oom_msg);
    pthread_mutex_unlock(&g_lock);
    return SPW_OK;
}

SPW_API spw_status spw_torch_shutdown(void) {
    pthread_mutex_lock(&g_lock);
    for (int d = 0; d < SPW_TORCH_MAX_DEVICES; d++) {
        spw_ctx *ctx = atomic_load(&g_dev[d].ctx);
        spw_stats st;
        if (ctx && !spw_stats_get(ctx, &st) && (st.live.current > 0 || st.buffers_resident.current > 0 ||
                                               st.buffers_host.current > 0)) {
            pthread_mutex_unlock(&g_lock);
            return spw__error(SPW_ERR_STATE, "spw_torch_shutdown: device %d still has %lld B in live allocations "
                              "and %lld buffers (free them first)", d, (long long)st.live.current,
                              (long long)(st.buffers_resident.current + st.buffers_host.current));
        }
    }
    for (int d = 0; d < SPW_TORCH_MAX_DEVICES; d++) {
        spw_ctx *ctx = atomic_exchange(&g_dev[d].ctx, NULL);
        spw_ctx_destroy(ctx);
        g_dev[d].fraction = 0;
        g_dev[d].oom_msg[0] = 0;
        atomic_store(&g_dev[d].ooms, 0);
        atomic_store(&g_dev[d].pending, 0);
        atomic_store(&g_dev[d].n_alloc, 0);
        atomic_store(&g_dev[d].alloc_ns, 0);
        atomic_store(&g_dev[d].n_free, 0);
        atomic_store(&g_dev[d].free_ns, 0);
    }
    torch_rec *r, *tmp;
    HASH_ITER(hh, g_recs, r, tmp) {
        HASH_DEL(g_recs, r);
        free(r->streams);
        free(r);
    }
    atomic_store(&g_nrecs, 0);
    g_conf[0] = 0;
    atomic_store(&g_device_count, 0);
    atomic_store(&g_started, 0);
    pthread_mutex_unlock(&g_lock);
    return SPW_OK;
}
