/*
 * The probe without a GPU: spw_probe_ops over the emu backend (src/backend.h). Every figure
 * measures host memory copies made by the emu's stream worker threads; the report says so.
 * Timing events are emulated by a host callback enqueued on the stream, which stamps the clock
 * when the stream reaches it (stream order is what CUDA events measure too).
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "options.h"
#include "probe.h"

#define EMU_MAX_MAPPED 8

struct spw_probe_dev {
    spw_backend *b;
    struct {
        unsigned char *p;
        size_t bytes;
    } mapped[EMU_MAX_MAPPED];
};

typedef struct emu_event {
    spw_event be;          /* the backend's event: cross-stream waits and completion */
    _Atomic uint64_t t_ns; /* stamped by the stream worker */
} emu_event;

static spw_status e_mem_info(spw_probe_dev *d, size_t *f, size_t *t) { return d->b->ops->mem_info(d->b, f, t); }
static spw_status e_dev_alloc(spw_probe_dev *d, size_t bytes, void **out) {
    void *p = NULL;
    spw_status st = d->b->ops->dev_alloc(d->b, bytes, &p);
    if (!st) *out = p;
    return st;
}
static spw_status e_dev_free(spw_probe_dev *d, void *p) { return d->b->ops->dev_free(d->b, p); }
static spw_status e_host_alloc(spw_probe_dev *d, size_t bytes, void **out) {
    void *p = NULL;
    spw_status st = d->b->ops->host_alloc(d->b, bytes, &p);
    if (!st) *out = p;
    return st;
}
static spw_status e_host_free(spw_probe_dev *d, void *p) { return d->b->ops->host_free(d->b, p); }

/* On emu, "mapped" memory is pinned host memory whose device address is its host address; the
 * slot table lets copy_async recognise reads of it. */
static spw_status e_mapped_alloc(spw_probe_dev *d, size_t bytes, void **host, void **dev) {
    int slot = -1;
    for (int i = 0; i < EMU_MAX_MAPPED && slot < 0; i++)
        if (!d->mapped[i].p) slot = i;
    if (slot < 0) return spw__error(SPW_ERR_INVALID_ARGUMENT, "emu probe: more than %d mapped buffers", EMU_MAX_MAPPED);
    void *p = NULL;
    spw_status st = d->b->ops->host_alloc(d->b, bytes, &p);
    if (st) return st;
    d->mapped[slot].p = p;
    d->mapped[slot].bytes = bytes;
    *host = *dev = p;
    return SPW_OK;
}
static spw_status e_mapped_free(spw_probe_dev *d, void *host) {
    for (int i = 0; i < EMU_MAX_MAPPED; i++)
        if (d->mapped[i].p == host) d->mapped[i].p = NULL, d->mapped[i].bytes = 0;
    return d->b->ops->host_free(d->b, host);
}
static bool in_mapped(spw_probe_dev *d, const void *p) {
    const unsigned char *c = p;
    for (int i = 0; i < EMU_MAX_MAPPED; i++)
        if (d->mapped[i].p && c >= d->mapped[i].p && c < d->mapped[i].p + d->mapped[i].bytes) return true;
    return false;
}

static spw_status e_stream_create(spw_probe_dev *d, spw_stream *out) { return d->b->ops->stream_create(d->b, out); }
static spw_status e_stream_destroy(spw_probe_dev *d, spw_stream s) { return d->b->ops->stream_destroy(d->b, s); }
static spw_status e_stream_sync(spw_probe_dev *d, spw_stream s) { return d->b->ops->stream_sync(d->b, s); }

typedef struct memset_job {
    void *p;
    int byte;
    size_t bytes;
} memset_job;
static void run_memset(void *arg) {
    memset_job *j = arg;
    memset(j->p, j->byte, j->bytes);
    free(j);
}
/* emu device pointers are host addresses, so a "kernel" (host callback) can fill them */
static spw_status e_memset(spw_probe_dev *d, void *p, int byte, size_t bytes, spw_stream s) {
    memset_job *j = malloc(sizeof *j);
    if (!j) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu probe: out of host memory");
    *j = (memset_job){p, byte, bytes};
    spw_status st = d->b->ops->launch_host(d->b, s, run_memset, j);
    if (st) free(j);
    return st;
}
static spw_status e_copy(spw_probe_dev *d, void *dst, const void *src, size_t bytes, spw_copy_kind kind,
                         spw_stream s) {
    /* a device-side read of mapped host memory is, to the emu, a host-to-device copy */
    if (kind == SPW_COPY_D2D && in_mapped(d, src)) kind = SPW_COPY_H2D;
    return d->b->ops->memcpy_async(d->b, dst, src, bytes, kind, s);
}

static void stamp_now(void *arg) { atomic_store(&((emu_event *)arg)->t_ns, spw__now_ns()); }

static spw_status e_event_create(spw_probe_dev *d, spw_event *out) {
    emu_event *e = calloc(1, sizeof *e);
    if (!e) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "emu probe: out of host memory");
    spw_status st = d->b->ops->event_create(d->b, &e->be);
    if (st) {
        free(e);
        return st;
    }
    *out = (spw_event)(void *)e;
    return SPW_OK;
}
static spw_status e_event_destroy(spw_probe_dev *d, spw_event ev) {
    emu_event *e = (emu_event *)(void *)ev;
    spw_status st = d->b->ops->event_destroy(d->b, e->be);
    free(e);
    return st;
}
static spw_status e_event_record(spw_probe_dev *d, spw_event ev, spw_stream s) {
    emu_event *e = (emu_event *)(void *)ev;
    atomic_store(&e->t_ns, 0);
    spw_status st = d->b->ops->launch_host(d->b, s, stamp_now, e);
    if (!st) st = d->b->ops->event_record(d->b, e->be, s);
    return st;
}
static spw_status e_stream_wait(spw_probe_dev *d, spw_stream s, spw_event ev) {
    return d->b->ops->stream_wait(d->b, s, ((emu_event *)(void *)ev)->be);
}
static spw_status e_elapsed(spw_probe_dev *d, spw_event a, spw_event b, double *ms) {
    emu_event *ea = (emu_event *)(void *)a, *eb = (emu_event *)(void *)b;
    spw_status st = d->b->ops->event_sync(d->b, ea->be);
    if (!st) st = d->b->ops->event_sync(d->b, eb->be);
    if (st) return st;
    uint64_t ta = atomic_load(&ea->t_ns), tb = atomic_load(&eb->t_ns);
    if (!ta || !tb) return spw__error(SPW_ERR_STATE, "emu probe: an event completed before its stamp ran");
    *ms = tb > ta ? (double)(tb - ta) / 1e6 : 0;
    return SPW_OK;
}

static const spw_probe_ops emu_ops = {
    .dev_alloc_api = "emu dev_alloc+dev_free",
    .host_alloc_api = "emu host_alloc+host_free",
    .mem_info = e_mem_info,
    .dev_alloc = e_dev_alloc,
    .dev_free = e_dev_free,
    .host_alloc = e_host_alloc,
    .host_free = e_host_free,
    .mapped_alloc = e_mapped_alloc,
    .mapped_free = e_mapped_free,
    .stream_create = e_stream_create,
    .stream_destroy = e_stream_destroy,
    .stream_sync = e_stream_sync,
    .memset_async = e_memset,
    .copy_async = e_copy,
    .event_create = e_event_create,
    .event_destroy = e_event_destroy,
    .event_record = e_event_record,
    .stream_wait = e_stream_wait,
    .event_elapsed_ms = e_elapsed,
};

spw_status spw_probe_emu_open(spw_probe_result *r, const spw_probe_ops **ops, spw_probe_dev **out) {
    if (r->device != 0)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "no device %d: the emu backend has one device (0)", r->device);
    /* SPILLWAY_CONF's emu_pin_limit emulates a system that limits pinned memory (WSL2) */
    spw_config *cfg = NULL;
    spw_status st = spw_config_create(&cfg);
    if (!st) st = spw_config_from_env(cfg);
    size_t pin_limit = st ? 0 : cfg->emu_pin_limit;
    spw_config_destroy(cfg);
    if (st) return st;
    spw_probe_dev *d = calloc(1, sizeof *d);
    if (!d) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "out of host memory");
    /* The emu reserves its capacity without committing it; the probe touches only what it
     * copies, so 2 GiB of emulated device costs far less RAM. Host<->device copies take
     * bytes / SPW_PROBE_EMU_LINK_GBPS: an emulated link. */
    spw_backend_params p = {.device = 0,
                            .emu_capacity = 2 * SPW_GiB,
                            .emu_granularity = 2 * SPW_MiB,
                            .emu_vmm = 1,
                            .emu_managed = 1,
                            .emu_h2d_gbps = SPW_PROBE_EMU_LINK_GBPS,
                            .emu_pin_limit = pin_limit};
    st = spw__backend_emu_create(&p, &d->b);
    if (st) {
        free(d);
        return st;
    }
    spw_device_info info;
    memset(&info, 0, sizeof info);
    st = d->b->ops->device_info(d->b, &info);
    if (st) {
        d->b->ops->destroy(d->b);
        free(d);
        return st;
    }
    snprintf(r->name, sizeof r->name, "%s", info.name[0] ? info.name : "emulated device");
    r->cc_major = info.cc_major;
    r->cc_minor = info.cc_minor;
    r->total_bytes = info.total_bytes;
    r->free_bytes = info.free_bytes;
    r->concurrent_managed = info.concurrent_managed_access;
    r->pageable_access = info.pageable_memory_access;
    r->device_count = 1;
    snprintf(r->devices[0].name, sizeof r->devices[0].name, "%s", r->name);
    r->devices[0].cc_major = r->cc_major;
    r->devices[0].cc_minor = r->cc_minor;
    r->devices[0].total_bytes = r->total_bytes;
    r->wsl2 = spw_probe_is_wsl2();
    snprintf(r->nvml_note, sizeof r->nvml_note, "not queried: emulated device");
    *ops = &emu_ops;
    *out = d;
    return SPW_OK;
}

void spw_probe_emu_close(spw_probe_dev *d) {
    if (!d) return;
    d->b->ops->destroy(d->b);
    free(d);
}
