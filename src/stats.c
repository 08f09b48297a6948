/* The statistics table and JSON, generated from SPW_STAT_LIST. */
#include "stats.h"

static void human(char *buf, size_t len, int64_t v, int is_bytes) {
    if (!is_bytes) {
        snprintf(buf, len, "%lld", (long long)v);
        return;
    }
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double x = (double)v;
    int u = 0;
    while ((x >= 1024.0 || x <= -1024.0) && u < 4) {
        x /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, len, "%lld B", (long long)v);
    else snprintf(buf, len, "%.2f %s", x, units[u]);
}

void spw__stats_print_table(const spw_stats *st, const char *backend, FILE *f) {
    char b1[32], b2[32], b3[32];
    human(b1, sizeof b1, (int64_t)st->budget, 1);
    fprintf(f, "spillway memory summary (backend %s, budget %s)\n", backend, b1);
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
    fprintf(f, "{\"backend\":\"%s\",\"budget\":%llu,\"largest_free_block\":%llu", backend,
            (unsigned long long)st->budget, (unsigned long long)st->largest_free_block);
#define FIELD(name, is_bytes, desc)                                                                \
    fprintf(f, ",\"" #name "\":{\"current\":%lld,\"peak\":%lld,\"total\":%lld}",                  \
            (long long)st->name.current, (long long)st->name.peak, (long long)st->name.total);
    SPW_STAT_LIST(FIELD)
#undef FIELD
    fputc('}', f);
}
