/*
 * spillway probe: what memory this GPU really has, how fast each path is, and whether device
 * allocations silently land in system memory.
 *
 * Files:
 *   probe_detect.c   pure functions: the fallback classifier, PCIe link arithmetic, budget rounding
 *   probe_measure.c  the measurement sequence (validated transfers, latencies, chunk scan, self-test),
 *                    written once against spw_probe_ops so cuda and emu share it
 *   probe_cuda.c     spw_probe_ops over the CUDA runtime + inventory (only when SPW_HAVE_CUDA)
 *   probe_nvml.c     optional NVML through dlopen: PCIe link and processes (only when SPW_HAVE_CUDA)
 *   probe_emu.c      spw_probe_ops over the emu backend (figures are emulated, and say so)
 *   probe_sys.c      host facts: WSL2, PCIe link from sysfs, process names
 *   probe_report.c   the table, the JSON object and the verdict text
 *   cmd_probe.c      arguments, backend choice, progress, exit status
 */
#ifndef SPW_PROBE_H
#define SPW_PROBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "backend.h"
#include "internal.h"

/* ---- probe_detect.c: pure functions, no device, no I/O ---- */

typedef enum spw_chunk_class {
    SPW_CHUNK_VRAM,    /* bandwidth consistent with the VRAM reference */
    SPW_CHUNK_SYSMEM,  /* far below the reference: backed by system memory */
    SPW_CHUNK_INVALID, /* no usable measurement (<= 0, NaN, inf) */
} spw_chunk_class;

typedef struct spw_chunk_verdict {
    spw_chunk_class cls;
    double ratio;      /* bandwidth / reference; 0 when invalid */
    char reason[160];
} spw_chunk_verdict;

/* A chunk is system memory when its bandwidth is below this fraction of the reference. VRAM is
 * an order of magnitude or more faster than any PCIe or C2C path to system memory, while
 * run-to-run noise on VRAM stays well within a factor of two, so 0.35 separates the two with
 * margin on both sides. */
#define SPW_DETECT_THRESHOLD 0.35
/* The reference is the median of at most this many leading chunks. */
#define SPW_DETECT_REF_MAX 5

/* Classify a series of chunk bandwidths (any unit; gbps[0] is, by contract, the first chunk
 * allocated, i.e. VRAM if anything is). The reference is the median of the consecutive leading
 * valid chunks (at most SPW_DETECT_REF_MAX) that are not themselves below threshold x the first
 * valid one, so one noisy chunk cannot drag it and a cliff right after chunk 0 cannot enter it.
 * Each chunk is flagged SYSMEM when below threshold x reference. Writes n verdicts to out and
 * returns the reference (0 when no chunk is valid: then every chunk is INVALID).
 * threshold <= 0 or >= 1 selects SPW_DETECT_THRESHOLD. */
double spw_probe_classify(const double *gbps, size_t n, double threshold, spw_chunk_verdict *out);
const char *spw_chunk_class_name(spw_chunk_class c); /* "vram", "sysmem", "invalid" */

/* Theoretical PCIe bandwidth per direction in GB/s (1e9 B/s) of a link of `gen` (1..6) and
 * `width` lanes: GT/s per lane x encoding (8b/10b for gen 1-2, 128b/130b after) / 8. 0 when gen
 * or width is unknown (<= 0 or gen > 6). */
double spw_probe_link_gbps(int gen, int width);
/* PCIe generation for a per-lane rate in GT/s (2.5 -> 1, ..., 64 -> 6); 0 if none matches. */
int spw_probe_gen_from_gts(double gts);
/* Generation from a sysfs link speed such as "32.0 GT/s PCIe" or "8 GT/s"; 0 if unparsable. */
int spw_probe_gen_from_sysfs(const char *text);

/* The budget to recommend for `usable` bytes of device memory before fallback: 95% of it,
 * rounded down to a multiple of 256 MiB (0 when that is under 256 MiB). */
size_t spw_probe_recommend_budget(size_t usable);
/* A size as the config parser reads it: "120GiB" when a whole number of GiB, else "N MiB"
 * written "NMiB" (exact for multiples of 1 MiB), else bytes. */
const char *spw_probe_size_arg(char *buf, size_t len, size_t bytes);
/* Median of n values (a copy is sorted; v is untouched). 0 when n == 0. */
double spw_probe_median(const double *v, size_t n);

/* ---- the measurement results ---- */

typedef enum spw_probe_path_id {
    SPW_PATH_PINNED_H2D,
    SPW_PATH_PINNED_D2H,
    SPW_PATH_BOTH,
    SPW_PATH_PAGEABLE_H2D,
    SPW_PATH_PAGEABLE_D2H,
    SPW_PATH_D2D,
    SPW_PATH_COUNT_
} spw_probe_path_id;

typedef struct spw_probe_path {
    const char *name;  /* JSON key: "pinned_h2d" */
    const char *label; /* table label */
    bool ran;          /* attempted */
    bool ok;           /* validated and timed */
    bool validated;
    int reps;
    size_t bytes;            /* bytes per transfer and direction */
    double best_gbps;        /* the headline figure: best of reps */
    double median_gbps;
    double theoretical_gbps; /* what efficiency is computed against; 0 when unknown */
    char error[256];
} spw_probe_path;

typedef enum spw_probe_lat_id { SPW_LAT_DEV_SMALL, SPW_LAT_DEV_LARGE, SPW_LAT_PINNED, SPW_LAT_COUNT_ } spw_probe_lat_id;

typedef struct spw_probe_latency {
    const char *name; /* JSON key */
    const char *api;  /* "cudaMalloc+cudaFree" */
    bool ran, ok;
    size_t bytes;
    int reps;
    double median_us, min_us;
    char error[256];
} spw_probe_latency;

typedef struct spw_probe_chunk {
    size_t bytes;
    double gbps;             /* read rate of the chunk into VRAM scratch: slowest window, best rep */
    bool validated;
    int remeasured;          /* extra reads because it first looked like system memory */
    spw_chunk_verdict v;
} spw_probe_chunk;

typedef struct spw_probe_link {
    bool known;
    const char *source; /* "nvml", "sysfs" or NULL */
    int cur_gen, cur_width, max_gen, max_width;
    double gbps; /* per direction, from max gen x max width */
} spw_probe_link;

typedef struct spw_probe_proc {
    unsigned pid;
    bool used_known;
    uint64_t used_bytes;
    char name[64];
} spw_probe_proc;

#define SPW_PROBE_MAX_DEVICES 16
#define SPW_PROBE_MAX_PROCS 32

typedef struct spw_probe_result {
    /* how it ran */
    const char *backend; /* "cuda" or "emu" */
    bool emulated, quick;
    char backend_note[256]; /* why this backend (auto) */
    int device;

    /* inventory of the probed device */
    char name[256];
    int cc_major, cc_minor;
    size_t total_bytes, free_bytes;
    int driver_version, runtime_version; /* 13000 = 13.0; 0 unknown */
    int concurrent_managed, pageable_access;
    int integrated;
    bool wsl2;
    char pci_bus_id[32];
    double vram_theoretical_gbps; /* 2 x memory clock x bus width; 0 unknown */
    double init_ms;               /* context creation */

    /* all devices (name, cc, total) */
    int device_count;
    struct {
        char name[256];
        int cc_major, cc_minor;
        size_t total_bytes;
    } devices[SPW_PROBE_MAX_DEVICES];

    /* NVML / link */
    bool nvml_available;
    char nvml_note[256];   /* why unavailable, or how it was matched */
    const char *nvml_match; /* "pci", "index" or NULL */
    spw_probe_link link;
    bool procs_known;
    int nprocs;
    spw_probe_proc procs[SPW_PROBE_MAX_PROCS];

    /* measured paths and latencies */
    spw_probe_path paths[SPW_PATH_COUNT_];
    spw_probe_latency lat[SPW_LAT_COUNT_];

    /* pinnable host memory: pinned allocations held at once until one is refused or the cap */
    bool pin_ran, pin_capped; /* capped: the cap was reached, none refused */
    size_t pin_chunk, pin_cap, pinnable_bytes;
    char pin_error[256]; /* the refusal */

    /* fallback scan */
    bool scan_ran, scan_ok;
    char scan_error[256];
    char scan_stop[320]; /* why the scan ended */
    size_t max_mem;      /* bytes the scan was allowed to hold */
    char max_mem_how[96];
    size_t chunk_bytes, window_bytes;
    int windows_per_chunk;
    spw_probe_chunk *chunks; /* malloc'd */
    size_t nchunks;
    double reference_gbps;
    size_t flagged;
    size_t scanned_bytes, usable_bytes; /* usable: VRAM chunks before the first non-VRAM one */
    bool fallback_detected;

    /* self-test: a chunk known to be host-backed must be flagged */
    bool selftest_ran, selftest_passed;
    size_t selftest_bytes;
    double selftest_gbps;
    spw_chunk_verdict selftest;
    char selftest_error[256];

    /* verdict */
    size_t recommended_budget;
    double elapsed_s;
    bool ok; /* every validation passed, no backend error, self-test passed (when it must) */
} spw_probe_result;

/* Fill names and labels; everything else zero. */
void spw_probe_result_init(spw_probe_result *r);
void spw_probe_result_free(spw_probe_result *r);

/* ---- the device seam of the measurements (probe_measure.c uses it; cuda and emu implement) ---- */

typedef struct spw_probe_dev spw_probe_dev;

/* Every function returns SPW_OK or an error with spw_last_error() naming the call; none aborts. */
typedef struct spw_probe_ops {
    const char *dev_alloc_api;  /* "cudaMalloc+cudaFree" */
    const char *host_alloc_api; /* "cudaHostAlloc+cudaFreeHost" */
    spw_status (*mem_info)(spw_probe_dev *d, size_t *free_bytes, size_t *total_bytes);
    spw_status (*dev_alloc)(spw_probe_dev *d, size_t bytes, void **out);
    spw_status (*dev_free)(spw_probe_dev *d, void *p);
    spw_status (*host_alloc)(spw_probe_dev *d, size_t bytes, void **out); /* pinned */
    spw_status (*host_free)(spw_probe_dev *d, void *p);
    /* Pinned host memory mapped for the device: *host for the CPU, *dev for device-side access.
     * This is the self-test's chunk "known to be host-backed". */
    spw_status (*mapped_alloc)(spw_probe_dev *d, size_t bytes, void **host, void **dev);
    spw_status (*mapped_free)(spw_probe_dev *d, void *host);
    spw_status (*stream_create)(spw_probe_dev *d, spw_stream *out); /* non-blocking */
    spw_status (*stream_destroy)(spw_probe_dev *d, spw_stream s);
    spw_status (*stream_sync)(spw_probe_dev *d, spw_stream s);
    spw_status (*memset_async)(spw_probe_dev *d, void *dev_ptr, int byte, size_t bytes, spw_stream s);
    /* kind D2D is also used to read a mapped pointer (device-side access): implementations let
     * the driver infer the direction (cudaMemcpyDefault) or translate it (emu). */
    spw_status (*copy_async)(spw_probe_dev *d, void *dst, const void *src, size_t bytes,
                             spw_copy_kind kind, spw_stream s);
    /* Timing events: record in stream order; elapsed waits for both and returns milliseconds. */
    spw_status (*event_create)(spw_probe_dev *d, spw_event *out);
    spw_status (*event_destroy)(spw_probe_dev *d, spw_event e);
    spw_status (*event_record)(spw_probe_dev *d, spw_event e, spw_stream s);
    spw_status (*stream_wait)(spw_probe_dev *d, spw_stream s, spw_event e);
    spw_status (*event_elapsed_ms)(spw_probe_dev *d, spw_event start, spw_event end, double *ms);
} spw_probe_ops;

/* Sizes and repetitions of one run. */
typedef struct spw_probe_plan {
    size_t xfer_bytes;        /* per transfer */
    int reps_pinned, reps_pageable, reps_d2d, reps_lat, reps_host_lat;
    size_t lat_small_bytes, host_lat_bytes;
    size_t pin_chunk, pin_cap; /* pinnable host memory: allocations of pin_chunk up to pin_cap (0: skip) */
    size_t max_mem;           /* explicit --max-mem bytes, or 0 */
    double max_mem_fraction;  /* of free when max_mem == 0 (0.9 default, or --max-mem N%) */
    size_t min_chunk;         /* chunk = max(min_chunk, limit / chunk_divisor) */
    size_t chunk_divisor;
    size_t window_bytes;      /* bytes read per window of a chunk */
    int windows_per_chunk;    /* start, middle, end */
    int reps_window;
    bool touch_whole_chunk;   /* memset every byte of a chunk (commits it, as a real user would) */
    size_t margin_bytes;      /* never leave less than this free during the scan */
    size_t selftest_bytes;
} spw_probe_plan;

typedef void (*spw_probe_progress_fn)(void *u, const char *step, size_t i, size_t n);

/* Run every measurement into r (whose inventory is already filled): paths, latencies, scan,
 * self-test, classification, usable bytes and budget. Failures are recorded in r and clear r->ok;
 * everything allocated is freed before it returns. */
void spw_probe_measure(const spw_probe_ops *ops, spw_probe_dev *d, const spw_probe_plan *plan,
                       spw_probe_result *r, spw_probe_progress_fn progress, void *pu);

/* ---- backends of the probe ---- */

/* Devices the CUDA runtime sees; 0 with the reason in why (no driver, no device, built
 * without CUDA). Never fails loudly. */
int spw_probe_cuda_count(char *why, size_t len);
/* Open device r->device on CUDA, fill the inventory (including NVML and sysfs) and the ops. */
spw_status spw_probe_cuda_open(spw_probe_result *r, const spw_probe_ops **ops, spw_probe_dev **d);
void spw_probe_cuda_close(spw_probe_dev *d);

/* The emu backend throttles host<->device copies to this rate (emu_h2d_gbps), an emulated link
 * far slower than host memcpy, so that the self-test's host-backed chunk is told apart from
 * emulated VRAM on emu too and the whole pipeline runs in CI. */
#define SPW_PROBE_EMU_LINK_GBPS 0.5
spw_status spw_probe_emu_open(spw_probe_result *r, const spw_probe_ops **ops, spw_probe_dev **d);
void spw_probe_emu_close(spw_probe_dev *d);

/* probe_nvml.c: fill r->link and r->procs from NVML for the device with PCI bus id `bus_id`
 * (fallback: NVML index `index`); records why in r->nvml_note when NVML is missing. */
void spw_probe_nvml_query(spw_probe_result *r, const char *bus_id, int index);

/* ---- probe_sys.c ---- */
bool spw_probe_is_wsl2(void);
/* MemAvailable of /proc/meminfo in bytes; 0 when unknown. */
size_t spw_probe_host_available(void);
/* PCIe link of `bus_id` ("0000:1b:00.0", any case) from /sys/bus/pci/devices; false if absent. */
bool spw_probe_sysfs_link(const char *bus_id, spw_probe_link *out);
/* Process name from /proc/<pid>/comm, "?" when not visible (another PID namespace). */
void spw_probe_proc_name(unsigned pid, char *buf, size_t len);

/* ---- probe_report.c ---- */
void spw_probe_print_table(const spw_probe_result *r, FILE *f);
void spw_probe_print_json(const spw_probe_result *r, FILE *f);

#endif
