/* Accounting and configuration of the interposer; see ledger.h for the contracts. */
#include "ledger.h"

#include "size.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- configuration ---- */

static int fail(char *err, size_t errlen, const char *fmt, const char *a, const char *b) {
    if (err && errlen) snprintf(err, errlen, fmt, a, b);
    return -1;
}

int spwp_parse_size(const char *text, bool allow_percent, spwp_size *out, char *err,
                    size_t errlen) {
    spw_size_spec v;
    if (spw__size_parse(text, SPW_SIZE_NONZERO | (allow_percent ? SPW_SIZE_PERCENT : 0), &v, err, errlen)) return -1;
    *out = (spwp_size){.bytes = v.bytes, .percent = v.percent, .is_percent = v.is_percent, .set = true};
    return 0;
}

int spwp_parse_budget(const char *text, spwp_config *cfg, char *err, size_t errlen) {
    spwp_size def = {0}, dev[SPWP_MAX_DEVICES];
    memset(dev, 0, sizeof dev);
    char buf[512];
    if (!text) text = "";
    if (strlen(text) >= sizeof buf) return fail(err, errlen, "budget '%.64s...' is too long%s", text, "");
    strcpy(buf, text);
    char *s = buf;
    /* strtok_r would merge empty entries; walk by hand so "4GiB;;" is an error. */
    for (;;) {
        char *end = strchr(s, ';');
        if (end) *end = '\0';
        /* one entry: the size grammar says what is wrong with it, empty or not */
        if (!*s && (end || s != buf)) return fail(err, errlen, "bad budget '%s': empty entry%s", text, "");
        char *colon = strchr(s, ':');
        char sub[192];
        if (colon) {
            *colon = '\0';
            char *e = NULL;
            errno = 0;
            long d = strtol(s, &e, 10);
            if (!*s || *e || errno || d < 0 || d >= SPWP_MAX_DEVICES || !isdigit((unsigned char)*s))
                return fail(err, errlen, "bad budget '%s': device '%s' is not a CUDA ordinal 0..63", text, s);
            if (dev[d].set) return fail(err, errlen, "bad budget '%s': device %s given twice", text, s);
            if (spwp_parse_size(colon + 1, true, &dev[d], sub, sizeof sub))
                return fail(err, errlen, "bad budget '%s': %s", text, sub);
        } else {
            if (def.set) return fail(err, errlen, "bad budget '%s': more than one default entry%s", text, "");
            if (spwp_parse_size(s, true, &def, sub, sizeof sub))
                return fail(err, errlen, "bad budget '%s': %s", text, sub);
        }
        if (!end) break;
        s = end + 1;
    }
    cfg->budget_default = def;
    memcpy(cfg->budget_dev, dev, sizeof dev);
    return 0;
}

int spwp_parse_bool(const char *key, const char *text, bool *out, char *err, size_t errlen) {
    static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < 4; i++) {
        if (text && !strcasecmp(text, yes[i])) return *out = true, 0;
        if (text && !strcasecmp(text, no[i])) return *out = false, 0;
    }
    return fail(err, errlen, "bad value '%s' for %s: use 1/0, true/false, yes/no or on/off",
                text ? text : "", key);
}

static void config_defaults(spwp_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->charge_managed = true;
}

int spwp_config_load(spwp_config *cfg, const char *conf, const char *budget, const char *report,
                     const char *managed, char *err, size_t errlen) {
    spwp_config c;
    config_defaults(&c);
    char sub[448];
    if (conf && *conf) {
        char buf[1024];
        if (strlen(conf) >= sizeof buf) {
            config_defaults(cfg);
            return fail(err, errlen, "SPILLWAY_CONF is too long%s%s", "", "");
        }
        strcpy(buf, conf);
        for (char *item = buf, *next; item; item = next) {
            next = strchr(item, ',');
            if (next) *next++ = '\0';
            if (!*item) continue;
            char *eq = strchr(item, '=');
            if (!eq) {
                config_defaults(cfg);
                return fail(err, errlen, "SPILLWAY_CONF: '%s' is not key=value%s", item, "");
            }
            *eq = '\0';
            const char *k = item, *v = eq + 1;
            int rc = 0;
            if (!strcmp(k, "budget")) rc = spwp_parse_budget(v, &c, sub, sizeof sub);
            else if (!strcmp(k, "report")) rc = spwp_parse_bool(k, v, &c.report, sub, sizeof sub);
            else if (!strcmp(k, "charge_managed")) rc = spwp_parse_bool(k, v, &c.charge_managed, sub, sizeof sub);
            else if (!strcmp(k, "debug")) rc = spwp_parse_bool(k, v, &c.debug, sub, sizeof sub);
            if (rc) {
                config_defaults(cfg);
                return fail(err, errlen, "SPILLWAY_CONF: %s%s", sub, "");
            }
        }
    }
    struct {
        const char *var, *val;
        int which;
    } vars[] = {{"SPILLWAY_BUDGET", budget, 0}, {"SPILLWAY_REPORT", report, 1},
                {"SPILLWAY_CHARGE_MANAGED", managed, 2}};
    for (size_t i = 0; i < 3; i++) {
        if (!vars[i].val) continue;
        int rc = vars[i].which == 0   ? spwp_parse_budget(vars[i].val, &c, sub, sizeof sub)
                 : vars[i].which == 1 ? spwp_parse_bool(vars[i].var, vars[i].val, &c.report, sub, sizeof sub)
                                      : spwp_parse_bool(vars[i].var, vars[i].val, &c.charge_managed, sub, sizeof sub);
        if (rc) {
            config_defaults(cfg);
            return fail(err, errlen, "%s: %s", vars[i].var, sub);
        }
    }
    *cfg = c;
    return 0;
}

/* ---- accounting ---- */

static bool in_range(int dev) { return dev >= 0 && dev < SPWP_MAX_DEVICES; }

static const spwp_size *budget_spec(const spwp_ledger *l, int dev) {
    if (l->cfg.budget_dev[dev].set) return &l->cfg.budget_dev[dev];
    if (l->cfg.budget_default.set) return &l->cfg.budget_default;
    return NULL;
}

/* Called with the lock held. */
static uint64_t budget_locked(const spwp_ledger *l, int dev) {
    const spwp_size *s = budget_spec(l, dev);
    if (!s) return SPWP_UNLIMITED;
    if (!s->is_percent) return s->bytes;
    if (!l->dev[dev].physical) return SPWP_UNLIMITED;
    spw_size_spec pct = {.percent = s->percent, .is_percent = true};
    return spw__size_resolve_spec(&pct, l->dev[dev].physical);
}

void spwp_ledger_init(spwp_ledger *l, const spwp_config *cfg) {
    memset(l, 0, sizeof *l);
    pthread_mutex_init(&l->lock, NULL);
    if (cfg) l->cfg = *cfg;
}

void spwp_ledger_destroy(spwp_ledger *l) {
    free(l->table);
    l->table = NULL;
    l->cap = l->count = l->tombs = 0;
    pthread_mutex_destroy(&l->lock);
}

bool spwp_ledger_needs_physical(spwp_ledger *l, int dev) {
    if (!in_range(dev)) return false;
    pthread_mutex_lock(&l->lock);
    bool r = l->dev[dev].physical == 0;
    pthread_mutex_unlock(&l->lock);
    return r;
}

void spwp_ledger_set_physical(spwp_ledger *l, int dev, uint64_t physical) {
    if (!in_range(dev) || !physical) return;
    pthread_mutex_lock(&l->lock);
    if (!l->dev[dev].physical) l->dev[dev].physical = physical;
    pthread_mutex_unlock(&l->lock);
}

uint64_t spwp_ledger_budget(spwp_ledger *l, int dev) {
    if (!in_range(dev)) return SPWP_UNLIMITED;
    pthread_mutex_lock(&l->lock);
    uint64_t b = budget_locked(l, dev);
    pthread_mutex_unlock(&l->lock);
    return b;
}

bool spwp_ledger_reserve(spwp_ledger *l, int dev, uint64_t bytes, spwp_refusal *why) {
    if (!in_range(dev) || bytes == 0) return true;
    pthread_mutex_lock(&l->lock);
    spwp_devstate *d = &l->dev[dev];
    uint64_t budget = budget_locked(l, dev);
    d->used = true;
    if (bytes > budget || d->charged > budget - bytes) {
        d->refusals++;
        if (why) *why = (spwp_refusal){.requested = bytes, .charged = d->charged, .budget = budget};
        pthread_mutex_unlock(&l->lock);
        return false;
    }
    d->charged += bytes;
    d->charges++;
    if (d->charged > d->peak) d->peak = d->charged;
    pthread_mutex_unlock(&l->lock);
    return true;
}

void spwp_ledger_refund(spwp_ledger *l, int dev, uint64_t bytes) {
    if (!in_range(dev)) return;
    pthread_mutex_lock(&l->lock);
    spwp_devstate *d = &l->dev[dev];
    d->charged = d->charged >= bytes ? d->charged - bytes : 0;
    pthread_mutex_unlock(&l->lock);
}

#define TOMB 0xff

static size_t slot_of(uint64_t key, int kind, size_t cap) {
    uint64_t h = (key ^ ((uint64_t)kind << 56)) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    return (size_t)h & (cap - 1);
}

/* Rebuild at a capacity with load at most 1/2. Called with the lock held. */
static bool table_grow(spwp_ledger *l) {
    size_t cap = l->cap ? l->cap : 512;
    while ((l->count + 1) * 2 > cap) cap *= 2;
    spwp_entry *t = calloc(cap, sizeof *t);
    if (!t) return false;
    for (size_t i = 0; i < l->cap; i++) {
        spwp_entry *e = &l->table[i];
        if (!e->kind || e->kind == TOMB) continue;
        size_t j = slot_of(e->key, e->kind, cap);
        while (t[j].kind) j = (j + 1) & (cap - 1);
        t[j] = *e;
    }
    free(l->table);
    l->table = t;
    l->cap = cap;
    l->tombs = 0;
    return true;
}

bool spwp_ledger_track(spwp_ledger *l, int kind, uint64_t key, int dev, uint64_t bytes) {
    if (!in_range(dev) || bytes == 0) return true;
    pthread_mutex_lock(&l->lock);
    if ((l->count + l->tombs + 1) * 2 > l->cap && !table_grow(l)) {
        l->untracked++;
        pthread_mutex_unlock(&l->lock);
        return false;
    }
    size_t i = slot_of(key, kind, l->cap), tomb = SIZE_MAX;
    for (;; i = (i + 1) & (l->cap - 1)) {
        spwp_entry *e = &l->table[i];
        if (!e->kind) break;
        if (e->kind == TOMB) {
            if (tomb == SIZE_MAX) tomb = i;
            continue;
        }
        if (e->kind == kind && e->key == key) {
            /* The driver handed out a key we still track: our view was stale (a free we did
             * not see). Keep the newer allocation and drop the stale charge. */
            spwp_devstate *od = &l->dev[e->dev];
            od->charged = od->charged >= e->bytes ? od->charged - e->bytes : 0;
            e->bytes = bytes;
            e->dev = dev;
            pthread_mutex_unlock(&l->lock);
            return true;
        }
    }
    if (tomb != SIZE_MAX) {
        i = tomb;
        l->tombs--;
    }
    l->table[i] = (spwp_entry){.key = key, .bytes = bytes, .dev = dev, .kind = (uint8_t)kind};
    l->count++;
    pthread_mutex_unlock(&l->lock);
    return true;
}

bool spwp_ledger_untrack(spwp_ledger *l, int kind, uint64_t key, int *dev, uint64_t *bytes) {
    pthread_mutex_lock(&l->lock);
    if (l->cap) {
        for (size_t i = slot_of(key, kind, l->cap);; i = (i + 1) & (l->cap - 1)) {
            spwp_entry *e = &l->table[i];
            if (!e->kind) break;
            if (e->kind == kind && e->key == key) {
                if (dev) *dev = e->dev;
                if (bytes) *bytes = e->bytes;
                e->kind = TOMB;
                l->count--;
                l->tombs++;
                pthread_mutex_unlock(&l->lock);
                return true;
            }
        }
    }
    pthread_mutex_unlock(&l->lock);
    return false;
}

void spwp_view_math(uint64_t budget, uint64_t charged, uint64_t phys_free, uint64_t phys_total,
                    uint64_t *free_out, uint64_t *total_out) {
    uint64_t total = budget < phys_total ? budget : phys_total;
    uint64_t room = charged < total ? total - charged : 0;
    *total_out = total;
    *free_out = phys_free < room ? phys_free : room;
}

void spwp_ledger_view(spwp_ledger *l, int dev, uint64_t phys_free, uint64_t phys_total,
                      bool learn_physical, uint64_t *free_out, uint64_t *total_out) {
    if (!in_range(dev)) {
        *free_out = phys_free;
        *total_out = phys_total;
        return;
    }
    pthread_mutex_lock(&l->lock);
    if (learn_physical && !l->dev[dev].physical) l->dev[dev].physical = phys_total;
    uint64_t budget = budget_locked(l, dev), charged = l->dev[dev].charged;
    const spwp_size *s = budget_spec(l, dev);
    if (!l->dev[dev].physical && s && s->is_percent)
        budget = (uint64_t)((double)phys_total * (s->percent / 100.0));
    pthread_mutex_unlock(&l->lock);
    spwp_view_math(budget, charged, phys_free, phys_total, free_out, total_out);
}

spwp_devstate spwp_ledger_state(spwp_ledger *l, int dev) {
    spwp_devstate s = {0};
    if (!in_range(dev)) return s;
    pthread_mutex_lock(&l->lock);
    s = l->dev[dev];
    pthread_mutex_unlock(&l->lock);
    return s;
}

static uint64_t mul_sat(uint64_t a, uint64_t b) {
    if (a && b > UINT64_MAX / a) return UINT64_MAX;
    return a * b;
}

uint64_t spwp_array_bytes(uint64_t width, uint64_t height, uint64_t depth, uint64_t elem_bytes_x2,
                          unsigned levels, bool depth_is_layers) {
    uint64_t total = 0;
    if (!levels) levels = 1;
    if (!height) height = 1;
    if (!depth) depth = 1;
    for (unsigned i = 0; i < levels; i++) {
        uint64_t n = mul_sat(mul_sat(mul_sat(width, height), depth), elem_bytes_x2);
        n = n == UINT64_MAX ? n : (n + 1) / 2;
        total = total > UINT64_MAX - n ? UINT64_MAX : total + n;
        width = width > 1 ? width / 2 : 1;
        height = height > 1 ? height / 2 : 1;
        if (!depth_is_layers) depth = depth > 1 ? depth / 2 : 1;
    }
    return total;
}
