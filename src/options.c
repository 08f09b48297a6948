/*
 * The options table: one row per option (name, kind, default, help, field). Values arrive as
 * text from SPILLWAY_CONF or spw_config_set; every value is validated, and a bad one is an error
 * naming the key and what it accepts. Nothing is silently ignored.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "options.h"

typedef enum opt_kind { OPT_SIZE, OPT_SIZE_PCT, OPT_ENUM, OPT_INT, OPT_INT_AUTO, OPT_FRACTION, OPT_STRING } opt_kind;

typedef struct opt_def {
    const char *name;
    opt_kind kind;
    const char *def;
    const char *choices; /* OPT_ENUM: "a|b|c", value stored as the index */
    size_t offset;
    const char *help;
} opt_def;

#define OFF(f) offsetof(struct spw_config, f)

static const opt_def options[] = {
    {"budget", OPT_SIZE_PCT, "90%", NULL, OFF(budget),
     "device bytes the context may hold: a size (6GiB) or a percentage of the device (80%)"},
    {"backend", OPT_ENUM, "auto", "auto|cuda|emu", OFF(backend),
     "auto picks cuda when a device is present, else emu"},
    {"device", OPT_INT, "0", NULL, OFF(device), "CUDA device index"},
    {"on_exhaust", OPT_ENUM, "evict", "evict|fail", OFF(on_exhaust),
     "at the budget: evict movable buffers first, or fail at once (no fallback)"},
    {"vmm", OPT_ENUM, "auto", "auto|on|off", OFF(vmm),
     "grow segments in place with virtual memory mapping where the device supports it"},
    {"vmm_page", OPT_SIZE, "2MiB", NULL, OFF(vmm_page),
     "emu: mapping granularity (cuda uses the device's)"},
    {"vmm_large_page", OPT_SIZE, "2MiB", NULL, OFF(vmm_large_page),
     "VMM: mapping unit of the large-block arena, one physical allocation each (rounded up to a "
     "power-of-two multiple of the granularity, at most 1GiB); larger units make copies over large "
     "buffers cheaper to enqueue and return cached memory in coarser steps"},
    {"frag_slack", OPT_FRACTION, "0.02", NULL, OFF(frag_slack),
     "cached memory allowed above live before the cache is trimmed on growth (fraction)"},
    {"grow_ahead", OPT_FRACTION, "0.01", NULL, OFF(grow_ahead),
     "on growth, map this fraction of the held bytes beyond the request (fewer backend calls)"},
    {"emu_capacity", OPT_SIZE, "80GiB", NULL, OFF(emu_capacity), "emu: device memory size"},
    {"emu_link_gbps", OPT_INT, "0", NULL, OFF(emu_link_gbps),
     "emu: host<->device copies take bytes / this rate in GB/s, as over a link (0: memcpy speed)"},
    {"emu_pin_limit", OPT_SIZE, "64TiB", NULL, OFF(emu_pin_limit),
     "emu: host bytes that pinned allocations and registrations can page-lock in all, as a "
     "system that limits pinned memory (WSL2) does; past it they are refused"},
    {"small_limit", OPT_SIZE, "1MiB", NULL, OFF(small_limit),
     "requests up to this size come from the small-block arena"},
    {"residency", OPT_ENUM, "explicit", "explicit|managed", OFF(residency),
     "buffers: pinned host copy + async copies (explicit), or CUDA Unified Memory (managed)"},
    {"policy", OPT_ENUM, "lru", "lru|plan", OFF(policy),
     "buffers: eviction policy: least recently used, or plan (learn a step, evict by next use, "
     "prefetch ahead)"},
    {"prefetch", OPT_ENUM, "auto", "auto|on|off", OFF(prefetch),
     "policy=plan: prefetch the next buffers of the plan so transfers overlap work (costs one "
     "buffer of device memory for the double buffer); auto: on where transfers take time (cuda), "
     "off on the instant emu device; off moves the fewest bytes"},
    {"prefetch_early", OPT_INT_AUTO, "auto", NULL, OFF(prefetch_early),
     "policy=plan: buffers it may prefetch ahead of the byte-optimal schedule (each can cost one "
     "extra transfer, but keeps the link busy during runs of resident buffers); auto times no "
     "prefetch at all, a double buffer, a static split (a fixed set, the rest through two "
     "buffers of room) and a split with one buffer of room and a quarter (each upload starts "
     "beside the buffer it replaces while that one is still read) for three steps each (the "
     "last two timed) and keeps the fastest"},
    {"pipeline", OPT_ENUM, "auto", "auto|none|double|split|slot", OFF(pipeline),
     "policy=plan, prefetch on: the pipeline that runs; auto times them (prefetch_early=auto); a "
     "name runs that one from the first step that follows the plan, untimed: none (no prefetch), "
     "double (the double buffer, prefetch_early=N deeper), split (the static split) or slot (the "
     "split with one slot, left for the static split when its room does not hold)"},
    {"prefetch_thread", OPT_ENUM, "off", "off|on", OFF(prefetch_thread),
     "policy=plan: issue the prefetches that follow each acquire from a worker thread, so that "
     "the acquiring call does not enqueue the next buffers' copies itself; while a step is open "
     "(spw_step_begin) the worker polls, yielding its core, instead of sleeping, and watches the "
     "uploads it enqueued, so that acquiring one it saw complete takes no driver call"},
    {"host_register", OPT_ENUM, "on", "off|on", OFF(host_register),
     "buffers: page-lock caller memory registered as a buffer's host copy; off leaves it pageable "
     "(as a system that refuses to pin it does: copies from it are staged by the driver)"},
    {"pin_limit", OPT_SIZE, "64TiB", NULL, OFF(pin_limit),
     "buffers: caller memory registered as host copies that this context page-locks at most; the "
     "rest stays pageable (page-locked memory is taken from the whole system)"},
    {"pin_rebalance", OPT_ENUM, "on", "off|on", OFF(pin_rebalance),
     "buffers: when some registered host copies are pageable (pin_limit, or a system that limits "
     "pinned memory), give the page-locked memory to the buffers that move, at the ends of steps "
     "2, 4, 8, 16, 32, 64 and every 64th after: host copies not uploaded since the previous of "
     "these are unlocked, those uploaded in the step page-locked"},
    {"prefetch_trim", OPT_ENUM, "on", "off|on", OFF(prefetch_trim),
     "a prefetch may return cached device memory to make its room (a trim, which waits for the "
     "device); off declines such a prefetch and leaves the room to the demand load (steps with "
     "buffers of many sizes, where the trims would stall every step)"},
    {"ring", OPT_ENUM, "off", "off|on", OFF(ring),
     "policy=plan, vmm: on streams a static split's buffers through its room in turn, each upload "
     "placed after the one before it and evicting the oldest, whose work is done (a ring, room for "
     "three of the largest); off places them as any other upload (where a victim's bytes happen to "
     "be). Off by default until measured on a GPU"},
    {"host_budget", OPT_SIZE_PCT, "50%", NULL, OFF(host_budget),
     "pinned host bytes the buffer host pool may hold: a size or a percentage of physical RAM"},
    {"trace", OPT_STRING, "", NULL, OFF(trace),
     "write a Chrome trace JSON of copies, evictions and stalls to this file (Perfetto)"},
};
#define N_OPTIONS (sizeof options / sizeof options[0])

static const opt_def *find_opt(const char *name, size_t len) {
    for (size_t i = 0; i < N_OPTIONS; i++)
        if (strlen(options[i].name) == len && !strncmp(options[i].name, name, len)) return &options[i];
    return NULL;
}

static spw_status unknown_key(const char *key, size_t len) {
    char names[512] = "";
    for (size_t i = 0; i < N_OPTIONS; i++) {
        if (i) strncat(names, ", ", sizeof names - strlen(names) - 1);
        strncat(names, options[i].name, sizeof names - strlen(names) - 1);
    }
    return spw__error(SPW_ERR_CONFIG, "unknown option '%.*s' (known: %s)", (int)len, key, names);
}

/* Parse one value into cfg; on error cfg is unchanged. */
static spw_status set_one(spw_config *cfg, const opt_def *d, const char *value) {
    char *field = (char *)cfg + d->offset;
    switch (d->kind) {
    case OPT_SIZE:
    case OPT_SIZE_PCT: {
        spw_size_spec v;
        char err[SPW_SIZE_ERR_MAX];
        unsigned flags = SPW_SIZE_NONZERO | (d->kind == OPT_SIZE_PCT ? SPW_SIZE_PERCENT : 0);
        if (spw__size_parse(value, flags, &v, err, sizeof err))
            return spw__error(SPW_ERR_CONFIG, "option '%s': %s", d->name, err);
        if (d->kind == OPT_SIZE) {
            size_t b = (size_t)v.bytes;
            memcpy(field, &b, sizeof b);
        } else {
            memcpy(field, &v, sizeof v);
        }
        return SPW_OK;
    }
    case OPT_ENUM: {
        const char *c = d->choices;
        for (int idx = 0; *c; idx++) {
            const char *bar = strchr(c, '|');
            size_t n = bar ? (size_t)(bar - c) : strlen(c);
            if (strlen(value) == n && !strncmp(value, c, n)) {
                memcpy(field, &idx, sizeof idx);
                return SPW_OK;
            }
            c += n + (bar ? 1 : 0);
        }
        return spw__error(SPW_ERR_CONFIG, "option '%s': bad value '%s' (accepted: %s)", d->name, value,
                          d->choices);
    }
    case OPT_INT_AUTO:
        if (!strcmp(value, "auto")) {
            int iv = -1;
            memcpy(field, &iv, sizeof iv);
            return SPW_OK;
        }
        /* fall through */
    case OPT_INT: {
        char *end;
        errno = 0;
        long v = strtol(value, &end, 10);
        if (errno || end == value || *end || v < 0 || v > 1024)
            return spw__error(SPW_ERR_CONFIG, "option '%s': bad value '%s' (a whole number 0..1024%s)",
                              d->name, value, d->kind == OPT_INT_AUTO ? " or auto" : "");
        int iv = (int)v;
        memcpy(field, &iv, sizeof iv);
        return SPW_OK;
    }
    case OPT_STRING: {
        size_t n = strlen(value);
        if (n >= sizeof ((struct spw_config *)0)->trace)
            return spw__error(SPW_ERR_CONFIG, "option '%s': value longer than %zu characters", d->name,
                              sizeof ((struct spw_config *)0)->trace - 1);
        memcpy(field, value, n + 1);
        return SPW_OK;
    }
    case OPT_FRACTION: {
        char *end;
        errno = 0;
        double v = strtod(value, &end);
        if (errno || end == value || *end || !isfinite(v) || v < 0 || v > 10)
            return spw__error(SPW_ERR_CONFIG, "option '%s': bad value '%s' (a number 0..10)", d->name,
                              value);
        memcpy(field, &v, sizeof v);
        return SPW_OK;
    }
    }
    return spw__error(SPW_ERR_CONFIG, "option '%s': internal kind error", d->name);
}

SPW_API spw_status spw_config_create(spw_config **out) {
    if (!out) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_config_create: out is NULL");
    spw_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg) return spw__error(SPW_ERR_HOST_OUT_OF_MEMORY, "spw_config_create: out of host memory");
    for (size_t i = 0; i < N_OPTIONS; i++) {
        spw_status st = set_one(cfg, &options[i], options[i].def);
        if (st) {
            free(cfg);
            return st;
        }
    }
    *out = cfg;
    return SPW_OK;
}

SPW_API void spw_config_destroy(spw_config *cfg) { free(cfg); }

SPW_API spw_status spw_config_set(spw_config *cfg, const char *key, const char *value) {
    if (!cfg || !key || !value)
        return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_config_set: NULL %s",
                          !cfg ? "config" : !key ? "key" : "value");
    const opt_def *d = find_opt(key, strlen(key));
    if (!d) return unknown_key(key, strlen(key));
    return set_one(cfg, d, value);
}

SPW_API spw_status spw_config_parse(spw_config *cfg, const char *list) {
    if (!cfg || !list) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_config_parse: NULL argument");
    spw_config tmp = *cfg; /* all or nothing */
    const char *p = list;
    while (*p) {
        while (*p == ',' || isspace((unsigned char)*p)) p++;
        if (!*p) break;
        const char *item_end = strchr(p, ',');
        if (!item_end) item_end = p + strlen(p);
        const char *eq = memchr(p, '=', (size_t)(item_end - p));
        if (!eq)
            return spw__error(SPW_ERR_CONFIG, "option '%.*s': expected key=value", (int)(item_end - p), p);
        const char *k = p, *ke = eq;
        while (ke > k && isspace((unsigned char)ke[-1])) ke--;
        const opt_def *d = find_opt(k, (size_t)(ke - k));
        if (!d) return unknown_key(k, (size_t)(ke - k));
        const char *v = eq + 1;
        while (v < item_end && isspace((unsigned char)*v)) v++;
        const char *ve = item_end;
        while (ve > v && isspace((unsigned char)ve[-1])) ve--;
        char value[256];
        if ((size_t)(ve - v) >= sizeof value)
            return spw__error(SPW_ERR_CONFIG, "option '%s': value too long", d->name);
        memcpy(value, v, (size_t)(ve - v));
        value[ve - v] = '\0';
        spw_status st = set_one(&tmp, d, value);
        if (st) return st;
        p = item_end;
    }
    *cfg = tmp;
    return SPW_OK;
}

SPW_API spw_status spw_config_from_env(spw_config *cfg) {
    if (!cfg) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_config_from_env: config is NULL");
    const char *env = getenv("SPILLWAY_CONF");
    if (!env) return SPW_OK;
    spw_status st = spw_config_parse(cfg, env);
    if (st) return spw__error_prefix(st, "SPILLWAY_CONF");
    return SPW_OK;
}

SPW_API spw_status spw_config_get(const spw_config *cfg, const char *key, char *buf, size_t len) {
    if (!cfg || !key || !buf || !len) return spw__error(SPW_ERR_INVALID_ARGUMENT, "spw_config_get: NULL argument");
    const opt_def *d = find_opt(key, strlen(key));
    if (!d) return unknown_key(key, strlen(key));
    const char *field = (const char *)cfg + d->offset;
    switch (d->kind) {
    case OPT_SIZE: {
        size_t v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, len, "%zu", v);
        break;
    }
    case OPT_SIZE_PCT: {
        spw_size_opt v;
        memcpy(&v, field, sizeof v);
        if (v.is_percent) snprintf(buf, len, "%g%%", v.percent);
        else snprintf(buf, len, "%zu", v.bytes);
        break;
    }
    case OPT_ENUM: {
        int idx;
        memcpy(&idx, field, sizeof idx);
        const char *c = d->choices;
        for (int i = 0; i < idx && c; i++) {
            c = strchr(c, '|');
            if (c) c++;
        }
        size_t n = c ? (strchr(c, '|') ? (size_t)(strchr(c, '|') - c) : strlen(c)) : 0;
        snprintf(buf, len, "%.*s", (int)n, c ? c : "");
        break;
    }
    case OPT_INT:
    case OPT_INT_AUTO: {
        int v;
        memcpy(&v, field, sizeof v);
        if (v < 0) snprintf(buf, len, "auto");
        else snprintf(buf, len, "%d", v);
        break;
    }
    case OPT_FRACTION: {
        double v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, len, "%g", v);
        break;
    }
    case OPT_STRING: snprintf(buf, len, "%s", field); break;
    }
    return SPW_OK;
}

SPW_API void spw_config_print_help(FILE *f) {
    if (!f) return;
    fprintf(f, "Options (SPILLWAY_CONF=key=value,key=value or spw_config_set):\n");
    for (size_t i = 0; i < N_OPTIONS; i++) {
        fprintf(f, "  %-13s default %-7s %s", options[i].name, options[i].def, options[i].help);
        if (options[i].kind == OPT_ENUM) fprintf(f, " (%s)", options[i].choices);
        fputc('\n', f);
    }
}
