/* The statistics table and JSON, generated from SPW_STAT_LIST. */
#include "stats.h"

static const char *human(char *buf, size_t len, int64_t v, int is_bytes) {
    if (!is_bytes) {
        snprintf(buf, len, "%lld", (long long)v);
        return buf;
    }
    char h[SPW_SIZE_FMT_MAX];
    spw__size_format(h, sizeof h, v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v);
    snprintf(buf, len, "%s%s", v < 0 ? "-" : "", h);
    return buf;
}

void spw__stats_print_table(const spw_stats *st, const char *backend, FILE *f) {
    char b1[32], b2[32], b3[32];
    human(b1, sizeof b1, (int64_t)st->budget, 1);
    if (!st->page || st->budget_usable == st->budget) {
        fprintf(f, "spillway memory summary (backend %s, budget %s)\n", backend, b1);
    } else {
        human(b2, sizeof b2, (int64_t)st->budget_usable, 1);
        human(b3, sizeof b3, (int64_t)st->page, 1);
        fprintf(f, "spillway memory summary (backend %s, budget %s, rounded down to %s: whole %s pages)\n",
                backend, b1, b2, b3);
        if (spw__size_rounding_warns(st->budget, st->budget_usable))
            fprintf(f, "  warning: the arenas hold whole %s pages, so %s of the %s budget (%.1f%%) can "
                       "never be used; give a multiple of %s\n",
                    b3, human(b2, sizeof b2, (int64_t)(st->budget - st->budget_usable), 1), b1,
                    100.0 * (double)(st->budget - st->budget_usable) / (double)st->budget, b3);
    }
    fprintf(f, "  %-20s %14s %14s %14s\n", "statistic", "current", "peak", "total");
#define ROW(name, is_bytes, desc)                                                                  \
    human(b1, sizeof b1, st->name.current, is_bytes);                                              \
    human(b2, sizeof b2, st->name.peak, is_bytes);                                                 \
    human(b3, sizeof b3, st->name.total, is_bytes);                                                \
    fprintf(f, "  %-20s %14s %14s %14s\n", #name, b1, b2, b3);
    SPW_STAT_LIST(ROW)
#undef ROW
    human(b1, sizeof b1, (int64_t)st->largest_free_block, 1);
    fprintf(f, "  %-20s %14s\n", "largest_free_block", b1);
}

void spw__stats_print_json(const spw_stats *st, const char *backend, FILE *f) {
    fprintf(f, "{\"backend\":\"%s\",\"budget\":%llu,\"budget_usable\":%llu,\"page\":%llu,\"largest_free_block\":%llu",
            backend, (unsigned long long)st->budget, (unsigned long long)st->budget_usable,
            (unsigned long long)st->page, (unsigned long long)st->largest_free_block);
#define FIELD(name, is_bytes, desc)                                                                \
    fprintf(f, ",\"" #name "\":{\"current\":%lld,\"peak\":%lld,\"total\":%lld}",                  \
            (long long)st->name.current, (long long)st->name.peak, (long long)st->name.total);
    SPW_STAT_LIST(FIELD)
#undef FIELD
    fputc('}', f);
}
