/*
 * Optional NVML, opened with dlopen so that the tool starts without it: PCIe link (current and
 * maximum) and the processes holding memory on the probed device. The few NVML types and
 * functions used are declared here; their layouts are NVML's stable ABI.
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "probe.h"

typedef int nvmlReturn_t; /* 0 = NVML_SUCCESS */
typedef struct nvmlDevice_st *nvmlDevice_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFull

/* nvmlProcessInfo_t of the _v2 and _v3 entry points */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvml_proc_v2;
/* the unsuffixed (v1) entry point */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvml_proc_v1;

typedef nvmlReturn_t (*fn_void)(void);
typedef const char *(*fn_errstr)(nvmlReturn_t);
typedef nvmlReturn_t (*fn_by_index)(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t (*fn_by_pci)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*fn_uint)(nvmlDevice_t, unsigned int *);
typedef nvmlReturn_t (*fn_procs)(nvmlDevice_t, unsigned int *, void *);

/* dlsym returns void *; converting it to a function pointer through memcpy keeps -Wpedantic
 * quiet (ISO C has no object-to-function pointer conversion; POSIX guarantees it works). */
static void *sym(void *lib, const char *name) { return dlsym(lib, name); }
#define LOAD(T, var, lib, name)                                                                \
    T var = NULL;                                                                              \
    do {                                                                                       \
        void *p_ = sym(lib, name);                                                             \
        memcpy(&var, &p_, sizeof var);                                                         \
    } while (0)

static const char *errstr(fn_errstr f, nvmlReturn_t e) {
    const char *s = f ? f(e) : NULL;
    return s ? s : "unknown NVML error";
}

static void query_procs(spw_probe_result *r, void *lib, nvmlDevice_t dev) {
    static const char *const names[] = {"nvmlDeviceGetComputeRunningProcesses_v3",
                                        "nvmlDeviceGetComputeRunningProcesses_v2",
                                        "nvmlDeviceGetComputeRunningProcesses"};
    for (int v = 0; v < 3; v++) {
        LOAD(fn_procs, f, lib, names[v]);
        if (!f) continue;
        size_t el = v < 2 ? sizeof(nvml_proc_v2) : sizeof(nvml_proc_v1);
        unsigned int count = SPW_PROBE_MAX_PROCS;
        unsigned char *buf = calloc(SPW_PROBE_MAX_PROCS, el);
        if (!buf) return;
        nvmlReturn_t e = f(dev, &count, buf);
        if (e == NVML_ERROR_INSUFFICIENT_SIZE) {
            /* more than we list: show the first SPW_PROBE_MAX_PROCS of a second call */
            unsigned int want = count;
            unsigned char *big = calloc(want ? want : 1, el);
            if (!big) {
                free(buf);
                return;
            }
            e = f(dev, &want, big);
            if (e == NVML_SUCCESS) {
                count = want < SPW_PROBE_MAX_PROCS ? want : SPW_PROBE_MAX_PROCS;
                memcpy(buf, big, count * el);
            }
            free(big);
        }
        if (e == NVML_SUCCESS) {
            r->procs_known = true;
            r->nprocs = (int)(count < SPW_PROBE_MAX_PROCS ? count : SPW_PROBE_MAX_PROCS);
            for (int i = 0; i < r->nprocs; i++) {
                unsigned int pid;
                unsigned long long used;
                if (v < 2) {
                    nvml_proc_v2 p;
                    memcpy(&p, buf + (size_t)i * el, sizeof p);
                    pid = p.pid, used = p.usedGpuMemory;
                } else {
                    nvml_proc_v1 p;
                    memcpy(&p, buf + (size_t)i * el, sizeof p);
                    pid = p.pid, used = p.usedGpuMemory;
                }
                r->procs[i].pid = pid;
                /* WDDM (Windows, WSL2) does not report per-process memory */
                r->procs[i].used_known = used != NVML_VALUE_NOT_AVAILABLE_ULL;
                r->procs[i].used_bytes = r->procs[i].used_known ? used : 0;
                spw_probe_proc_name(pid, r->procs[i].name, sizeof r->procs[i].name);
            }
        }
        free(buf);
        return; /* the newest entry point present decides */
    }
}

void spw_probe_nvml_query(spw_probe_result *r, const char *bus_id, int index) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(r->nvml_note, sizeof r->nvml_note, "NVML not available (%s)", e ? e : "dlopen failed");
        return;
    }
    LOAD(fn_void, init, lib, "nvmlInit_v2");
    LOAD(fn_void, shutdown, lib, "nvmlShutdown");
    LOAD(fn_errstr, es, lib, "nvmlErrorString");
    LOAD(fn_by_pci, by_pci, lib, "nvmlDeviceGetHandleByPciBusId_v2");
    LOAD(fn_by_index, by_index, lib, "nvmlDeviceGetHandleByIndex_v2");
    LOAD(fn_uint, cur_gen, lib, "nvmlDeviceGetCurrPcieLinkGeneration");
    LOAD(fn_uint, cur_width, lib, "nvmlDeviceGetCurrPcieLinkWidth");
    LOAD(fn_uint, max_gen, lib, "nvmlDeviceGetMaxPcieLinkGeneration");
    LOAD(fn_uint, max_width, lib, "nvmlDeviceGetMaxPcieLinkWidth");
    if (!init || !shutdown) {
        snprintf(r->nvml_note, sizeof r->nvml_note, "NVML library lacks nvmlInit_v2");
        dlclose(lib);
        return;
    }
    nvmlReturn_t e = init();
    if (e != NVML_SUCCESS) {
        snprintf(r->nvml_note, sizeof r->nvml_note, "nvmlInit_v2 failed: %s", errstr(es, e));
        dlclose(lib);
        return;
    }
    r->nvml_available = true;

    /* CUDA and NVML number devices differently (CUDA_VISIBLE_DEVICES, FASTEST_FIRST order):
     * match by PCI bus id, and only fall back to the index when that fails. */
    nvmlDevice_t dev = NULL;
    e = by_pci && bus_id && bus_id[0] ? by_pci(bus_id, &dev) : -1;
    if (e == NVML_SUCCESS) {
        r->nvml_match = "pci";
        snprintf(r->nvml_note, sizeof r->nvml_note, "matched by PCI bus id %s", bus_id);
    } else if (by_index && (e = by_index((unsigned)index, &dev)) == NVML_SUCCESS) {
        r->nvml_match = "index";
        snprintf(r->nvml_note, sizeof r->nvml_note,
                 "PCI bus id %s not found by NVML; matched by index %d, which may be another GPU",
                 bus_id ? bus_id : "?", index);
    } else {
        snprintf(r->nvml_note, sizeof r->nvml_note, "NVML has no device for PCI bus id %s: %s",
                 bus_id ? bus_id : "?", errstr(es, e));
        dev = NULL;
    }

    if (dev) {
        unsigned cg = 0, cw = 0, mg = 0, mw = 0;
        bool okc = cur_gen && cur_width && cur_gen(dev, &cg) == NVML_SUCCESS && cur_width(dev, &cw) == NVML_SUCCESS;
        bool okm = max_gen && max_width && max_gen(dev, &mg) == NVML_SUCCESS && max_width(dev, &mw) == NVML_SUCCESS;
        if (okc || okm) {
            r->link.source = "nvml";
            r->link.cur_gen = okc ? (int)cg : 0;
            r->link.cur_width = okc ? (int)cw : 0;
            r->link.max_gen = okm ? (int)mg : 0;
            r->link.max_width = okm ? (int)mw : 0;
            /* Idle links train down (and virtualized ones may report a lower current gen), so
             * the theoretical figure comes from the maximum. */
            r->link.gbps = okm ? spw_probe_link_gbps(r->link.max_gen, r->link.max_width)
                               : spw_probe_link_gbps(r->link.cur_gen, r->link.cur_width);
            r->link.known = r->link.gbps > 0;
        }
        query_procs(r, lib, dev);
    }
    shutdown();
    dlclose(lib);
}
