/*
 * The interposer's accounting, configuration and routing table, kept free of CUDA and of
 * dynamic-loader tricks so that tests/test_preload.c can exercise every rule without a GPU.
 * The shim (shim.c) supplies device numbers, physical sizes and real function pointers.
 *
 * Thread safety: the ledger functions take the ledger's mutex themselves and never call out
 * of this file while holding it. The routing table is filled once and read-only afterwards.
 */
#ifndef SPWP_LEDGER_H
#define SPWP_LEDGER_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SPWP_MAX_DEVICES 64
#define SPWP_UNLIMITED UINT64_MAX

/* ---- configuration ---- */

/* A size, in bytes or as a percentage of the device's physical memory. */
typedef struct spwp_size {
    uint64_t bytes;  /* when !is_percent */
    double percent;  /* 0 < percent <= 100 when is_percent */
    bool is_percent;
    bool set;
} spwp_size;

typedef struct spwp_config {
    spwp_size budget_default;              /* devices without their own entry */
    spwp_size budget_dev[SPWP_MAX_DEVICES]; /* per-device entries ("1:8GiB") */
    bool report;                           /* summary on stderr at exit */
    bool charge_managed;                   /* cuMemAllocManaged counts against the budget */
    bool debug;                            /* log routing decisions on stderr */
} spwp_config;

/* Parse a size in the library's size grammar (src/size.h, compiled in): at least 1 byte, or,
 * when allow_percent, "N%" with 0 < N <= 100. Returns 0, or -1 with a message in err that
 * quotes the text. */
int spwp_parse_size(const char *text, bool allow_percent, spwp_size *out, char *err, size_t errlen);

/* Parse a budget: entries separated by ';', each "SIZE" (every device without an entry of its
 * own) or "DEV:SIZE" (CUDA ordinal DEV, 0..63). Examples: "4GiB", "50%", "0:4GiB;1:8GiB",
 * "4GiB;1:50%". Duplicate or empty entries are errors. Writes only cfg's budget fields, and
 * only on success. */
int spwp_parse_budget(const char *text, spwp_config *cfg, char *err, size_t errlen);

/* Parse 1/0, true/false, yes/no, on/off. */
int spwp_parse_bool(const char *key, const char *text, bool *out, char *err, size_t errlen);

/* The configuration from the environment's values (each may be NULL):
 *   conf       SPILLWAY_CONF: "key=value,..."; the keys budget, report, charge_managed and debug
 *              are read; other keys belong to the library's options table and are left to it.
 *   budget     SPILLWAY_BUDGET (overrides conf's budget)
 *   report     SPILLWAY_REPORT (overrides conf's report)
 *   managed    SPILLWAY_CHARGE_MANAGED (overrides conf's charge_managed)
 * Defaults: no budget (uncapped), report off, charge_managed on. Returns 0 or -1 with err naming
 * the variable and key; on error *cfg holds the defaults. */
int spwp_config_load(spwp_config *cfg, const char *conf, const char *budget, const char *report,
                     const char *managed, char *err, size_t errlen);

/* ---- accounting ---- */

/* What a tracked key names; keys of different kinds never collide. */
enum { SPWP_KIND_PTR = 1, SPWP_KIND_HANDLE = 2, SPWP_KIND_ARRAY = 3, SPWP_KIND_MIPMAP = 4 };

typedef struct spwp_devstate {
    uint64_t physical;  /* 0 until known */
    uint64_t charged;   /* bytes of live charged allocations (and reservations in flight) */
    uint64_t peak;
    uint64_t refusals;
    uint64_t charges;   /* successful reservations */
    bool used;          /* anything was charged or refused here */
} spwp_devstate;

typedef struct spwp_entry {
    uint64_t key;
    uint64_t bytes;
    int32_t dev;
    uint8_t kind;  /* 0 empty, 0xff tombstone */
} spwp_entry;

typedef struct spwp_ledger {
    pthread_mutex_t lock;
    spwp_config cfg;
    spwp_devstate dev[SPWP_MAX_DEVICES];
    spwp_entry *table; /* open addressing, linear probing; capacity a power of two */
    size_t cap, count, tombs;
    uint64_t untracked; /* allocations whose table insert failed: their charge is kept */
} spwp_ledger;

/* What a refusal is reported with. */
typedef struct spwp_refusal {
    uint64_t requested, charged, budget;
} spwp_refusal;

void spwp_ledger_init(spwp_ledger *l, const spwp_config *cfg);
/* Frees the table (tests; the shim's ledger lives until exit). */
void spwp_ledger_destroy(spwp_ledger *l);

/* True when the device's physical size is unknown (the shim then asks the driver, without the
 * lock, and calls set_physical). Devices out of range never need it. */
bool spwp_ledger_needs_physical(spwp_ledger *l, int dev);
/* Record the physical size once; later calls are ignored so the budget never changes. */
void spwp_ledger_set_physical(spwp_ledger *l, int dev, uint64_t physical);
/* The resolved budget in bytes; SPWP_UNLIMITED when the device has none, or when it is a
 * percentage and the physical size is still unknown. */
uint64_t spwp_ledger_budget(spwp_ledger *l, int dev);

/* Reserve bytes on dev before the driver call. Returns true and charges; or false, charging
 * nothing, counting a refusal and filling *why. Devices out of range are never charged and
 * always accepted. A zero-byte request is accepted and charges nothing. */
bool spwp_ledger_reserve(spwp_ledger *l, int dev, uint64_t bytes, spwp_refusal *why);
/* Give back a reservation (driver call failed, or the tracked allocation was freed). */
void spwp_ledger_refund(spwp_ledger *l, int dev, uint64_t bytes);
/* Remember that (kind, key) holds bytes charged on dev. If the table cannot grow, the charge
 * stays (counted in untracked) and false is returned: erring towards the budget, never past it. */
bool spwp_ledger_track(spwp_ledger *l, int kind, uint64_t key, int dev, uint64_t bytes);
/* Forget (kind, key); true with its device and bytes when it was tracked. Does not refund:
 * the shim refunds after the driver has freed, and re-tracks if the free failed. */
bool spwp_ledger_untrack(spwp_ledger *l, int kind, uint64_t key, int *dev, uint64_t *bytes);

/* Memory as the program should see it on dev, from the driver's physical free and total:
 * total = min(budget, physical), free = min(physical free, total - charged). When
 * learn_physical, an unknown physical size is recorded from phys_total (the CUDA queries);
 * otherwise (NVML, whose total may differ slightly) a percentage budget is taken of phys_total
 * for this answer only. */
void spwp_ledger_view(spwp_ledger *l, int dev, uint64_t phys_free, uint64_t phys_total,
                      bool learn_physical, uint64_t *free_out, uint64_t *total_out);
/* The same rule as a pure function (budget SPWP_UNLIMITED for none). */
void spwp_view_math(uint64_t budget, uint64_t charged, uint64_t phys_free, uint64_t phys_total,
                    uint64_t *free_out, uint64_t *total_out);

/* Snapshot of dev's counters (zeroes when out of range). */
spwp_devstate spwp_ledger_state(spwp_ledger *l, int dev);

/* Bytes charged for an array: width x max(height,1) x max(depth,1) elements (elem_bytes_x2 is
 * twice the bytes per element, so that 4-bit block formats are exact), summed over `levels`
 * mipmap levels halving width and height (min 1), and depth too unless depth_is_layers
 * (layered arrays and cubemaps keep their layer count). Saturates at UINT64_MAX. The driver may
 * pad; this is the charge, not a promise about the driver's layout. */
uint64_t spwp_array_bytes(uint64_t width, uint64_t height, uint64_t depth, uint64_t elem_bytes_x2,
                          unsigned levels, bool depth_is_layers);

/* ---- routing: real driver function pointer -> the shim's wrapper ---- */

#define SPWP_ROUTES_MAX 128

typedef struct spwp_routes {
    size_t n;
    struct {
        const void *real;
        void *wrap;
    } e[SPWP_ROUTES_MAX];
} spwp_routes;

/* Add real -> wrap. Returns 0 when added; 1 when ignored (real NULL, real == wrap, or real
 * already mapped: the first mapping wins so a pointer always has one wrapper); -1 when full. */
int spwp_routes_add(spwp_routes *t, const void *real, void *wrap);
/* The wrapper for real, or NULL when real is not a function the shim wraps. */
void *spwp_routes_find(const spwp_routes *t, const void *real);

#endif
