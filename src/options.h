/*
 * The configuration (options.c): every option of spw_config, and size options that may be a
 * percentage of the device.
 */
#ifndef SPW_OPTIONS_H
#define SPW_OPTIONS_H

#include "internal.h"

typedef enum spw_backend_kind { SPW_BACKEND_AUTO, SPW_BACKEND_CUDA, SPW_BACKEND_EMU } spw_backend_kind;
typedef enum spw_exhaust_mode { SPW_EXHAUST_EVICT, SPW_EXHAUST_FAIL } spw_exhaust_mode;
typedef enum spw_tristate { SPW_TRI_AUTO, SPW_TRI_ON, SPW_TRI_OFF } spw_tristate;
typedef enum spw_residency_kind { SPW_RES_EXPLICIT, SPW_RES_MANAGED } spw_residency_kind;
typedef enum spw_policy_kind { SPW_POLICY_LRU, SPW_POLICY_PLAN } spw_policy_kind;

/* A size that may be a percentage of the device (size.h). */
typedef spw_size_spec spw_size_opt;

/* Every option, by name. Adding an option = one X line + its field + parse kind. */
struct spw_config {
    spw_size_opt budget;        /* device budget */
    spw_backend_kind backend;
    int device;
    spw_exhaust_mode on_exhaust;
    spw_tristate vmm;
    size_t vmm_page;            /* emu: VMM granularity */
    size_t vmm_large_page;      /* VMM: mapping unit of the large-block arena (at least the granularity) */
    double frag_slack;          /* held may exceed live by this fraction before cache is trimmed */
    spw_tristate prefetch;      /* policy=plan: prefetch ahead (auto = on) */
    int prefetch_early;         /* policy=plan: prefetches allowed ahead of the optimal schedule;
                                   -1: auto (tuned by measuring steps) */
    int pipeline;               /* policy=plan: 0 = auto (timed), else the one named: 1 none, 2 the
                                   double buffer, 3 the static split, 4 the split with one slot */
    int prefetch_thread;        /* policy=plan: 1 = the prefetches after an acquire run on a worker */
    int prefetch_trim;          /* 0 = a prefetch whose room needs a trim is declined */
    int ring;                   /* 0 = a split's streamed uploads take room as any other upload */
    int host_register;          /* 0 = caller memory registered as a host copy is left pageable */
    size_t pin_limit;           /* caller memory this context page-locks at most */
    int pin_rebalance;          /* 1 = page-locked memory goes to the buffers that move (pin_share.c) */
    double grow_ahead;          /* on growth, map this fraction of held bytes beyond the request */
    size_t emu_capacity;
    int emu_link_gbps;          /* emu: simulated copy rate, 0 = memcpy speed */
    size_t emu_pin_limit;       /* emu: host bytes that can be page-locked */
    size_t small_limit;         /* requests at most this go to the small-block arena */
    spw_residency_kind residency; /* offload engine: default residency of buffers */
    spw_policy_kind policy;     /* offload engine: eviction/prefetch policy */
    spw_size_opt host_budget;   /* pinned host pool limit (percent: of physical RAM) */
    char trace[256];            /* Chrome trace JSON of engine events ("" = off) */
};

/* Resolve a size option against a device total. */
size_t spw__size_resolve(const spw_size_opt *o, size_t device_total);
/* Parse "N%" or a size. */
spw_status spw__parse_size_opt(const char *text, spw_size_opt *out);

#endif /* SPW_OPTIONS_H */
