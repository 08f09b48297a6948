/*
 * Counters (spw_stats, spillway.h): updates, and the summary table and JSON (stats.c).
 */
#ifndef SPW_STATS_H
#define SPW_STATS_H

#include <stdio.h>

#include "internal.h"

/* Counter updates; the caller holds whatever lock guards the counter. */
static inline void spw__stat_add(spw_counter *c, int64_t delta) {
    c->current += delta;
    if (c->current > c->peak) c->peak = c->current;
    if (delta > 0) c->total += delta;
}
static inline void spw__stat_event(spw_counter *c) {
    c->current++;
    c->total++;
    c->peak = c->current;
}
void spw__stats_print_table(const spw_stats *st, const char *backend, FILE *f);
void spw__stats_print_json(const spw_stats *st, const char *backend, FILE *f);

#endif /* SPW_STATS_H */
